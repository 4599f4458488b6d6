"""``slidedp`` and ``python -m slidedp``: the CLI, imported behind one check. Its import loads
torch's shared libraries (GBs of address space); a shell whose ``ulimit -v`` leaves too little
gets one line saying so, not the import's traceback."""

import resource
import sys

try:
    from slidedp.cli import main
except ImportError as e:
    if "failed to map segment" not in str(e):
        raise
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    cause = (
        "this machine's memory is exhausted"
        if limit == resource.RLIM_INFINITY
        else f"the shell's address-space limit (ulimit -v {limit // 1024} KiB) is too small: "
        "raise it (ulimit -v unlimited)"
    )
    print(f"slidedp: error: loading torch's libraries failed ({e}): {cause}", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
