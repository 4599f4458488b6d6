#!/usr/bin/env bash
# The kernel warm-up (runtime.kernel_warmup) A/B on a fresh machine's caches, one device call:
# `slidedp bench train` of ours at BATCH (4) from SHAPE's config (qwen3-4b), each run with an
# empty Triton and Inductor cache of its own (RUNS), the warm-up off then on, twice (the first
# pair also pays the cold imports). Each report's `startup_s` says where the time went
# (`kernels_s`: the wait for the warm-up after the store's build; `first_step_s`).
# Here first: rm -f dist/*.whl; .venv/bin/maturin build --release -o dist/ -q
# Device call: carry ["dist", "wheels"], command `bash benches/gpu_kernel_warmup.sh`.
OUT=${OUT:-out/gpu-kernel-warmup}
source "$(dirname "$0")/gpu_common.sh"
SHAPE=${SHAPE:-qwen3-4b}
# RUNS: each NAME-N runs with the warm-up off or on and the caches of N (a repeated N: warm)
for run in ${RUNS:-off-1 on-1 off-2 on-2}; do
    warm=false
    [[ $run == on-* ]] && warm=true
    export TRITON_CACHE_DIR=/tmp/kw-${run#*-}/triton TORCHINDUCTOR_CACHE_DIR=/tmp/kw-${run#*-}/inductor
    within "${RUN_S:-130}" "$run" && part "$run" "${RUN_S:-130}" python3 -m slidedp bench train \
        --shape "$SHAPE" --batch "${BATCH:-4}" --systems ours --warmup 1 --steps 1 \
        --set "runtime.kernel_warmup=$warm" --json "$OUT/warmup-$run.json"
    echo "$run: kernels in its cache, as written:" | tee -a "$LOG"
    find "/tmp/kw-${run#*-}" -name '*.cubin' -printf '%TT %f\n' 2>/dev/null | sort | tee -a "$LOG"
done
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, pathlib, sys
for file in sorted(pathlib.Path(sys.argv[1]).glob("warmup-*.json")):
    run = json.loads(file.read_text())["runs"][0]
    s = run.get("startup_s") or {}
    print(file.stem, run["status"], run.get("startup_notes"), {k: s.get(k) for k in
          ("process_s", "fill_state_s", "kernels_s", "kernel_warmup_s", "first_step_s",
           "to_first_step_s")})
PY
