#!/usr/bin/env bash
# The plan decided in one place, on one H100: one device call of under 9 minutes; each part has
# its own timeout and writes under $OUT as it ends (log.txt has everything):
#   (3 runs first, in a cache of its own)
#   1. cold: `slidedp plan` of Qwen3-4B B=16 with clipping 1.0 on an empty cache (every stage:
#      profile, host probe, chunk probe, solve, calibrate, validate; its clock in the log,
#      its wall time in $OUT/cold.txt)
#   2. warm: `slidedp train` of the same run with no runtime.policy (AutoPolicy is the CUDA
#      default) takes the selection part 1 cached: each output line stamped with the seconds
#      since the start in $OUT/train-default.log, the policy line in $OUT/warm.txt (<= 5 s)
#   3. the fixed default and runtime.policy=auto in ONE `slidedp bench train` run (ours,
#      ours:auto) at the same shape, JSON in $OUT/bench.json, to compare with BENCHMARKS.md,
#      section "AutoPolicy" (H100: 10,183 and 17,656 tokens/s)
# DECIDE=selection: parts 1 and 2 only, on a machine whose Triton cache is as cold as ours (the
# selection's time with every trial in one child process: autopolicy/trial_child.py; measured
# 289 s, calibrate 105.0 and validation 158.9 of it, when each trial had a process of its own:
# benchmarks/2026-11-28-decide-then-run-h100.md). The trial processes it started are counted
# in $OUT/trial-processes.txt (1 unless a trial ran out of memory).
#
# Here first:  .venv/bin/maturin build --release -o dist/ -q && make liger-wheels
# Device call: carry ["dist", "wheels"], command `bash benches/gpu_decide.sh`
#   (the selection alone: `DECIDE=selection bash benches/gpu_decide.sh`)
OUT=${OUT:-out/gpu-decide}
source "$(dirname "$0")/gpu_common.sh"
export XDG_CACHE_HOME=$(mktemp -d)  # an empty profile and selection cache: part 1 is cold
WORK=$(mktemp -d)
python3 - "$WORK" <<'PY'
import json, sys
from pathlib import Path
import torch
from slidedp.models.shapes import resolve_shape
work = Path(sys.argv[1])
config = resolve_shape("qwen3-4b")
config.save_pretrained(work / "model")
g = torch.Generator().manual_seed(0)
rows = torch.randint(0, config.vocab_size, (16 * 4, 1024), generator=g).tolist()
(work / "train.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
PY
cat > "$WORK/run.yaml" <<YAML
model: {path: $WORK/model}
data: {path: $WORK/train.jsonl, seq_len: 1024, packing: false, shuffle: false}
train: {max_steps: 2, global_batch_size: 16, max_grad_norm: 1.0}
output: {dir: $WORK/out, save_steps: 0, export: false}
runtime: {device: cuda}
YAML

# 3 first (its own cache, so part 1 stays cold): two 4B stores and a selection take ~5 minutes
if [[ ${DECIDE:-all} != selection ]]; then
    XDG_CACHE_HOME=$(mktemp -d) part bench 330 python3 -m slidedp bench train --shape qwen3-4b \
        --batch 16 --warmup 2 --steps 3 --systems ours,ours:auto --set train.max_grad_norm=1.0 \
        --set ours:auto.runtime.policy=auto --json "$OUT/bench.json"
fi

start=$SECONDS
# the trial processes of the cold selection (each `python -m slidedp.autopolicy.trial_child`)
(while sleep 0.5; do pgrep -f "slidedp.autopolicy.trial_child"; done >> "$WORK/trial-pids") &
watcher=$!
within 200 plan-cold && part plan-cold $((560 - SECONDS)) python3 -m slidedp plan "$WORK/run.yaml" --out "$OUT/plan.json"
echo "plan-cold: $((SECONDS - start)) s wall" | tee -a "$OUT/cold.txt" "$LOG"
kill $watcher 2>/dev/null
echo "trial processes: $(sort -u "$WORK/trial-pids" 2>/dev/null | wc -l)" \
    | tee "$OUT/trial-processes.txt" -a "$LOG"

# every line stamped; the run is killed once its policy line is out and a few lines follow
# (SIGKILL at the latest: a SIGTERM would save a 48 GB checkpoint)
echo "== train-default ($(date -u +%T))" | tee -a "$LOG"
timeout -s KILL 120 python3 -m slidedp train "$WORK/run.yaml" output.dir="$WORK/out-default" \
    2>&1 | python3 -u -c "import sys, time
t, left = time.time(), None
for line in sys.stdin:
    print(f'{time.time() - t:7.1f} {line}', end='', flush=True)
    left = 3 if line.startswith('policy') and left is None else left
    if left is not None:
        left -= 1
        if left < 0: break" > "$OUT/train-default.log"
grep -E "^ *[0-9.]+ policy" "$OUT/train-default.log" | tee -a "$OUT/warm.txt" "$LOG"
rm -rf "$WORK/out-default"

grep -E "^ +16 ours|policy   |plan-cold|exit" "$LOG" | tail -12
