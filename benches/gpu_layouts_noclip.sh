#!/usr/bin/env bash
# The activation layouts' last rows on the GPU machine, one device call (about 8 minutes on an
# H100): Qwen3-4B without clipping at B=8 (all F vs 36xN, 51.3 GiB estimated) and B=32 (all F vs
# 10xF, 26xSAC.mm, 66.6 GiB estimated), each pair in the same call, eager kernels as the other rows
# (benchmarks/2026-11-23-activation-layouts-h100.md, second measurement).
#
# Here first:  .venv/bin/maturin build --release -o dist/ -q && make liger-wheels
# Device call: carry ["dist", "wheels"], command `bash benches/gpu_layouts_noclip.sh`
OUT=${OUT:-out/gpu-layouts}
source "$(dirname "$0")/gpu_common.sh"

BENCH=(python3 -m slidedp bench train --shape qwen3-4b --warmup 2 --steps 3 --systems ours
       --set train.max_grad_norm=0 --set runtime.kernels=eager --set runtime.compile=false)
part b8-F 150 "${BENCH[@]}" --batch 8 --json "$OUT/b8-noclip-F.json"
part b8-N 130 "${BENCH[@]}" --batch 8 --set runtime.layers=36xN --json "$OUT/b8-noclip-N.json"
part b32-F 140 "${BENCH[@]}" --batch 32 --json "$OUT/b32-noclip-F.json"
part b32-L 140 "${BENCH[@]}" --batch 32 --set "runtime.layers=10xF, 26xSAC.mm" \
    --json "$OUT/b32-noclip-L.json"
grep -E "^ +[0-9]+ ours|exposed wait" "$LOG" | tail -8
