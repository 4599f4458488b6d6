"""Where a seeded init's time goes: ``python benches/fill_profile.py --shape qwen3-4b``.

Creates SHAPE's host store (BF16 mirror, as a run on a GPU has), then runs the trainer's seeded
init (``init_weights``) twice into it under cProfile (the first touches every page of the
store's master, the second finds them mapped), then ``fill_mirror``. Prints one JSON object:
the seconds of each and the main thread's top functions by cumulative time (the draws run on
the init threads: their wait shows as ``result``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

from slidedp.io.hf_load import init_weights
from slidedp.kernels import Kernels, default_threads
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import SHAPES, cut_layers, resolve_shape
from slidedp.runtime.window import fill_mirror
from slidedp.store import HostStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-4b", help=f"{', '.join(SHAPES)} or a config.json")
    parser.add_argument("--layers", type=int, default=0, help="cut to N layers (0: all)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    config = resolve_shape(args.shape)
    adapter = HFAdapter(cut_layers(config, args.layers) if args.layers else config)
    times: dict[str, float] = {}
    start = time.perf_counter()
    store = HostStore.create(adapter.group_specs(), staging_slots=0, bf16_mirror=True)
    times["create_s"] = time.perf_counter() - start
    profiles = []
    for name in ("init_first_s", "init_again_s"):
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.runcall(init_weights, adapter, store, 42)
        times[name] = time.perf_counter() - start
        profiles.append(profile)
    start = time.perf_counter()
    fill_mirror(store, Kernels(default_threads()))
    times["fill_mirror_s"] = time.perf_counter() - start
    tops = []
    for profile in profiles:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(args.top)
        tops.append(text.getvalue().splitlines()[-args.top - 1 :])
    report = {"shape": args.shape, "threads": default_threads(), "bytes": store.total_bytes,
              **{k: round(v, 2) for k, v in times.items()}}  # fmt: skip
    print(json.dumps(report))
    for label, top in zip(("first", "again"), tops, strict=True):
        print(f"-- {label}")
        print("\n".join(top))


if __name__ == "__main__":
    main()
