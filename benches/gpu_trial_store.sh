#!/usr/bin/env bash
# The cold selection with and without the trials' shared host store (autopolicy/trial_store.py),
# in one device call: `slidedp plan` of Qwen3-4B B=16, S=1024, clipping 1.0 (gpu_decide.sh's
# run), each build on its own empty profile, selection, Triton and Inductor caches; the build
# under test first (it pays the cold page cache). Each plan's selection clause (every stage's
# seconds) and wall time go to $OUT/log.txt and $OUT/selection.txt.
#
# Here first: the build to compare in dist/before/ (`mkdir -p dist/before && mv dist/*.whl
# dist/before/` before building again), the build under test in dist/
# (`.venv/bin/maturin build --release -o dist/ -q`), Liger's in wheels/ (`make liger-wheels`).
# Device call: carry ["dist", "wheels"], command `bash benches/gpu_trial_store.sh` (~8 min)
OUT=${OUT:-out/gpu-trial-store}
source "$(dirname "$0")/gpu_common.sh"
WORK=$(mktemp -d)
python3 - "$WORK" <<'PY'
import json, sys
from pathlib import Path
import torch
from slidedp.models.shapes import resolve_shape
work = Path(sys.argv[1])
config = resolve_shape("qwen3-4b")
config.save_pretrained(work / "model")
g = torch.Generator().manual_seed(0)
rows = torch.randint(0, config.vocab_size, (16 * 4, 1024), generator=g).tolist()
(work / "train.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
PY
cat > "$WORK/run.yaml" <<YAML
model: {path: $WORK/model}
data: {path: $WORK/train.jsonl, seq_len: 1024, packing: false, shuffle: false}
train: {max_steps: 2, global_batch_size: 16, max_grad_norm: 1.0}
output: {dir: $WORK/out, save_steps: 0, export: false}
runtime: {device: cuda}
YAML

for build in shared before; do
    wheel=dist/*.whl
    [[ $build == before ]] && wheel=dist/before/*.whl
    python3 -m pip install -q --no-deps --force-reinstall $wheel
    within 250 "plan-$build" || break
    start=$SECONDS
    XDG_CACHE_HOME=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \
        part "plan-$build" 250 python3 -m slidedp plan "$WORK/run.yaml" --out "$OUT/plan-$build.yaml"
    echo "plan-$build: $((SECONDS - start)) s wall" | tee -a "$OUT/selection.txt" "$LOG"
    grep -oE "selection [0-9.]+ s \([^)]*\)" "$LOG" | tail -1 | sed "s/^/$build: /" \
        | tee -a "$OUT/selection.txt"
done
grep -E "^policy|validated|calibrated" "$LOG" | tail -6
