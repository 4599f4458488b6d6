#!/usr/bin/env bash
# The peers of `slidedp bench train` for a GPU machine without a package index
# (docs/benchmarks.md): download them here, carry the folder there, install them there.
#
#   scripts/peers.sh download peers-wheels         # here: Python 3.12 manylinux x86-64 wheels
#                                                  # + DeepSpeed's sdist (make peers-wheels)
#   scripts/peers.sh install peers-wheels /tmp/peers  # there; then PYTHONPATH=/tmp/peers
#
# Only what the GPU machine's image lacks (it has torch, numpy, packaging, tqdm): DeepSpeed and
# its small dependencies, RoundPipe and its. Installed with --no-deps into a --target folder,
# so the image's packages are never replaced; DeepSpeed with DS_BUILD_OPS=0 (its CPU Adam is
# compiled on first use, just in time, with the ninja below).
set -euo pipefail

DEEPSPEED=deepspeed==0.19.8
WHEELS=(
  roundpipe==0.1.1 beartype==0.23.1
  hjson==3.1.0 einops==0.8.2 msgpack==1.2.4 ninja==1.13.2 psutil==7.2.2 py-cpuinfo==9.0.0
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0
)
LIMIT_MIB=64  # what one device call carries

download() {
  local dir=$1
  rm -rf "$dir" && mkdir -p "$dir"
  python3 -m pip download -q --no-deps --no-binary :all: -d "$dir" "$DEEPSPEED"
  python3 -m pip download -q --no-deps --only-binary :all: -d "$dir" \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any "${WHEELS[@]}"
  local mib
  mib=$(du -sm "$dir" | cut -f1)
  ls -1 "$dir"
  echo "$dir: ${mib} MiB (carry limit ${LIMIT_MIB} MiB with the working tree)"
  if (( mib >= LIMIT_MIB )); then echo "$dir is too large to carry" >&2; exit 1; fi
}

install() {
  local dir=$1 target=$2 build
  python3 -m pip install -q --no-index --no-deps --target "$target" "$dir"/*.whl
  build=$(mktemp -d)
  tar xzf "$dir"/deepspeed-*.tar.gz -C "$build"
  (cd "$build"/deepspeed-* && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps \
    --no-build-isolation --target "$target" .)
  rm -rf "$build"
  echo "installed into $target: export PYTHONPATH=$target PATH=$target/bin:\$PATH"
}

case "${1:-}" in
  download) download "${2:-peers-wheels}" ;;
  install) install "${2:-peers-wheels}" "${3:-/tmp/peers}" ;;
  *) echo "usage: $0 download [DIR] | install [DIR] [TARGET]" >&2; exit 2 ;;
esac
