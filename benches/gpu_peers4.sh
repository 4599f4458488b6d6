#!/usr/bin/env bash
# The peers on N GPUs of one host beside ours (weak scaling, same command): one bench run per
# system and batch, each under its own `timeout`, its JSON rewritten as each run finishes
# (the 1-GPU run of the system, then its run on N GPUs, the collectives once per call).
#   GPUS=4 SYSTEMS=ours bash benches/gpu_peers4.sh                  # Qwen3-14B, B=16
#   GPUS=4 BATCHES=64 SYSTEMS=zero3-optim-offload bash benches/gpu_peers4.sh
#   GPUS=2 SHAPE=qwen3-8b BATCHES=32 SYSTEMS=zero3-offload OUTER=260 LIMIT=200 \
#     bash benches/gpu_peers4.sh
#   SYSTEMS="zero3-offload:rb5e8" \
#     PEER_SETS="zero3-offload:rb5e8.zero_optimization.reduce_bucket_size=5e8" \
#     bash benches/gpu_peers4.sh   (a named variant at N, its buckets set; PEER_SETS:
#     --peer-set items, space-separated)
# SYSTEMS: space-separated, default ours, zero3-offload (ZeRO-3, parameters and optimizer
# offloaded), zero3-optim-offload (ZeRO-3, optimizer offloaded, cores bound per rank),
# fsdp2-resident (GPU-resident FSDP2: OOM where it does not fit), fsdp2 (FSDP2 CPU offload).
# LIMIT: each run's --system-timeout (default 400 s); OUTER: the bench's (default 520 s, at most
# 530: the install takes ~25 s of the call's 560).
# A part that could end past the device call's 10 minutes is skipped (`within`): with the
# default OUTER one part fits a call, so give one system and one batch per call (a smaller
# OUTER fits more). Merge the calls' JSON afterwards:
#   slidedp bench plot --png peers4.png OUT/peers4-*.json
#
# Here first:  rm -f dist/*.whl; .venv/bin/maturin build --release -o dist/ -q;
#              make liger-wheels peers-wheels
# Device call: kind nvidia-h100-x4 (or -x2), carry ["dist", "wheels", "peers-wheels"]
OUT=${OUT:-out/gpu-peers4}
GPUS=${GPUS:-4}
((${OUTER:-520} <= 530)) || { echo "gpu_peers4.sh: OUTER=$OUTER is over 530 s; lower it"; exit 2; }
source "$(dirname "$0")/gpu_common.sh"
scripts/peers.sh install peers-wheels /tmp/peers > "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/peers PATH=/tmp/peers/bin:$PATH
SHAPE=${SHAPE:-qwen3-14b}
SET_ARGS=()
for item in ${SETS:-}; do SET_ARGS+=(--set "$item"); done
for item in ${PEER_SETS:-}; do SET_ARGS+=(--peer-set "$item"); done
for B in ${BATCHES:-16}; do
    for SYSTEM in ${SYSTEMS:-ours zero3-offload zero3-optim-offload fsdp2-resident fsdp2}; do
        name="peers4-$SHAPE-x$GPUS-b$B-$(echo "$SYSTEM" | tr -c "A-Za-z0-9.\n-" _)"
        within "${OUTER:-520}" "$name" && part "$name" "${OUTER:-520}" timeout -s INT \
            "$((${OUTER:-520} - 10))" python3 -m slidedp bench train --shape "$SHAPE" \
            --batch "$B" --gpus "$GPUS" --warmup 2 --steps "${STEPS:-3}" \
            --set train.max_grad_norm="${CLIP:-1.0}" "${SET_ARGS[@]}" --systems "$SYSTEM" \
            --system-timeout "${LIMIT:-400}" --json "$OUT/$name.json"
    done
done
grep -E "^ +[0-9]+ [A-Za-z0-9:._-]+ +[0-9]|weak scaling|efficiency|ratios|== " "$LOG" | tail -40
