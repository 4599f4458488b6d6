#!/usr/bin/env bash
# Issue 17 on one GPU: mixtures of experts and long sequences, each part in its own timed
# process, every finished report kept. One device call (< 10 minutes) per PARTS value:
#   PARTS=moe     the MoE parity test (4 models, 200 steps vs FSDP2), OLMoE-1B-7B S=1024
#   PARTS=moe4k   OLMoE-1B-7B at S=4096; Qwen3-4B at 64K (YaRN factor 4), ours and reference
#   PARTS=long    Qwen3-4B at 128K; Qwen3-8B at 64K; estimate's longest sequence for Qwen3-8B
# OLMoE is cut to MOE_LAYERS (default 8) of its 16 layers, so that FSDP2-offload's host state
# fits the machine's 128 GiB beside ours (the bench's --layers; MFU counts active parameters).
# The reports come back as one archive ($OUT/models.tgz): a device call returns few files.
#
# Here first:  rm -f dist/*.whl; .venv/bin/maturin build --release -o dist/ -q; make liger-wheels
# Device call: carry ["dist", "wheels"]
OUT=${OUT:-out/gpu-models}
source "$(dirname "$0")/gpu_common.sh"
JSON=$(mktemp -d)
MOE=(python3 -m slidedp bench train --shape olmoe-1b-7b --layers "${MOE_LAYERS:-8}" --warmup 2
     --steps 3 --systems ours,reference,fsdp2 --set model.output_router_logits=true)
LONG=(python3 -m slidedp bench train --batch 1 --warmup 1 --steps 2 --systems ours,reference)
# Qwen3's YaRN setting (its model card): factor 4 over the 32K it was trained at
YARN_128K=(--set model.max_position_embeddings=131072 --set
           "model.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}")

case ${PARTS:-moe} in
    moe)
        SLIDEDP_PARITY_JSON=$JSON/parity.json part moe-parity 240 python3 -m pytest -q -s \
            -p no:cacheprovider -m "gpu and slow" tests/engine/test_gpu_moe_parity.py
        part olmoe-s1024 300 "${MOE[@]}" --batch 16 --seq 1024 \
            --system-timeout 150,fsdp2=200 --json "$JSON/olmoe-s1024-b16.json" ;;
    moe4k)
        part olmoe-s4096 280 "${MOE[@]}" --batch 4 --seq 4096 \
            --system-timeout 130,fsdp2=180 --json "$JSON/olmoe-s4096-b4.json"
        part qwen3-4b-64k 260 "${LONG[@]}" --shape qwen3-4b --seq 65536 "${YARN_128K[@]}" \
            --system-timeout 130 --json "$JSON/qwen3-4b-s65536.json" ;;
    long)
        part qwen3-4b-128k 280 "${LONG[@]}" --shape qwen3-4b --seq 131072 "${YARN_128K[@]}" \
            --system-timeout 140 --json "$JSON/qwen3-4b-s131072.json"
        part qwen3-8b-64k 280 "${LONG[@]}" --shape qwen3-8b --seq 65536 "${YARN_128K[@]}" \
            --system-timeout 200,reference=80 --json "$JSON/qwen3-8b-s65536.json" ;;
esac
tar czf "$OUT/models.tgz" -C "$JSON" .
grep -E "^ +[0-9]+ (ours|reference|fsdp2)|passed|failed|max_abs|exit|Error|error" "$LOG" | tail -30
