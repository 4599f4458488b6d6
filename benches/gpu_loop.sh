#!/usr/bin/env bash
# Around the training loop on one H100, in one device call of under 8 minutes: a
# Qwen3-14B-shaped model cut to 4 decoder layers (config only, seeded random init, B=4 x 1024):
#   eval        held-out evaluation's tokens/s against training's, same run ($OUT/eval.json)
#   unfrozen    the reference run's host store, PSS and step time ($OUT/freeze-none.json)
#   frozen      the same with train.freeze=[embed_tokens] ($OUT/freeze-embed_tokens.json)
# Each part writes its JSON as it finishes; a part the call's time cannot fit is skipped.
#
# Here first:  .venv/bin/maturin build --release -o dist/ -q && make liger-wheels
# Device call: carry ["dist", "wheels"], command `bash benches/gpu_loop.sh`
OUT=${OUT:-out/gpu-loop}
source "$(dirname "$0")/gpu_common.sh"
BENCH=(python3 benches/loop_bench.py --layers "${LAYERS:-4}" --batch 4 --seq-len 1024)
within 170 eval && part eval 170 "${BENCH[@]}" eval --steps 6 --eval-rows 32 \
    --json "$OUT/eval.json"
within 130 unfrozen && part unfrozen 130 "${BENCH[@]}" freeze --steps 5 \
    --json "$OUT/freeze-none.json"
within 130 frozen && part frozen 130 "${BENCH[@]}" freeze --steps 5 --freeze embed_tokens \
    --json "$OUT/freeze-embed_tokens.json"
grep -hE '"(eval_tokens_per_s|train_tokens_per_s_median|eval_over_train|store_bytes|host_pss_bytes|step_time_s_median|skipped)"' \
    "$OUT"/*.json 2>/dev/null | tail -20
