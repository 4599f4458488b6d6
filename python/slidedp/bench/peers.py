"""The peers of ``slidedp bench train``: the systems users would pick instead of ours.

Each peer runs in its own worker process like the built-in systems (``bench.worker``), on the
same synthetic tokens, the same model (config and seed), AdamW hyperparameters and clipping as
ours, in BF16 compute with FP32 master weights:

- ``zero3-offload``: DeepSpeed ZeRO-3, parameters and optimizer state offloaded to pinned host
  memory, DeepSpeedCPUAdam (``bench.deepspeed_zero``);
- ``zero-offload``: DeepSpeed ZeRO-2 with the optimizer offloaded, BF16 weights on the GPU;
- ``fsdp2-resident``: FSDP2 with every state on the GPU (``bench.fsdp2``, no offload);
- ``roundpipe``: RoundPipe's Qwen3 preset, synchronous optimizer step (``bench.roundpipe_sync``).

Their packages are an optional extra (``pip install 'slidedp[peers]'``), imported only inside
the peer's worker, never by the engine. A peer whose package is missing or fails to import, or
that cannot run on the bench's device, is a result with ``status`` ``unavailable`` and one line
saying why (``require``).

Example::

    deepspeed = require("zero3-offload")  # the module, or PeerUnavailable with one line
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import yaml

from slidedp.errors import ConfigError


@dataclass(frozen=True)
class Peer:
    package: str | None  # what the worker imports (None: torch alone)
    needs_cuda: bool


PEERS: dict[str, Peer] = {
    "zero3-offload": Peer("deepspeed", needs_cuda=False),  # DeepSpeed's CPU accelerator
    "zero-offload": Peer("deepspeed", needs_cuda=False),
    "fsdp2-resident": Peer(None, needs_cuda=False),
    "roundpipe": Peer("roundpipe", needs_cuda=True),
}
INSTALL_HINT = "pip install 'slidedp[peers]'; on a machine without an index: README, Benchmarks"


class PeerUnavailable(Exception):
    """The peer cannot run here (package missing or broken, no CUDA): one line, a result, not a
    crash."""


def require(system: str, device: str = "cuda") -> ModuleType | None:
    """The peer's package, imported; ``PeerUnavailable`` (one line) if it cannot run here."""
    peer = PEERS[system]
    if peer.needs_cuda and device != "cuda":
        raise PeerUnavailable(f"{system} needs CUDA (this run is on {device})")
    if peer.package is None:
        return None
    try:
        return importlib.import_module(peer.package)
    except ImportError as e:
        raise PeerUnavailable(
            f"{system}: {peer.package} is not installed ({e}); {INSTALL_HINT}"
        ) from None
    except Exception as e:  # a package that fails at import time cannot start either
        first = str(e).splitlines()[0] if str(e) else ""
        raise PeerUnavailable(
            f"{system}: importing {peer.package} failed: {type(e).__name__}: {first}"
        ) from None


def parse_peer_sets(items: list[str]) -> dict[str, dict[str, Any]]:
    """``--peer-set SYSTEM.KEY.PATH=VALUE`` (value read as YAML) → per peer a nested dict of
    overrides, e.g. ``zero3-offload.zero_optimization.stage3_prefetch_bucket_size=1e8``."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        path, sep, text = item.partition("=")
        system, _, key = path.strip().partition(".")
        if not sep or not key or system not in PEERS:
            raise ConfigError(
                f"--peer-set {item!r}: use SYSTEM.KEY=VALUE with SYSTEM one of {', '.join(PEERS)}"
            )
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ConfigError(f"--peer-set {item!r}: the value is not valid YAML") from None
        if isinstance(value, str):  # YAML 1.1 reads 1e8 (no dot) as text: a number here
            try:
                number = float(value)
                value = int(number) if number.is_integer() else number
            except ValueError:
                pass
        node = out.setdefault(system, {})
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in, nested dicts key by key (neither is changed)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
