# Sourced by the benches/gpu_*.sh device scripts (set OUT first): installs our wheel and
# Liger's from the carried `dist` and `wheels`, and defines `part NAME SECONDS COMMAND...`,
# which runs one timed part into $OUT/log.txt and says how it ended.
set -u
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/log.txt"
python3 -m pip install -q --no-deps --force-reinstall dist/*.whl
python3 -m pip install -q --no-deps --no-index wheels/liger_kernel-*.whl
python3 -c "import torch, triton, liger_kernel, slidedp; print('torch', torch.__version__,
'triton', triton.__version__, 'liger_kernel', liger_kernel.__file__, 'slidedp', slidedp.__file__)" \
    2>&1 | tee -a "$LOG"

part() {  # part NAME SECONDS COMMAND...
    local name=$1 seconds=$2
    shift 2
    echo "== $name ($(date -u +%T), timeout ${seconds}s): $*" | tee -a "$LOG"
    timeout "$seconds" "$@" >>"$LOG" 2>&1
    echo "== $name: exit $? ($(date -u +%T))" | tee -a "$LOG"
}
