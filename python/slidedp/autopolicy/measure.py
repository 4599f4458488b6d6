"""The measurements ``runtime.policy: auto`` takes for several ranks, in a child process of
the launcher: the layer profile, the host AdamW probe and, on GPUs, the chunk probe and the
links between the GPUs (``profile.*``), each into its cache. The launcher then chooses from the
caches (``autopolicy.auto``) once for every rank, and never allocates on their GPUs itself.

Run by ``autopolicy.auto`` (not by hand): ``python -m slidedp.autopolicy.measure CONFIG.yaml``.
Exit 0 when the layer profile and host probe are cached (a failed link probe is one warning
and the config's routes run); 2 with one line for a ``SlidedpError``; 1 otherwise.

Example::

    seconds = measure_in_child(cfg)   # raises ConfigError with the child's last line
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from slidedp.autopolicy.chunk_choice import chunk_skipped, probe_terms
from slidedp.config import load_config, resolved_yaml
from slidedp.errors import ConfigError, SlidedpError, exception_line
from slidedp.models.hf import HFAdapter
from slidedp.plan.machine import Machine, host_rate, update_threads
from slidedp.plan.policy import layer_numel
from slidedp.profile.chunks import probe_chunks
from slidedp.profile.layer import profile_layer, profile_spec
from slidedp.profile.links import probe_links
from slidedp.runtime.zygote import start_child

if TYPE_CHECKING:
    from slidedp.config import TrainConfig

EXIT_BAD_INPUT = 2
TIMEOUT_S = 1800.0  # a first torch.compile'd profile of a large layer takes minutes


def measure(cfg: TrainConfig) -> None:
    """Every measurement ``autopolicy.auto`` takes for ``cfg``, cached (measured where missing)."""

    machine = Machine.probe(cfg, measure=False)
    profile_layer(profile_spec(cfg))
    threads = update_threads(cfg, machine)
    world = cfg.runtime.launch.world
    host_rate(threads, machine, ranks=world, measure=True)
    if machine.device != "cuda":
        return
    adapter = HFAdapter.from_dir(cfg.model.path, cfg.model.config_overrides())
    if chunk_skipped(cfg.runtime, machine) is None:  # the chunk stage's probe
        numel, _, mirror = probe_terms(cfg, adapter, machine)
        probe_chunks(numel, threads, torch.device("cuda"), mirror=mirror)
    if world < 2:
        return
    try:
        probe_links(world, layer_numel(adapter))
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # the routes stay the config's
        line = " ".join(str(e).split())
        print(f"slidedp train: warning: the link probe failed ({line}): "
              "runtime.policy=auto keeps the config's routes", file=sys.stderr)  # fmt: skip


def measure_in_child(cfg: TrainConfig) -> float:
    """``measure(cfg)`` in a child process (the environment inherited: NCCL's settings too;
    ``runtime.zygote.start_child``: forked from the launcher's zygote); its seconds. Its stderr
    is passed on; a failure is one ``ConfigError`` with its last line."""

    start = time.perf_counter()
    links = ", the chunks, the links between the GPUs" if cfg.runtime.launch.gpus > 1 else ""
    print(f"policy   auto: measuring the layer, the host{links} in a child process (cached for "
          "the next run) ...", file=sys.stderr, flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="slidedp-auto-") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(resolved_yaml(cfg))
        with (Path(tmp) / "stderr").open("w+") as stderr:  # a file: it never blocks the child
            child = start_child("slidedp.autopolicy.measure", [str(path)], dict(os.environ),
                                stdio=(None, None, stderr))  # fmt: skip
            try:
                code = child.wait(TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                raise ConfigError(
                    f"runtime.policy=auto: its measurements ran past {TIMEOUT_S:.0f} s; measure "
                    "once with `slidedp profile layer` and `slidedp profile host`, or write the "
                    "policy by hand"
                ) from None
            stderr.seek(0)
            said = stderr.read()
    sys.stderr.write(said)
    if code != 0:
        lines = said.strip().splitlines() or [f"exit code {code}"]
        raise ConfigError(f"runtime.policy=auto: its measurements failed: {lines[-1]}")
    return time.perf_counter() - start


def main(argv: list[str]) -> int:

    (config,) = argv
    try:
        measure(load_config(config))
    except SlidedpError as e:
        print(" ".join(str(e).split()), file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:  # a crash: its traceback, then itself as the line the launcher reports
        traceback.print_exc()
        print(exception_line(e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
