#!/usr/bin/env bash
# GPU-resident layers on the GPU machine; each PARTS value is one device call of
# under 10 minutes on an H100 (a fresh machine compiles Liger's Triton kernels in its first
# run: the limits leave room for that):
#   PARTS=b4      the host probe, then Qwen3-4B B=4 (host-bound): the fixed default against all
#                 36 layers resident (47 GiB at 1.32 GiB a layer)
#   PARTS=b16     the same pair at B=16
#   PARTS=parity  resident layers against the all-host run, 200 steps, the bf16 bound
# CLIP=0 runs the bench pairs without clipping (default: 1.0, the config default).
#
# Here first:  .venv/bin/maturin build --release -o dist/ -q && make liger-wheels
# Device call: carry ["dist", "wheels"], command `PARTS=b4 bash benches/gpu_resident.sh`
OUT=${OUT:-out/gpu-resident}
source "$(dirname "$0")/gpu_common.sh"
CLIP=${CLIP:-1.0}
BENCH=(python3 -m slidedp bench train --shape qwen3-4b --warmup 2 --steps 3 --systems ours
       --set train.max_grad_norm="$CLIP")
case ${PARTS:-b4} in
b4 | b16)
    [[ $PARTS == b4 ]] && part host 40 python3 -m slidedp profile host
    B=${PARTS#b}
    part "b$B-fixed" 240 "${BENCH[@]}" --batch "$B" --json "$OUT/b$B-clip$CLIP-fixed.json"
    part "b$B-resident" 240 "${BENCH[@]}" --batch "$B" --set runtime.resident_layers=36 \
        --json "$OUT/b$B-clip$CLIP-resident36.json"
    ;;
parity)
    part parity 500 env SLIDEDP_PARITY_JSON="$OUT/parity.json" python3 -m pytest -q -s \
        -m "gpu and slow" tests/engine/test_gpu_resident.py
    ;;
esac
grep -E "^ +(4|16) ours|exposed wait|GB/s|passed|failed" "$LOG" | tail -14
