#!/usr/bin/env bash
# Where a clipped step's host update goes, one device call: `slidedp bench train` of ours at
# SHAPE (qwen3-4b) and BATCH (16), the fixed default policy, clipping at 1.0 and the VARIANTS
# (no clipping, fewer update threads), each with a trace of its first measured step (WARMUP
# steps before it, 2: a clipped step runs the previous step's updates, so with one warm-up
# the traced step would hold the run's first AdamW and its first touch of the moments), while a
# sampler reads every thread's user and kernel CPU time and minor page faults of the largest
# process ($OUT/threads.tsv) and the guest's TLB shootdowns, IPIs and CPU time with steal
# ($OUT/system.tsv) twice a second. The summary prints, per variant, the host AdamW per layer
# from its trace (the "CPU update" lane), and per process the kernel threads' CPU time and page
# faults and the guest's interrupts a second and CPU split while it ran.
# Record: benchmarks/2026-11-29-clipped-update-h200.md.
# Here first: rm -f dist/*.whl; .venv/bin/maturin build --release -o dist/ -q
# (PERF=1: also bash benches/diag/perf_bundle.sh, and carry "perf-tool")
# Device call: carry ["dist", "wheels"], command `bash benches/gpu_clip_update.sh`.
OUT=${OUT:-out/gpu-clip-update}
source "$(dirname "$0")/gpu_common.sh"
SHAPE=${SHAPE:-qwen3-4b}
BATCH=${BATCH:-16}
# VARIANTS: LABEL=KEY=VALUE[,KEY=VALUE...] ... (the plain run: the default config, clipping)
VARIANTS=${VARIANTS:-"noclip=train.max_grad_norm=0 t8=runtime.update_threads=8 t15=runtime.update_threads=15"}

(while kill -0 $$ 2>/dev/null && sleep 0.5; do  # the largest process's threads: time, tid, name, ticks
     pid=$(ps -eo pid=,rss= --sort=-rss | awk 'NR==1 {print $1}')
     now=$(date +%s.%N)
     awk -v t="$now" '{sub(/^[0-9]+ \(/, ""); split($0, a, /\) /); split(a[2], f, " ");
         print t "\t" FILENAME "\t" a[1] "\t" f[12] "\t" f[13] "\t" f[8]}' /proc/"$pid"/task/*/stat 2>/dev/null
 done) > "$OUT/threads.tsv" &
# the whole guest twice a second: TLB shootdowns, function-call and rescheduling interrupts
# (summed over the CPUs) and the CPU time's split, steal included ($OUT/system.tsv)
(while kill -0 $$ 2>/dev/null && sleep 0.5; do
     irq=$(awk '$1 ~ /^(TLB|CAL|RES):$/ {s = 0; for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) s += $i;
         printf "\t%s=%d", substr($1, 1, 3), s}' /proc/interrupts)
     cpu=$(awk '$1 == "cpu" {printf "\tuser=%d\tsystem=%d\tidle=%d\tirq=%d\tsoftirq=%d\tsteal=%d",
         $2 + $3, $4, $5 + $6, $7, $8, $9}' /proc/stat)
     echo -e "$(date +%s.%N)$irq$cpu"
 done) > "$OUT/system.tsv" &

systems=ours sets=()
for v in $VARIANTS; do
    systems+=",ours:${v%%=*}"
    IFS=, read -ra keys <<< "${v#*=}"
    for key in "${keys[@]}"; do
        sets+=(--set "ours:${v%%=*}.$key")
    done
done
# PERF=1: every CPU sampled (perf's cpu-clock, PERF_HZ a second, on CLOCK_MONOTONIC, no call
# graphs) through the bench, from the carried perf-tool/ (benches/diag/perf_bundle.sh)
PERF_TOOL=(env LD_LIBRARY_PATH="$PWD/perf-tool/lib" "$PWD/perf-tool/perf")
if [[ ${PERF:-0} != 0 ]]; then
    "${PERF_TOOL[@]}" record -a -e cpu-clock -F "${PERF_HZ:-499}" -k CLOCK_MONOTONIC \
        -o /tmp/clip-update.perf >> "$LOG" 2>&1 &
    perf_pid=$!
fi
part bench "${RUN_S:-420}" python3 -m slidedp bench train --shape "$SHAPE" --batch "$BATCH" \
    --systems "$systems" --set runtime.policy=fixed "${sets[@]}" --warmup "${WARMUP:-2}" --steps 2 --trace "$OUT/trace.json" \
    --json "$OUT/clip-update.json"
if [[ ${PERF:-0} != 0 ]]; then
    kill -INT "$perf_pid" && wait "$perf_pid"
    # per trace: the samples while its layers' host updates ran (trace time 0 is
    # otherData.origin_s on CLOCK_MONOTONIC), by thread name, object and symbol
    for trace in "$OUT"/trace*.json; do
        [[ -f $trace ]] || continue  # no run got as far as its trace
        window=$(python3 - "$trace" <<'PY'
import json, sys
trace = json.loads(open(sys.argv[1]).read())
lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"
         and lanes.get(e["tid"]) == "CPU update" and e["name"].startswith("layers.")]
origin = trace["otherData"]["origin_s"]
print(f"{origin + min(e['ts'] for e in spans) / 1e6:.6f},"
      f"{origin + max(e['ts'] + e['dur'] for e in spans) / 1e6:.6f}")
PY
)
        name=$(basename "$trace" .json)
        echo "== perf, $name, its layers' updates ($window s)" | tee -a "$LOG"
        "${PERF_TOOL[@]}" report -i /tmp/clip-update.perf --time "$window" --sort comm,dso,sym \
            --stdio --percent-limit 0.2 2>/dev/null | grep -v -e '^#' -e '^$' \
            | head -60 > "$OUT/perf-$name.txt"
        head -25 "$OUT/perf-$name.txt" | tee -a "$LOG"
    done
fi

python3 - "$OUT" <<'PY' | tee -a "$LOG"
import collections, json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for trace in sorted(out.glob("trace*.json")):
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X" and lanes.get(e["tid"]) == "CPU update"
             and e["name"].startswith("layers.")]
    ms = sorted(e["dur"] / 1e3 for e in spans)
    print(f"{trace.stem}: {len(ms)} layer updates, median {ms[len(ms) // 2]:.1f} ms, "
          f"min {ms[0]:.1f}, max {ms[-1]:.1f}" if ms else f"{trace.stem}: no layer update")
report = json.loads((out / "clip-update.json").read_text())
for run in report["runs"]:
    print(run["system"], run["status"], "step_s", run.get("step_time_s"),
          "tokens/s", run.get("tokens_per_s"), "update_s", run["lanes_s"].get("update_s"))
# per process (one per variant, in order): its kernel threads' CPU seconds in user and kernel
# mode and their minor page faults, over the whole run
first, last = {}, {}
span = collections.defaultdict(list)  # per process: the times it was sampled
for line in (out / "threads.tsv").read_text().splitlines():
    t, path, name, user, system, faults = line.split("\t")
    key = (path.split("/")[2], path.split("/")[4], name)
    first.setdefault(key, (int(user), int(system), int(faults)))
    last[key] = (int(user), int(system), int(faults))
    span[key[0]].append(float(t))
pids = sorted({k[0] for k in last}, key=int)
# per process: the guest's interrupts a second and its CPU time's split while it ran
rows = [(float(line.split("\t")[0]), dict(f.split("=") for f in line.split("\t")[1:]))
        for line in (out / "system.tsv").read_text().splitlines()]
for pid in pids:
    inside = [r for r in rows if min(span[pid]) <= r[0] <= max(span[pid])]
    if len(inside) < 2:
        continue
    (t0, a), (t1, b) = inside[0], inside[-1]
    delta = {k: int(b[k]) - int(a[k]) for k in a}
    ticks = sum(delta[k] for k in ("user", "system", "idle", "irq", "softirq", "steal")) or 1
    print(f"pid {pid} {t1 - t0:.0f} s: " + ", ".join(
        f"{k} {delta[k] / (t1 - t0):,.0f}/s" for k in ("TLB", "CAL", "RES") if k in delta)
        + "; cpu " + ", ".join(f"{k} {delta[k] / ticks:.1%}" for k in
                               ("user", "system", "idle", "irq", "softirq", "steal")))
for pid in pids:
    for pool in ("slidedp-kernel", ""):
        keys = [k for k in last if k[0] == pid and k[2].startswith(pool)]
        user, system, faults = (sum(last[k][i] - first[k][i] for k in keys) for i in range(3))
        print(f"pid {pid} {pool or 'all'} threads {len(keys)}: user {user / 100:.1f} s, "
              f"system {system / 100:.1f} s, minor faults {faults}")
PY
