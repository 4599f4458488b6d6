# Sourced by the benches/gpu_*.sh device scripts (set OUT first): installs our wheel from the
# carried `dist` and, unless LIGER=0, Liger's from the carried `wheels`; keeps NVLink multicast
# off (multi-GPU machines); defines `part NAME SECONDS COMMAND...`, which runs one timed part
# into $OUT/log.txt and says how it ended, `within SECONDS NAME`, whether such a part still
# ends within the device call's 10 minutes (else it says it is skipped), and `layer SHAPE
# BATCH [FAMILIES [RATIOS]]`, the step-time model's layer probe (bench.predict) into $OUT.
# MEMWATCH=1 samples the host's memory every second into $OUT/mem.tsv (MemAvailable, page
# cache, unevictable, anonymous and shared GiB, and the largest process's anonymous, file and
# shared RSS), and the kernel's log at the end to $OUT/dmesg.txt (an OOM kill's own account).
# MEMWATCH=2 adds, each time they change, that process's mappings of over 1 GiB resident
# ($OUT/maps.txt): reading smaps of a 100 GiB mapping took ~0.5 s a sample and competes with
# the run's page faults, so not for timings. Which code pinned host memory:
# SLIDEDP_PIN_WATCH=$OUT PYTHONPATH=$PWD/benches/diag (benches/diag/sitecustomize.py).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
LOG="$OUT/log.txt"
python3 -m pip install -q --no-deps --force-reinstall dist/*.whl
if [[ ${LIGER:-1} != 0 ]]; then
    python3 -m pip install -q --no-deps --no-index wheels/liger_kernel-*.whl
fi
python3 -c "import torch, triton, slidedp; print('torch', torch.__version__, 'triton',
triton.__version__, 'slidedp', slidedp.__file__, 'GPUs', torch.cuda.device_count())" 2>&1 | tee -a "$LOG"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"

if [[ ${MEMWATCH:-0} != 0 ]]; then
    (echo -e "time\tavail\tcached\tunevictable\tanon\tshmem\tpid\trss_anon\trss_file\trss_shmem"
     while kill -0 $$ 2>/dev/null && sleep 1; do  # not beyond the script, however it ends
         pid=$(ps -eo pid=,rss= --sort=-rss | awk 'NR==1 {print $1}')
         mem=$(awk '/^(MemAvailable|Shmem|AnonPages|Unevictable|Cached):/ {
             printf "\t%.1f", $2 / 2^20 }' /proc/meminfo)
         rss=$(awk '/^Rss(Anon|File|Shmem):/ { printf "\t%.1f", $2 / 2^20 }' \
             "/proc/$pid/status" 2>/dev/null)
         echo -e "$(date -u +%T)$mem\t$pid$rss"
         [[ $MEMWATCH == 2 ]] || continue
         maps=$(awk '/^[0-9a-f]+-[0-9a-f]+ / {m = $0} /^Rss:/ && $2 > 2^20 {
             printf "%.1f GiB %s\n", $2 / 2^20, m }' "/proc/$pid/smaps" 2>/dev/null)
         [[ $maps == "${last:-}" ]] || echo -e "$(date -u +%T) pid $pid\n$maps" >> "$OUT/maps.txt"
         last=$maps
     done) > "$OUT/mem.tsv" 2>/dev/null &
    memwatch=$!
    trap 'kill $memwatch 2>/dev/null; dmesg > "$OUT/dmesg.txt" 2>&1' EXIT
fi

part() {  # part NAME SECONDS COMMAND...
    local name=$1 seconds=$2
    shift 2
    echo "== $name ($(date -u +%T), timeout ${seconds}s): $*" | tee -a "$LOG"
    timeout "$seconds" "$@" >>"$LOG" 2>&1
    echo "== $name: exit $? ($(date -u +%T))" | tee -a "$LOG"
}

within() {  # within SECONDS NAME: whether a part of that limit still ends before 560 s
    ((SECONDS + $1 <= 560)) || { echo "== skipped: $2 (the call's time)" | tee -a "$LOG"; false; }
}

layer() {  # layer SHAPE BATCH [FAMILIES [RATIOS]]: F-r0 by default, the run's layer compute
    local args="{\"shape\": \"$1\", \"batch\": $2, \"seq_len\": 1024, \"families\": \"${3:-F}\",
        \"ratios\": \"${4:-0}\", \"device\": \"cuda\", \"dtype\": \"bfloat16\", \"warmup\": 2,
        \"steps\": 5, \"cache_dir\": null, \"force\": false, \"layer_kernels\": \"auto\",
        \"layer_compile\": null}"
    # a file name the device hands back: letters, digits, '.', '-' and '_' only
    part "layer-$1-b$2-${3:-F}" 60 python3 -m slidedp.bench.predict layer "$args" \
        "$OUT/layer-$1-b$2-$(echo "${3:-F}-r${4:-0}" | tr -c "A-Za-z0-9.\n-" _).json"
}
