#!/usr/bin/env bash
# Ours on N GPUs of one host at the paper's scale (Qwen3-14B, all 40 layers by default), with
# the compute-only reference projected to N GPUs, weak scaling 1 -> N in the same run: one bench
# run per batch, each under its own `timeout`, its JSON written as each system finishes.
#   GPUS=4 BATCHES=64 bash benches/gpu_four.sh                       # Qwen3-14B, B=64/GPU
#   GPUS=4 BATCHES=16 ROUTES=sharded/gpu,replicated/gpu bash benches/gpu_four.sh
# SYSTEMS: the bench's --systems (default ours,reference); ROUTES: --routes (default
# sharded/gpu); SETS: --set items; ARGS: more bench arguments (e.g. "--scaled-first
# --no-collectives": the N-GPU run first, no collectives: what a 14B B=64 run on 4 GPUs needs to
# end within one call); MEMWATCH=1 samples the host's memory into $OUT/mem.tsv.
# Here first:  rm -f dist/*.whl; .venv/bin/maturin build --release -o dist/ -q; make liger-wheels
# Device call: kind nvidia-h100-x4 (or nvidia-h200-x4), carry ["dist", "wheels"]
OUT=${OUT:-out/gpu-four}
GPUS=${GPUS:-4}
OUTER=${OUTER:-540}
((OUTER <= 545)) || { echo "gpu_four.sh: OUTER=$OUTER is over 545 s; lower it"; exit 2; }
source "$(dirname "$0")/gpu_common.sh"
SHAPE=${SHAPE:-qwen3-14b}
SET_ARGS=()
for item in ${SETS:-}; do SET_ARGS+=(--set "$item"); done
for B in ${BATCHES:-64}; do
    name="four-$SHAPE-x$GPUS-b$B-${LABEL:-fixed}"
    within "$OUTER" "$name" && part "$name" "$OUTER" timeout -s INT "$((OUTER - 10))" \
        python3 -m slidedp bench train --shape "$SHAPE" --batch "$B" --gpus "$GPUS" \
        --routes "${ROUTES:-sharded/gpu}" --warmup "${WARMUP:-2}" --steps "${STEPS:-3}" \
        --set train.max_grad_norm="${CLIP:-1.0}" "${SET_ARGS[@]}" \
        --systems "${SYSTEMS:-ours,reference}" ${ARGS:-} --json "$OUT/$name.json"
done
grep -E "^ +[0-9]+ [A-Za-z0-9:/._-]+ +[0-9]|weak scaling|efficiency|PFLOP|startup|== " "$LOG" | tail -40
