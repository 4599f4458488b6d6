#!/usr/bin/env bash
# Issue 15's error table on one GPU (one device call, < 10 minutes): the probes first, then the
# runs, each part with its own timeout; the predictions are made afterwards, here:
#   slidedp bench predict OUT/RUN.json --probes OUT
# Here first:  rm -f dist/*.whl; .venv/bin/maturin build --release -o dist/ -q
# Device call: carry ["dist"], command `bash benches/gpu_model.sh`
# Layer compute: the default (eager kernels, compiled; Liger not installed here).
OUT=${OUT:-out/gpu-model}
set -u
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/log.txt"
python3 -m pip install -q --no-deps --force-reinstall dist/*.whl
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
part() {  # part NAME SECONDS COMMAND...
    local name=$1 seconds=$2
    shift 2
    echo "== $name ($(date -u +%T), timeout ${seconds}s): $*" | tee -a "$LOG"
    timeout "$seconds" "$@" >>"$LOG" 2>&1
    echo "== $name: exit $? ($(date -u +%T))" | tee -a "$LOG"
}
layer() {  # layer SHAPE BATCH [FAMILIES]: bench.predict's layer probe
    local args="{\"shape\": \"$1\", \"batch\": $2, \"seq_len\": 1024, \"families\": \"${3:-F}\",
        \"ratios\": \"0\", \"device\": \"cuda\", \"dtype\": \"bfloat16\", \"warmup\": 2,
        \"steps\": 5, \"cache_dir\": null, \"force\": false, \"layer_kernels\": \"auto\",
        \"layer_compile\": null}"
    part "layer-$1-b$2" 60 python3 -m slidedp.bench.predict layer "$args" "$OUT/layer-$1-b$2.json"
}
part host 60 python3 -m slidedp.bench.predict host '{"device": "cuda"}' "$OUT/host.json"
for b in 4 8 16 32; do layer qwen3-1.7b $b; done
layer qwen3-4b 16
BENCH=(python3 -m slidedp bench train --systems ours --warmup 2 --steps 3)
part sweep-1.7b 300 "${BENCH[@]}" --shape qwen3-1.7b --sweep 4,8,16,32 --json "$OUT/sweep-1.7b.json"
part 4b-noclip 150 "${BENCH[@]}" --shape qwen3-4b --batch 16 --set train.max_grad_norm=0 \
    --json "$OUT/4b-b16-noclip.json"
grep -E "^ +[0-9]+ ours|== " "$LOG" | tail -20
