#!/usr/bin/env bash
# Time to the first step from a config and from a safetensors directory, one device call:
# writes SHAPE's (qwen3-4b) weights as BF16 shards (benches/make_weights.py), then `slidedp
# bench train` of ours at BATCH (4) from the config alone (the first run: cold imports and
# kernel caches, as on a fresh machine), from that directory after the page cache is dropped
# where the machine lets it (a first read from disk, as after a download), and from it again
# (the files in memory); FROM picks and orders them. Each report's `startup_s` says where the
# time went. On a 4-GPU kind (64 cores, 512 GiB) the target's runs: `SHAPE=qwen3-14b RUN_S=170
# FROM="config weights-cold"` (RUN_S: each run's limit). Here first:
#   rm -f dist/*.whl; .venv/bin/maturin build --release -o dist/ -q
# Device call: carry ["dist", "wheels"], command `bash benches/gpu_startup.sh`.
OUT=${OUT:-out/gpu-startup}
source "$(dirname "$0")/gpu_common.sh"
SHAPE=${SHAPE:-qwen3-4b}
WEIGHTS=${WEIGHTS:-/tmp/slidedp-weights-$SHAPE}
nproc | tee -a "$LOG"
df -h "$(dirname "$WEIGHTS")" | tee -a "$LOG"

FROM=${FROM:-config weights-cold weights-warm}
if [[ $FROM == *weights* ]]; then  # only a run from the directory needs it
    within 200 weights && part weights 200 python3 benches/make_weights.py --shape "$SHAPE" --out "$WEIGHTS"
fi
drop_cache() {
    sync
    if echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then
        echo "page cache dropped: the weights are read from disk" | tee -a "$LOG"
    else
        echo "page cache kept (no permission): the weights are read from memory" | tee -a "$LOG"
    fi
}
# the first run pays the cold caches (imports, Triton's kernels): the config's, as a fresh machine
for from in $FROM; do
    shape=$SHAPE
    [[ $from == weights* ]] && shape=$WEIGHTS/config.json
    [[ $from == weights-cold ]] && drop_cache
    within "${RUN_S:-150}" "startup-$from" && part "startup-$from" "${RUN_S:-150}" python3 -m slidedp bench train \
        --shape "$shape" --batch "${BATCH:-4}" --systems ours --warmup 1 --steps 1 \
        --json "$OUT/startup-$from.json"
done
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, pathlib, sys
for file in sorted(pathlib.Path(sys.argv[1]).glob("startup-*.json")):
    run = json.loads(file.read_text())["runs"][0]
    print(file.stem, run["status"], run.get("weights"), json.dumps(run.get("startup_s")))
PY
