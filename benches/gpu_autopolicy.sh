#!/usr/bin/env bash
# AutoPolicy's GPU check (and the fast layers' parity) on the GPU machine, two device calls (each <
# 10 minutes on an H100): PARTS=parity runs part 1 (about 4 minutes), PARTS=bench parts 2 and 3
# (about 9).
#
# Here first:  .venv/bin/maturin build --release -o dist/ -q && make liger-wheels
# Device call: carry ["dist", "wheels"], command `PARTS=bench bash benches/gpu_autopolicy.sh`
#
# Each part has its own timeout and writes under $OUT as it finishes (log.txt has everything):
#   1. the compiled-layer FSDP2 parity with SAC layers (eager-True), after the SAC fix
#   2. Qwen3-4B B=16 without clipping: ours with the fixed default (all F) and with
#      runtime.policy=auto (the layer profiled on the GPU, then the layout the program chooses;
#      the profile's time is outside the timed steps and in the log)
#   3. the same pair with clipping 1.0 (the profile is cached by then)
OUT=${OUT:-out/gpu-autopolicy}
source "$(dirname "$0")/gpu_common.sh"

if [[ ${PARTS:-all} != bench ]]; then
part parity 280 env SLIDEDP_PARITY_JSON="$OUT/parity.json" python3 -m pytest -q -s -W default \
    -m "gpu and slow" tests/engine/test_gpu_parity.py -k "fused_and_compiled and eager-True"
fi
[[ ${PARTS:-all} == parity ]] && exit 0
BENCH=(python3 -m slidedp bench train --shape qwen3-4b --batch 16 --warmup 2 --steps 3
       --systems ours)
for clip in 0 1.0; do
    part "fixed-clip$clip" 130 "${BENCH[@]}" --set train.max_grad_norm=$clip \
        --json "$OUT/fixed-clip$clip.json"
    part "auto-clip$clip" 200 "${BENCH[@]}" --set train.max_grad_norm=$clip \
        --set runtime.policy=auto --json "$OUT/auto-clip$clip.json"
done
grep -E "^ +16 ours|policy   auto|exposed wait" "$LOG" | tail -12
