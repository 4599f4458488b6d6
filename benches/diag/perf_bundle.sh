#!/usr/bin/env bash
# This machine's `perf` with the shared libraries it needs, into perf-tool/ (git-ignored), for
# the GPU machines, which have none: carry ["perf-tool"] and run it as
#   LD_LIBRARY_PATH=$PWD/perf-tool/lib perf-tool/perf record -e cpu-clock ...
# (software events: these guests expose no PMU). glibc's own libraries are left out: the
# device's newer ones serve a binary built against an older glibc.
set -euo pipefail
OUT=${1:-perf-tool}
PERF=$(command -v perf) || { echo "perf_bundle.sh: no perf on this machine"; exit 2; }
rm -rf "$OUT"
mkdir -p "$OUT/lib"
cp -L "$PERF" "$OUT/perf"
ldd "$PERF" | awk '/=> \// {print $3}' \
    | grep -v -E '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' \
    | xargs -I{} cp -L {} "$OUT/lib/"
LD_LIBRARY_PATH=$OUT/lib "$OUT/perf" --version
du -sh "$OUT"
