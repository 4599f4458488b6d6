#!/usr/bin/env bash
# The host AdamW probe (AdamW under the copies with no cast beside it, then alone) and the
# step-time model against the 4x H200 Qwen3-14B B=16 runs of benchmarks/four-gpus-14b, on the
# host those ran on (64 cores: the 4-GPU kind, though the probe copies with one GPU):
#   1. `slidedp profile host --force --json` at the engine's threads (all cores) and at 16 (one
#      of four ranks' share), in $OUT/probes/host.json and $OUT/threads16/host.json
#   2. the layer profiles of the runs' layouts (40xF; auto's N and S0000100-r0.613636)
#   3. `slidedp bench predict` on both reports from those probes: predicted against measured
# Here first:  rm -f dist/*.whl; .venv/bin/maturin build --release -o dist/ -q; make liger-wheels
# Device call: kind nvidia-h200-x4, carry ["dist", "wheels"], `bash benches/gpu_host_rate.sh`
# (about 3 minutes)
OUT=${OUT:-out/gpu-host-rate}
source "$(dirname "$0")/gpu_common.sh"
mkdir -p "$OUT/probes" "$OUT/threads16"
part host-all-cores 90 sh -c \
    "python3 -m slidedp profile host --device cuda --force --json > '$OUT/probes/host.json'"
part host-16-threads 90 sh -c "python3 -m slidedp profile host --device cuda --threads 16 \
    --force --json > '$OUT/threads16/host.json'"
cat "$OUT/probes/host.json" "$OUT/threads16/host.json" >> "$LOG"
PROBES=$OUT/probes
(OUT=$PROBES; layer qwen3-14b 16 F; layer qwen3-14b 16 N,S0000100 0,0.613636)
for report in auto-variant-1gpu auto-route; do
    part "predict-$report" 120 python3 -m slidedp bench predict \
        "benchmarks/four-gpus-14b/qwen3-14b-4xh200-b16-$report.json" --probes "$PROBES" \
        --json "$OUT/predict-$report.json"
done
grep -E "adamw_gbps|joint_|^ +16 +[0-9]|== " "$LOG" | tail -40
