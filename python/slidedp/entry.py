"""The ``slidedp`` command (and ``python -m slidedp``): the CLI, imported behind one check. Its
import loads torch's shared libraries (GBs of address space); a shell whose ``ulimit -v``
leaves too little gets one line saying so, not the import's traceback. (A module of its own:
the ranks a zygote forks run ``slidedp.__main__`` afresh, which must not be imported before.)"""

import resource
import sys

try:
    from slidedp.cli import main
# near the limit torch's import fails in several ways: a library not mapped, std::bad_alloc,
# a C call returning an error it never set
except (ImportError, MemoryError, SystemError) as e:
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    out_of_memory = isinstance(e, MemoryError) or "failed to map segment" in str(e)
    if isinstance(e, ModuleNotFoundError) or (
        limit == resource.RLIM_INFINITY and not out_of_memory
    ):
        raise  # an install without a dependency, or not a matter of memory
    cause = (
        "this machine's memory is exhausted"
        if limit == resource.RLIM_INFINITY
        else f"the shell's address-space limit (ulimit -v {limit // 1024} KiB) is too small: "
        "raise it (ulimit -v unlimited)"
    )
    reason = str(e) or type(e).__name__
    print(f"slidedp: error: loading torch's libraries failed ({reason}): {cause}", file=sys.stderr)
    sys.exit(2)

__all__ = ["main"]
