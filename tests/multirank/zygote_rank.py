"""``python -m multirank.zygote_rank CODE``: a rank for tests/multirank/test_zygote.py. It prints
what it sees as one JSON line, then exits with ``CODE`` ("kill": SIGKILL to itself; "echo":
prints its stdin first; "sleep": sleeps a minute first)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from slidedp.runtime.zygote import process_age_s


def main() -> int:
    seen = {"argv": sys.argv[1:], "rank": os.environ.get("RANK"), "pid": os.getpid(),
            "ppid": os.getppid(), "sid": os.getsid(0), "cwd": os.getcwd(),
            "sigint": str(signal.getsignal(signal.SIGINT)), "age_s": process_age_s()}  # fmt: skip
    print(json.dumps(seen), flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "echo":
        print(sys.stdin.read(), end="", flush=True)
        return 0
    if sys.argv[1] == "sleep":
        time.sleep(60)
    return int(sys.argv[1])


if __name__ == "__main__":
    sys.exit(main())
