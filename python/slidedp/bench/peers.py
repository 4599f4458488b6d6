"""The peers of ``slidedp bench train``: the systems users would pick instead of ours.

``zero3-offload``, ``zero3-optim-offload``, ``zero-offload`` (``bench.deepspeed_zero``),
``fsdp2-resident`` (``bench.fsdp2``) and ``roundpipe`` (``bench.roundpipe_sync``), each in its
own worker process on the same tokens, model, AdamW hyperparameters and clipping as ours.
Invariants: their packages (``pip install 'slidedp[peers]'``) are imported only inside the peer's
worker, never by the engine; a peer that cannot run is a result with ``status`` ``unavailable``
and one line saying why (``require``). A variant ``SYSTEM:LABEL`` runs as its peer with the
peer's ``--peer-set`` then its own on top (``peer_overrides``), reported under its full name.

Example::

    deepspeed = require("zero3-offload")  # the module, or PeerUnavailable with one line
    base, label = split_variant("zero3-offload:big")  # ("zero3-offload", "big")
"""

from __future__ import annotations

import copy
import importlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import yaml

from slidedp.errors import ConfigError


@dataclass(frozen=True)
class Peer:
    package: str | None  # what the worker imports (None: torch alone)
    needs_cuda: bool
    scales: bool = True  # runs on N ranks with --gpus N (data parallel, one process per GPU)


PEERS: dict[str, Peer] = {
    "zero3-offload": Peer("deepspeed", needs_cuda=False),  # DeepSpeed's CPU accelerator
    "zero3-optim-offload": Peer("deepspeed", needs_cuda=False),
    "zero-offload": Peer("deepspeed", needs_cuda=False),
    "fsdp2-resident": Peer(None, needs_cuda=False),
    "roundpipe": Peer("roundpipe", needs_cuda=True, scales=False),  # its own one-GPU pipeline
}
VARIANT = re.compile(r"[A-Za-z0-9_.-]+")  # the LABEL of SYSTEM:LABEL
INSTALL_HINT = "pip install 'slidedp[peers]'; on a machine without an index: docs/benchmarks.md"


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


def split_variant(name: str) -> tuple[str, str]:
    """(system, label) of ``SYSTEM:LABEL`` in ``--systems``; label "" for a plain system."""
    system, _, label = name.partition(":")
    return system, label


def check_variant(name: str) -> str | None:
    """Why ``name`` (``SYSTEM:LABEL``) cannot be a variant, in a few words; None if it can."""
    system, label = split_variant(name)
    if not VARIANT.fullmatch(label):
        return "a LABEL is letters, digits, '-', '_' and '.'"
    if system != "ours" and system not in PEERS:
        return (
            f"only ours and a peer ({', '.join(PEERS)}) have variants, told apart by --set "
            "ours:LABEL.KEY=VALUE and --peer-set (reference and fsdp2 have no config to set)"
        )
    return None


def system_and_key(path: str, systems: Sequence[str]) -> tuple[str, str]:
    """``SYSTEM.KEY.PATH`` split after the system: a variant of ``systems`` matched whole (its
    label may hold dots), else at the first dot."""
    for name in sorted((s for s in systems if ":" in s), key=len, reverse=True):
        if path.startswith(f"{name}."):
            return name, path[len(name) + 1 :]
    system, _, key = path.partition(".")
    return system, key


def parse_peer_sets(items: list[str], systems: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """``--peer-set SYSTEM.KEY.PATH=VALUE`` (value read as YAML) → per peer a nested dict of
    overrides, e.g. ``zero3-offload.zero_optimization.stage3_prefetch_bucket_size=1e8``;
    SYSTEM may be a variant ``SYSTEM:LABEL`` of ``systems`` (``--systems``)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        path, sep, text = item.partition("=")
        system, key = system_and_key(path.strip(), systems)
        if ":" in system and system not in systems:
            raise ConfigError(
                f"--peer-set {item!r}: the variant {system} is not in --systems "
                f"{','.join(systems)!r}; name it there too"
            )
        if not sep or not key or split_variant(system)[0] not in PEERS:
            raise ConfigError(
                f"--peer-set {item!r}: use SYSTEM.KEY=VALUE with SYSTEM one of {', '.join(PEERS)}"
                " or a variant SYSTEM:LABEL of --systems (ours and its variants: --set)"
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


def peer_overrides(
    peer_sets: dict[str, dict[str, Any]], systems: list[str]
) -> dict[str, dict[str, Any]]:
    """The overrides each system of ``systems`` runs with (``RunSpec.peer``): a peer's own, a
    variant's base system's then its own merged on top (a key set in both: the variant's).
    A peer's settings that no system of ``systems`` runs are refused (one line)."""
    ran = {split_variant(name)[0] for name in systems}
    for peer in peer_sets:
        if split_variant(peer)[0] not in ran:
            raise ConfigError(
                f"--peer-set {peer}.…: {peer} is not in --systems {','.join(systems)!r}, so the "
                "setting would change nothing; name it there too, or drop the --peer-set"
            )
    out = {}
    for name in systems:
        system, label = split_variant(name)
        overrides = peer_sets.get(system, {})
        if label:
            overrides = merged(overrides, peer_sets.get(name, {}))
        if overrides:
            out[name] = overrides
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
