#!/usr/bin/env bash
# Fast layer compute on the GPU machine, one device call (< 10 minutes on an H100): fast layer
# compute.
#
# Here first:  .venv/bin/maturin build --release -o dist/ -q && make liger-wheels
# Device call: carry ["dist", "wheels"], command `PARTS=layers bash benches/gpu_fast_layers.sh`
#
# Each part has its own timeout and writes its JSON under $OUT as soon as it finishes; every
# part's output also goes to $OUT/log.txt.
# PARTS=layers (the first call):
#   1. one Qwen3-8B decoder layer, B=16, S=1024, fwd+bwd without replay: eager, Liger, then
#      compiled, both — model TFLOP/s and the top kernels of each (slidedp profile layer --kernels)
#   2. slidedp bench train --shape qwen3-4b --batch 16, ours and the reference with the new
#      defaults, no clipping (benchmarks/2026-11-23-activation-layouts-h100.md ran the same eager)
#   3. the FSDP2 parity tests with Liger and with the compiled layer (200 steps each; the
#      liger+compiled case and the eager test are left for another call: time)
OUT=${OUT:-out/gpu-fast}
source "$(dirname "$0")/gpu_common.sh"

# PARTS=train: the training targets with Liger's kernels (the default where installed):
#   the reference at Qwen3-8B B=16; ours and the reference at Qwen3-4B B=32 (clipping 1.0),
#   at S=32768 B=1, and with every layer N (no replay) at B=8
if [[ ${PARTS:-layers} == train ]]; then
    BENCH=(python3 -m slidedp bench train --warmup 2 --steps 3)
    part 8b-b16-reference 120 "${BENCH[@]}" --shape qwen3-8b --batch 16 --systems reference \
        --json "$OUT/qwen3-8b-b16-reference.json"
    within 150 4b-b32 && part 4b-b32 150 "${BENCH[@]}" --shape qwen3-4b --batch 32 \
        --systems ours,reference --json "$OUT/qwen3-4b-b32.json"
    within 150 4b-s32k && part 4b-s32k 150 "${BENCH[@]}" --shape qwen3-4b --batch 1 --seq 32768 \
        --systems ours,reference --json "$OUT/qwen3-4b-s32768.json"
    within 150 4b-b8-n && part 4b-b8-n 150 "${BENCH[@]}" --shape qwen3-4b --batch 8 \
        --systems ours,reference --set runtime.layers=N --json "$OUT/qwen3-4b-b8-n.json"
    grep -E "^ +[0-9]+ (ours|reference)|exposed|layer compute|== " "$LOG" | tail -30
    exit
fi
LAYER=(python3 -m slidedp profile layer --shape qwen3-8b --batch 16 --seq-len 1024 --warmup 3
       --steps 10 --top 12)
# uncompiled first: a slow compilation must not cost the eager and Liger figures
part layer-eager 60 "${LAYER[@]}" --kernels eager,liger --json "$OUT/layer-qwen3-8b-b16-eager.json"
part layer-compiled 150 "${LAYER[@]}" --kernels compiled,liger+compiled \
    --json "$OUT/layer-qwen3-8b-b16-compiled.json"
part bench 220 python3 -m slidedp bench train --shape qwen3-4b --batch 16 --systems ours,reference \
    --warmup 2 --steps 3 --set train.max_grad_norm=0 --json "$OUT/bench-qwen3-4b-b16.json"
# -W default: a warning from Liger or the compiler is printed here, not the end of the run
part parity 140 env SLIDEDP_PARITY_JSON="$OUT/parity.json" python3 -m pytest -q -s -W default \
    -m "gpu and slow" tests/engine/test_gpu_parity.py \
    -k "fused_and_compiled and (liger-False or eager-True)"
tail -c 6000 "$LOG"
