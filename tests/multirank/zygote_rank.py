"""``python -m multirank.zygote_rank CODE``: a rank for tests/multirank/test_zygote.py. It prints
what it sees as one JSON line, then exits with ``CODE`` ("kill": SIGKILL to itself)."""

from __future__ import annotations

import json
import os
import signal
import sys


def main() -> int:
    seen = {"argv": sys.argv[1:], "rank": os.environ.get("RANK"), "pid": os.getpid(),
            "ppid": os.getppid(), "sid": os.getsid(0), "cwd": os.getcwd(),
            "sigint": str(signal.getsignal(signal.SIGINT))}  # fmt: skip
    print(json.dumps(seen), flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return int(sys.argv[1])


if __name__ == "__main__":
    sys.exit(main())
