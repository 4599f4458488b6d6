#!/usr/bin/env bash
# AutoPolicy's targets table on the GPU machine: the fixed default against runtime.policy=auto,
# same call, batch by batch (each pair in its own processes, the JSON of every finished run
# kept). One device call of under 10 minutes per setting:
#   BATCHES="4 16 8 32" CLIP=1.0 bash benches/gpu_targets.sh          (the config default)
#   BATCHES="4 16 8 32" CLIP=0 REF="16 32" bash benches/gpu_targets.sh (and the reference)
#   SHAPE=qwen3-8b BATCHES=16 bash benches/gpu_targets.sh
# STEPS=N measured steps (3 by default); FIXED=0 leaves out the fixed default (auto against the
# reference alone: BATCHES=16 FIXED=0 REF=16 STEPS=5 ...).
# VALIDATE=N lets auto validate its choice against the default in N-step trials before it
# trains (runtime.policy_validate_steps; the bench's default is 0); CALIBRATE=N lets it
# calibrate its candidates on a reduced model first (runtime.policy_calibrate_steps; also 0).
# A part that would pass the call's 560 s is skipped and says so. The reports come back as one
# archive ($OUT/targets.tgz), since a device call returns few files.
#
# Here first:  .venv/bin/maturin build --release -o dist/ -q && make liger-wheels
# Device call: carry ["dist", "wheels"]
OUT=${OUT:-out/gpu-targets}
source "$(dirname "$0")/gpu_common.sh"
SHAPE=${SHAPE:-qwen3-4b}
CLIP=${CLIP:-1.0}
LIMIT=${LIMIT:-200}
JSON=$(mktemp -d)
BENCH=(python3 -m slidedp bench train --shape "$SHAPE" --warmup 2 --steps "${STEPS:-3}"
       --set train.max_grad_norm="$CLIP")

for B in ${BATCHES:-4 16}; do
    name="$SHAPE-b$B-clip$CLIP"
    [[ ${FIXED:-1} == 0 ]] || { within "$LIMIT" "$name-fixed" && part "$name-fixed" "$LIMIT" \
        "${BENCH[@]}" --systems ours --batch "$B" --json "$JSON/$name-fixed.json"; }
    within "$LIMIT" "$name-auto" && part "$name-auto" "$LIMIT" "${BENCH[@]}" --systems ours \
        --batch "$B" --set runtime.policy=auto --set runtime.policy_validate_steps="${VALIDATE:-0}" \
        --set runtime.policy_calibrate_steps="${CALIBRATE:-0}" --json "$JSON/$name-auto.json"
done
for B in ${REF:-}; do
    within 120 "$SHAPE-b$B-reference" && part "$SHAPE-b$B-reference" 120 "${BENCH[@]}" \
        --systems reference --batch "$B" --json "$JSON/$SHAPE-b$B-reference.json"
done
tar czf "$OUT/targets.tgz" -C "$JSON" .
grep -E "^ +[0-9]+ (ours|reference)|policy   auto|validat|exposed wait|skipped|exit" "$LOG" | tail -30
