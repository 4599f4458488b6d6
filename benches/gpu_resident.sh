#!/usr/bin/env bash
# Issue 16's GPU-resident layers on the GPU machine, one device call (< 10 minutes on an H100):
# the host probe, Qwen3-4B at B=4 (the host-bound point: default vs all 36 layers resident,
# 47 GiB at 1.32 GiB a layer) and at B=16 (all resident), clipping 1.0 (the default), then the
# parity test (resident layers against the all-host run, 200 steps, the bf16 bound).
#
# Here first:  .venv/bin/maturin build --release -o dist/ -q && make liger-wheels
# Device call: carry ["dist", "wheels"], command `bash benches/gpu_resident.sh`
OUT=${OUT:-out/gpu-resident}
source "$(dirname "$0")/gpu_common.sh"

part host 40 python3 -m slidedp profile host
python3 -m slidedp profile host --json > "$OUT/host.json"  # the cached report
BENCH=(python3 -m slidedp bench train --shape qwen3-4b --warmup 2 --steps 3 --systems ours)
part b4-fixed 110 "${BENCH[@]}" --batch 4 --json "$OUT/b4-fixed.json"
part b4-resident 120 "${BENCH[@]}" --batch 4 --set runtime.resident_layers=36 \
    --json "$OUT/b4-resident36.json"
part b16-resident 130 "${BENCH[@]}" --batch 16 --set runtime.resident_layers=36 \
    --json "$OUT/b16-resident36.json"
part parity 170 env SLIDEDP_PARITY_JSON="$OUT/parity.json" python3 -m pytest -q -s \
    -m "gpu and slow" tests/engine/test_gpu_resident.py
grep -E "^ +(4|16) ours|exposed wait|GB/s|passed|failed" "$LOG" | tail -14
