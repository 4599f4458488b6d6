#!/usr/bin/env bash
# The peers' matched-batch sweep on one GPU, a batch set per device call (< 10 minutes): ours
# (the default config) and the peers, each in its own process, every finished run kept in the
# batch's JSON (the bench rewrites it after each run). An item of BATCHES is one bench run:
# "8,32" sweeps both batches in one process tree (DeepSpeed's CPU Adam is built once). Merge
# the calls' reports afterwards:
#   slidedp bench plot --png sweep.png OUT/peers-*.json   (and the geometric means it prints)
#   BATCHES="8,32" SYSTEMS=ours,zero3-offload bash benches/gpu_peers.sh
#   BATCHES="32" SYSTEMS=ours,zero-offload LIMITS=120,zero-offload=380 bash benches/gpu_peers.sh
# LIMITS: --system-timeout, naming only systems of SYSTEMS (default 300 s each).
#   SHAPE=qwen3-8b ... CLIP=0 ... STEPS=5 ...   (clipping 1.0, 3 measured steps by default)
#   SETS="runtime.policy=auto" ...   (our config's overrides, space-separated)
#   SYSTEMS=ours,zero3-offload,zero3-offload:pf5e8 BATCHES=8 \
#     PEER_SETS="zero3-offload:pf5e8.zero_optimization.stage3_prefetch_bucket_size=5e8" \
#     bash benches/gpu_peers.sh   (PEER_SETS: --peer-set items, space-separated; SYSTEM:LABEL
#     is a variant of a peer in the same run, DeepSpeed's CPU Adam built once; LIMITS names a
#     variant by its full name)
# A system past its limit is TIMEOUT in the report; the outer limit (OUTER, 520 s) stops the
# bench as Ctrl-C does, keeping the finished runs.
#
# Here first:  rm -f dist/*.whl; .venv/bin/maturin build --release -o dist/ -q;
#              make liger-wheels peers-wheels
# Device call: carry ["dist", "wheels", "peers-wheels"]
OUT=${OUT:-out/gpu-peers}
# the install takes ~25 s of the call's 560 s: a longer OUTER would only be skipped after it
((${OUTER:-520} <= 530)) || { echo "gpu_peers.sh: OUTER=$OUTER is over 530 s; lower it"; exit 2; }
source "$(dirname "$0")/gpu_common.sh"
scripts/peers.sh install peers-wheels /tmp/peers > "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/peers PATH=/tmp/peers/bin:$PATH
SHAPE=${SHAPE:-qwen3-4b}
SET_ARGS=()
for item in ${SETS:-}; do SET_ARGS+=(--set "$item"); done
for item in ${PEER_SETS:-}; do SET_ARGS+=(--peer-set "$item"); done
for B in ${BATCHES:-4}; do
    name="peers-$SHAPE-b${B//,/-}-clip${CLIP:-1.0}${SETS:+-$(echo $SETS | tr -c "A-Za-z0-9.\n-" _)}"
    name+="${PEER_SETS:+-$(echo $PEER_SETS | tr -c "A-Za-z0-9.\n-" _)}"
    within "${OUTER:-520}" "$name" && part "$name" "${OUTER:-520}" timeout -s INT \
        "$((${OUTER:-520} - 10))" python3 -m slidedp bench train --shape "$SHAPE" --sweep "$B" \
        --warmup 2 --steps "${STEPS:-3}" --set train.max_grad_norm="${CLIP:-1.0}" "${SET_ARGS[@]}" \
        --systems "${SYSTEMS:-ours,zero3-offload}" \
        --system-timeout "${LIMITS:-300}" \
        --json "$OUT/$name.json"
done
grep -E "^ +[0-9]+ [A-Za-z0-9:._-]+ +[0-9]|ratios|summary|== " "$LOG" | tail -20
