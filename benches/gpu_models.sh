#!/usr/bin/env bash
# Models on one GPU: mixtures of experts and long sequences, each part in its own timed
# process, every finished report kept. PARTS lists what one device call (< 10 minutes) runs:
#   parity  the MoE parity test (4 models, 200 steps vs FSDP2; PARITY_K: pytest's -k), ~2 min
#   moe     OLMoE-1B-7B S=1024: ours, reference, FSDP2-offload, ~4 min
#   moe4k   OLMoE-1B-7B at S=4096, the same three, ~4 min
#   long    Qwen3-4B at 128K (YaRN factor 4), ours and reference, B=1, one measured step
#   long64k Qwen3-4B at 64K, the same, two measured steps
#   long8b  Qwen3-8B at 64K, the same, one measured step
#   long8b128k  Qwen3-8B at 128K without clipping (its parked gradients free 16 GiB), ours
#   longest slidedp estimate --longest-seq for Qwen3-4B and 8B (YaRN factor 8: up to 256K)
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
# Qwen3's YaRN setting (its model card): factor 4 over the 32K it was trained at
LONG=(python3 -m slidedp bench train --batch 1 --warmup 1 --systems ours,reference
      --set model.max_position_embeddings=131072 --set
      "model.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}")

for PART in ${PARTS:-parity moe}; do case $PART in
    parity)
        SLIDEDP_PARITY_JSON=$JSON/parity.json part moe-parity 240 python3 -m pytest -q -s \
            -p no:cacheprovider -m "gpu and slow" -k "${PARITY_K:-}" \
            tests/engine/test_gpu_moe_parity.py ;;
    moe)
        within 300 olmoe-s1024 && part olmoe-s1024 300 "${MOE[@]}" --batch 16 --seq 1024 \
            --system-timeout 150,fsdp2=200 --json "$JSON/olmoe-s1024-b16.json" ;;
    moe4k)
        within 280 olmoe-s4096 && part olmoe-s4096 280 "${MOE[@]}" --batch 4 --seq 4096 \
            --system-timeout 130,fsdp2=180 --json "$JSON/olmoe-s4096-b4.json" ;;
    long)
        within 420 qwen3-4b-128k && part qwen3-4b-128k 420 "${LONG[@]}" --shape qwen3-4b \
            --seq 131072 --steps 1 --system-timeout 200 --json "$JSON/qwen3-4b-s131072.json" ;;
    long64k)
        within 260 qwen3-4b-64k && part qwen3-4b-64k 260 "${LONG[@]}" --shape qwen3-4b \
            --seq 65536 --steps 2 --system-timeout 130 --json "$JSON/qwen3-4b-s65536.json" ;;
    long8b)
        within 440 qwen3-8b-64k && part qwen3-8b-64k 440 "${LONG[@]}" --shape qwen3-8b \
            --seq 65536 --steps 1 --system-timeout 330,reference=100 \
            --json "$JSON/qwen3-8b-s65536.json" ;;
    long8b128k)
        within 420 qwen3-8b-128k && part qwen3-8b-128k 420 "${LONG[@]}" --shape qwen3-8b \
            --seq 131072 --steps 1 --systems ours --set train.max_grad_norm=0 \
            --json "$JSON/qwen3-8b-s131072-noclip.json" ;;
    longest)
        for shape in qwen3-4b qwen3-8b; do
            dir=$(mktemp -d)
            python3 -c "from slidedp.models.shapes import resolve_shape as r
r('$shape').to_json_file('$dir/config.json')"
            echo '{"input_ids": [1, 2, 3]}' > "$dir/data.jsonl"
            printf '%s\n' "model: {path: $dir, max_position_embeddings: 262144, rope_scaling:" \
                "  {rope_type: yarn, factor: 8.0, original_max_position_embeddings: 32768}}" \
                "data: {path: $dir/data.jsonl, seq_len: 65536}" "output: {dir: $dir/out}" \
                "train: {max_steps: 1, global_batch_size: 1}" "runtime: {device: cuda}" \
                > "$dir/run.yaml"
            part "longest-$shape" 120 python3 -m slidedp estimate "$dir/run.yaml" --longest-seq \
                --json
            part "longest-$shape-noclip" 120 python3 -m slidedp estimate "$dir/run.yaml" \
                train.max_grad_norm=0 --longest-seq --json
            cp "$dir/run.yaml" "$JSON/longest-$shape.yaml"
        done ;;
    *) echo "PARTS: parity moe moe4k long long64k long8b long8b128k longest, not $PART"; exit 2 ;;
esac; done
tar czf "$OUT/models.tgz" -C "$JSON" .
grep -E "^ +[0-9]+ (ours|reference|fsdp2)|passed|failed|max_abs|exit|Error|error" "$LOG" | tail -30
