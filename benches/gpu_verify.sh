#!/usr/bin/env bash
# GPU checks of changes made without a GPU, one device call (two GPUs suffice: nvidia-h200-x2;
# on a 4-GPU kind the rank tests use two of them). Each part's limit is cut to what is left of
# the call's 10 minutes (`within`), so a slow part skips the next instead of the call returning
# nothing:
#   ranks     the multi-GPU parity of the routes (replicated and sharded: what each rank
#             page-locks, runtime/pinning.py) and of GPU-resident state on 2 ranks, 100 bf16
#             steps against one GPU (tests/multirank/test_gpu_ranks.py, test_gpu_resident_ranks.py)
#   resident  GPU-resident layers on one GPU (tests/engine/test_gpu_resident.py)
#   tiled     the sequence-tiled MLP against FSDP2, Liger and compiled layers
#             (tests/engine/test_gpu_parity.py -k tiled)
#   attention SDPA's rate at long rows per backend (benches/attention_rate.py; ATTN_SHAPE,
#             default qwen3-8b at 4 context ranks, 131,072 to 1,048,576 keys)
# PARTS picks and orders them (default: all four). Here first:
#   rm -f dist/*.whl; .venv/bin/maturin build --release -o dist/ -q
# Device call: carry ["dist", "wheels"], command `bash benches/gpu_verify.sh`.
OUT=${OUT:-out/gpu-verify}
source "$(dirname "$0")/gpu_common.sh"
PYTEST=(python3 -m pytest -q -s -p no:cacheprovider)

left() { echo $((560 - SECONDS)); }  # seconds this call still has for a part

for what in ${PARTS:-ranks resident tiled attention}; do
    case $what in
        ranks) within 120 ranks && part ranks "$(left)" "${PYTEST[@]}" -m "gpu or multi_gpu" \
                   tests/multirank/test_gpu_ranks.py tests/multirank/test_gpu_resident_ranks.py ;;
        resident) within 60 resident && part resident "$(left)" "${PYTEST[@]}" -m "gpu or multi_gpu" \
                      tests/engine/test_gpu_resident.py ;;
        tiled) within 120 tiled && part tiled "$(left)" "${PYTEST[@]}" -m "gpu and slow" \
                   tests/engine/test_gpu_parity.py -k tiled ;;
        attention) within 60 attention && part attention "$(left)" python3 benches/attention_rate.py \
                       --shape "${ATTN_SHAPE:-qwen3-8b}" --context 4 \
                       --seq 131072 262144 524288 1048576 --backends default flash cudnn ;;
        *) echo "unknown part: $what" | tee -a "$LOG" ;;
    esac
done
grep -E "passed|failed|error|max \|dloss\||\"backend\"|exit" "$LOG" | tail -40
