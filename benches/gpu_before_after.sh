#!/usr/bin/env bash
# One `slidedp bench train` command under two builds of slidedp in one device call (a change's
# speed against the code before it, on the same machine within minutes): the wheel in
# `out/before/` first, then the one in `dist/`; each run's JSON in $OUT/{before,after}.json and
# both in $OUT/log.txt. Each build gets an empty profile cache of its own.
#   BENCH   the bench's arguments (default: Qwen3-4B B=16 clipping 1.0, the fixed default and
#           AutoPolicy in one run)
#   LIMIT   seconds per build (default 280: two 4B systems and a selection fit)
# Here first:  the current wheel in dist/ (maturin build --release -o dist/), the earlier one
#              in out/before/ (`git worktree add OLD COMMIT`, then maturin build there)
# Device call: carry ["dist", "wheels", "out/before"], command `bash benches/gpu_before_after.sh`
OUT=${OUT:-out/gpu-before-after}
source "$(dirname "$0")/gpu_common.sh"  # installs dist/ (and Liger): the after build
BENCH=${BENCH:---shape qwen3-4b --batch 16 --warmup 2 --steps 3 --systems ours,ours:auto \
--set train.max_grad_norm=1.0 --set ours:auto.runtime.policy=auto}
for build in before after; do
    wheel=$([[ $build == before ]] && echo out/before/*.whl || echo dist/*.whl)
    python3 -m pip install -q --no-deps --force-reinstall $wheel
    # shellcheck disable=SC2086  # BENCH is a list of arguments
    XDG_CACHE_HOME=$(mktemp -d) part "$build" "${LIMIT:-280}" python3 -m slidedp bench train \
        $BENCH --json "$OUT/$build.json"
done
grep -E "^ +[0-9]+ ours|tokens/s|== (before|after)" "$LOG" | tail -12
