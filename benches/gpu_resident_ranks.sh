#!/usr/bin/env bash
# GPU-resident layers and embeddings on several GPUs (each owner holds its groups' FP32 state,
# updates them on its GPU and broadcasts the weights). One device call per PARTS value:
#   PARTS=parity         2 GPUs: resident groups against the all-host run, 100 steps, the bf16
#                        bound (tests/multirank/test_gpu_resident_ranks.py); kind nvidia-h100-x2
#   PARTS=b16-fixed      4 GPUs: Qwen3-14B B=16/GPU on the fixed default (benches/gpu_four.sh)
#   PARTS=b16-resident8  the same run with 8 resident layers and the embeddings (on 4 GPUs a
#                        rank holds ~23 GB of them; the bench's 1-GPU run of it may not fit)
# Here first:  rm -f dist/*.whl; .venv/bin/maturin build --release -o dist/ -q; make liger-wheels
# Device call: carry ["dist", "wheels"], command `PARTS=parity bash benches/gpu_resident_ranks.sh`
# (kind nvidia-h100-x2), or `PARTS=b16-resident8 bash benches/gpu_resident_ranks.sh` (x4)
OUT=${OUT:-out/gpu-resident-ranks}
HERE=$(dirname "$0")
FOUR=(env OUT="$OUT" GPUS=4 BATCHES=16 ROUTES=sharded/gpu SYSTEMS=ours)
case ${PARTS:-parity} in
parity)
    source "$HERE/gpu_common.sh"
    part parity 500 python3 -m pytest -q -s -m multi_gpu tests/multirank/test_gpu_resident_ranks.py
    grep -E "max \|dloss\||passed|failed" "$LOG" | tail -6
    ;;
b16-fixed)
    "${FOUR[@]}" LABEL=fixed bash "$HERE/gpu_four.sh"
    ;;
b16-resident8)
    "${FOUR[@]}" LABEL=resident8 \
        SETS="runtime.resident_layers=8 runtime.resident_embeddings=true" bash "$HERE/gpu_four.sh"
    ;;
*)
    echo "gpu_resident_ranks.sh: PARTS=${PARTS} is none of parity, b16-fixed, b16-resident8"
    exit 2
    ;;
esac
