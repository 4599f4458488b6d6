#!/usr/bin/env bash
# `slidedp plan` on the GPU: plan a Qwen3-1.7B run on this GPU (every stage: layer
# profile, host probe, chunk probe, solve, calibration, validation, the estimate's check), then
# train a few steps with the plan it wrote, and a second `train` with
# runtime.policy=auto, which must take the plan's choice from the selection cache (no profile,
# probe nor trial). One device call of under 10 minutes on an H100; each part has a timeout.
#
# Here first:  .venv/bin/maturin build --release -o dist/ -q && make liger-wheels
# Device call: carry ["dist", "wheels"], command `bash benches/gpu_plan.sh`
# SHAPE (qwen3-1.7b), BATCH (16) and CLIP (1.0) set the run. Each `train` writes its final
# checkpoint (12 B/param of host state: 20 GB here), deleted before the next one. The
# calibration's spread, two plans without validation nor training:
#   SHAPE=qwen3-4b PLANS=2 TRAIN=0 PLAN_LIMIT=250 \
#     PLAN_SETS="runtime.policy_validate_steps=0" bash benches/gpu_plan.sh
OUT=${OUT:-out/gpu-plan}
source "$(dirname "$0")/gpu_common.sh"
SHAPE=${SHAPE:-qwen3-1.7b}
WORK=$(mktemp -d)
# the bench's model (config.json only: random init) and synthetic token rows
python3 - "$SHAPE" "$WORK" "${BATCH:-16}" <<'EOF'
import json, sys
from pathlib import Path
import torch
from slidedp.models.shapes import resolve_shape
shape, work, batch = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
config = resolve_shape(shape)
config.save_pretrained(work / "model")
g = torch.Generator().manual_seed(0)
rows = torch.randint(0, config.vocab_size, (batch * 40, 1024), generator=g).tolist()
(work / "train.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
EOF
cat > "$WORK/run.yaml" <<EOF
model: {path: $WORK/model}
data: {path: $WORK/train.jsonl, seq_len: 1024, packing: false, shuffle: false}
train: {max_steps: 6, global_batch_size: ${BATCH:-16}, max_grad_norm: ${CLIP:-1.0}}
output: {dir: $WORK/out, save_steps: 0, export: false}
runtime: {device: cuda}
EOF
# PLANS=N plans N times (the calibration's spread), PLAN_SETS its overrides, TRAIN=0 no train
for n in $(seq "${PLANS:-1}"); do
    part "plan-$n" "${PLAN_LIMIT:-330}" python3 -m slidedp plan "$WORK/run.yaml" \
        --out "$OUT/plan-$n.json" ${PLAN_SETS:-}
done
cp "$OUT/plan-1.json" "$OUT/plan.json" 2>/dev/null
[[ ${TRAIN:-1} == 0 ]] && { grep -E "^slidedp plan (calibrate|validation)|exit" "$LOG"; exit 0; }
part train-policy 120 python3 -m slidedp train --plan "$OUT/plan.json" "$WORK/run.yaml" \
    output.dir="$WORK/out-policy"
rm -rf "$WORK/out-policy"/checkpoint-*
part train-auto-cached 120 python3 -m slidedp train "$WORK/run.yaml" runtime.policy=auto \
    output.dir="$WORK/out-auto"
for run in policy auto; do cp "$WORK/out-$run/metrics.jsonl" "$OUT/metrics-$run.jsonl" 2>/dev/null; done
grep -E "^slidedp plan|^  |policy   auto|wrote|step +[0-9]|exit" "$LOG" | tail -40
