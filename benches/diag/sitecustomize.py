"""Diagnostic, loaded by PYTHONPATH=benches/diag in device runs (SLIDEDP_PIN_WATCH=DIR): when a
new shared anonymous mapping of over 1 GiB appears in this process (how the CUDA driver maps
pinned host memory: '/dev/zero (deleted)'), write every thread's Python stacks of the last
few half-second samples into DIR/pin-<pid>.txt, to name the code that pinned it."""

import os

if os.environ.get("SLIDEDP_PIN_WATCH"):
    import collections
    import sys
    import threading
    import time
    import traceback

    def _big_maps() -> set[str]:
        found = set()
        with open("/proc/self/maps") as f:
            for line in f:
                if "/dev/zero" in line:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    if hi - lo > 2**30:
                        found.add(line.split()[0])
        return found

    def _watch() -> None:
        out = os.path.join(os.environ["SLIDEDP_PIN_WATCH"], f"pin-{os.getpid()}.txt")
        seen, ring = _big_maps(), collections.deque(maxlen=8)
        while True:
            time.sleep(0.5)
            me = threading.get_ident()
            ring.append(
                (
                    time.strftime("%T"),
                    {
                        t: "".join(traceback.format_stack(f))
                        for t, f in sys._current_frames().items()
                        if t != me
                    },
                )
            )
            now = _big_maps()
            if now - seen:
                with open(out, "a") as f:
                    f.write(f"=== {time.strftime('%T')} new {sorted(now - seen)}\n")
                    for when, stacks in ring:
                        for t, s in stacks.items():
                            f.write(f"--- {when} thread {t}\n{s}")
            seen = now

    threading.Thread(target=_watch, daemon=True, name="pin-watch").start()
