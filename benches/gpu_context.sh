#!/usr/bin/env bash
# Context parallelism (runtime.context_parallel) on GPUs, one device call per part:
#   PARTS=parity  2 GPUs at R=2 against 1 GPU, 100 bf16 steps of a tiny Qwen3 (max |Δloss|
#                 <= 1e-3: tests/multirank/test_gpu_context.py), with padded rows, packed rows
#                 and a tiny Qwen3-MoE; on nvidia-h100-x2. On a 4-GPU kind also R=4 against 1
#                 GPU. K=EXPR picks cases (pytest -k: dense, packed, moe, r4, allgather, offload,
#                 resident, frozen; K=allgather: all-gather attention, dense and packed rows at R=2, and
#                 R=4 on a 4-GPU kind; K=offload: every family's saved tensors offloaded, under
#                 Ulysses and allgather; K=resident: 2 resident layers and the embeddings;
#                 K=frozen: train.freeze with held-out evaluation, eval losses compared too).
#   PARTS=long    SHAPE (qwen3-8b; seeded init, YaRN factor SEQ/32768; LAYERS=N keeps its first N
#                 layers, OFFLOAD=r sets runtime.offload_ratio) in one sequence of SEQ tokens
#                 split over GPUS GPUs (R = GPUS), STEPS steps, clipping CLIP; the metrics
#                 (step time, tokens/s) and `slidedp estimate` of the same config (memory, the
#                 step-time model's predicted step and its all-to-all share); on
#                 nvidia-h100-x4 (SEQ=262144 GPUS=4 by default; try SEQ=524288, 1048576)
#   PARTS=bench   `slidedp bench train --context-parallel GPUS` of SHAPE (qwen3-8b; YaRN factor
#                 SEQ/32768) at one sequence of SEQ tokens a step over GPUS GPUs, first, then
#                 the compute-only reference on one GPU at SEQ, or the longest SEQ/2^k that fits
#                 (REF_SEQ=S: at S), projected by FLOP/s; $OUT/bench-SHAPE-SEQ-rGPUS.json;
#                 first `slidedp estimate` of PARTS=long's config (qwen3-8b, clipping CLIP):
#                 the predicted step beside the bench's measured one
# ATTN=allgather|ulysses sets runtime.context_attention in the long and bench parts (auto otherwise).
# In the long part: TILE=N sets runtime.mlp_tile_tokens (every dense MLP by N-token tiles);
# CP=R splits each sequence over R of the GPUS (default GPUS; CP=1: one sequence per GPU, data
# parallel, global batch GPUS/CP); LAYOUT sets runtime.layers (e.g. "16xF-r1, F").
# Context-parallel runs use eager layers, no torch.compile and a fixed layout (the keys are set
# here; the preflight refuses the others).
# Here first:  rm -f dist/*.whl; .venv/bin/maturin build --release -o dist/ -q
# Device call: carry ["dist"], command `PARTS=parity bash benches/gpu_context.sh`
OUT=${OUT:-out/gpu-context}
LIGER=0 source "$(dirname "$0")/gpu_common.sh"
SEQ=${SEQ:-262144}
GPUS=${GPUS:-4}

write_run() {  # Qwen3-8B's config (no weights: seeded init), one row of SEQ random tokens
    local dir="$1"
    mkdir -p "$dir/model"
    python3 - "$dir" "$SEQ" "$GPUS" "${STEPS:-3}" "${CLIP:-1.0}" "${ATTN:-auto}" "${SHAPE:-qwen3-8b}" \
        "${LAYERS:-0}" "${OFFLOAD:-0}" "${TILE:-0}" "${CP:-$GPUS}" "${LAYOUT:-F}" <<'PY'
import json, sys
from pathlib import Path
import torch, yaml
from transformers import Qwen3Config
from slidedp.models.shapes import SHAPES
d, seq, gpus, steps = Path(sys.argv[1]), *map(int, sys.argv[2:5])
clip, attention, shape = float(sys.argv[5]), sys.argv[6], sys.argv[7]
layers, offload, tile, cp = int(sys.argv[8]), float(sys.argv[9]), int(sys.argv[10]), int(sys.argv[11])
layout, batch = sys.argv[12], gpus // cp
cut = {"num_hidden_layers": layers} if layers else {}
Qwen3Config(**{**SHAPES[shape], **cut}).save_pretrained(d / "model")
gen = torch.Generator().manual_seed(0)
with (d / "data.jsonl").open("w") as f:
    for _ in range(steps * batch):
        f.write(json.dumps({"input_ids": torch.randint(0, 150000, (seq,), generator=gen).tolist()}) + "\n")
rope = {"rope_type": "yarn", "factor": max(1.0, seq / 32768), "original_max_position_embeddings": 32768}
config = {
    "model": {"path": str(d / "model"), "rope_scaling": rope, "max_position_embeddings": seq},
    "data": {"path": str(d / "data.jsonl"), "seq_len": seq, "pad_id": 0},
    "train": {"max_steps": steps, "global_batch_size": batch, "max_grad_norm": clip,
              "dtype": "bfloat16"},
    "output": {"dir": str(d / "out"), "tensorboard": False, "save_steps": 0},
    "runtime": {"device": "cuda", "gpus": gpus, "context_parallel": cp, "kernels": "eager",
                "compile": False, "policy": "fixed", "context_attention": attention,
                "offload_ratio": offload, "mlp_tile_tokens": tile, "layers": layout},
}
(d / "run.yaml").write_text(yaml.safe_dump(config))
PY
}

long_run() {
    local dir="$OUT/long"
    write_run "$dir"
    part estimate 120 python3 -m slidedp estimate "$dir/run.yaml"
    local name="${SHAPE:-qwen3-8b}-$SEQ-r${CP:-$GPUS}-g$GPUS${TILE:+-t$TILE}"
    part "long-$name" $((560 - SECONDS)) python3 -m slidedp train "$dir/run.yaml"
    cp "$dir/out/metrics.jsonl" "$OUT/metrics-$name.jsonl" 2>/dev/null
}

bench_run() {  # slidedp bench train with context parallelism (the bench sets its keys)
    local shape=${SHAPE:-qwen3-8b} factor=$((SEQ > 32768 ? SEQ / 32768 : 1))
    write_run "$OUT/long"  # the prediction: the step-time model of the same run
    part estimate 120 python3 -m slidedp estimate "$OUT/long/run.yaml"
    part "bench-$shape-$SEQ-r$GPUS" 560 python3 -m slidedp bench train --shape "$shape" \
        --seq "$SEQ" --batch 1 --gpus "$GPUS" --context-parallel "$GPUS" ${REF_SEQ:+--ref-seq "$REF_SEQ"} \
        --systems ours,reference --scaled-first --no-collectives --warmup 1 --steps 2 \
        --set "model.rope_scaling={rope_type: yarn, factor: $factor, original_max_position_embeddings: 32768}" \
        --set "model.max_position_embeddings=$SEQ" ${ATTN:+--set "runtime.context_attention=$ATTN"} \
        --json "$OUT/bench-$shape-$SEQ-r$GPUS.json"
}

case ${PARTS:-parity} in
    parity) part parity 540 python3 -m pytest -q -s -p no:cacheprovider -m multi_gpu \
                tests/multirank/test_gpu_context.py ${K:+-k "$K"} ;;
    long) long_run ;;
    bench) bench_run ;;
esac
grep -E "max \|dloss\||step +[0-9]|GPU|exit|error|reference|context|ours x|model \(|all-to-all" \
    "$LOG" | tail -30
