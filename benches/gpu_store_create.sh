#!/usr/bin/env bash
# The host store's creation (allocate and zero-fill in /dev/shm) by part count, on a GPU host's
# cores (no GPU used): one part (one fallocate, one core) against one part per core, GB GB (100)
# each, REPS repetitions (2) alternating, and fill_mirror's time on that store with the BF16
# mirror (every core; on the trainer's startup path); then the Qwen3-14B store's size (195 GB)
# once each when the host's MemAvailable holds it.
# Here first:  rm -f dist/*.whl; .venv/bin/maturin build --release -o dist/ -q
# Device call: carry ["dist"], command `bash benches/gpu_store_create.sh` (any GPU kind; the
# four-GPU kinds' 64 cores and 512 GiB are the startup's host)
OUT=${OUT:-out/store-create}
LIGER=0 source benches/gpu_common.sh
nproc | tee -a "$LOG"
grep -E '^(MemAvailable|Shmem):' /proc/meminfo | tee -a "$LOG"
df -h /dev/shm | tee -a "$LOG"
part "store-${GB:-100}gb" 400 python3 benches/store_create.py --gb "${GB:-100}" --parts 1,auto \
    --reps "${REPS:-2}" --mirror
avail_gb=$(awk '/^MemAvailable:/ {print int($2 * 1024 / 1e9)}' /proc/meminfo)
if ((avail_gb > 215)) && within 120 store-195gb; then
    part store-195gb 120 python3 benches/store_create.py --gb 195 --parts auto,1 --reps 1
fi
tail -n 20 "$LOG"
