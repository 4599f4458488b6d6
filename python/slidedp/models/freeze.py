"""Frozen parameters (``train.freeze``): which of a model's stored parameters never train.

A pattern is a layer range (``layers.0-9``, or one layer ``layers.3``: every parameter of those
decoder layers), a name part (``embed_tokens``, ``lm_head``, ``self_attn``: every parameter whose
dotted name contains it as whole parts) or an fnmatch glob over the full name
(``model.layers.*.mlp.*``). A tied LM head is the embedding itself: ``lm_head`` freezes the
embedding, as ``requires_grad=False`` on one of the two names freezes the shared tensor in torch.
Refused (``ConfigError``, one line naming the pattern): a pattern that matches nothing, a layer
range outside the model, and a set that freezes every parameter.

Example::

    apply_freeze(adapter, ["embed_tokens", "layers.0-9"])  # HFAdapter.group_specs marks them
    Trained.of(adapter).lowest       # 10: layers 0-9 run forward only
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass

from slidedp.errors import ConfigError
from slidedp.models.hf import EMBED, LM_HEAD, NORM, HFAdapter

_LAYER_RANGE = re.compile(r"layers\.(\d+)(?:-(\d+))?")
_GLOB = re.compile(r"[*?\[]")


def _matches(pattern: str, name: str) -> bool:
    """Whether ``pattern`` (module docstring) names parameter ``name``."""
    layers = _LAYER_RANGE.fullmatch(pattern)
    if layers is not None:
        first, last = int(layers.group(1)), int(layers.group(2) or layers.group(1))
        parts = name.split(".")
        return (
            len(parts) > 2
            and parts[:2] == ["model", "layers"]
            and parts[2].isdigit()
            and first <= int(parts[2]) <= last
        )
    if _GLOB.search(pattern):
        return fnmatch.fnmatchcase(name, pattern)
    return f".{pattern}." in f".{name}."


def _check_range(pattern: str, num_layers: int) -> None:
    layers = _LAYER_RANGE.fullmatch(pattern)
    if layers is None:
        return
    first, last = int(layers.group(1)), int(layers.group(2) or layers.group(1))
    if not first <= last < num_layers:
        raise ConfigError(
            f"train.freeze: '{pattern}' is not a range of this model's layers 0-{num_layers - 1} "
            "(write layers.FIRST-LAST, FIRST <= LAST)"
        )


def frozen_names(adapter: HFAdapter, patterns: Iterable[str]) -> frozenset[str]:
    """The stored parameters (full HF names) that ``patterns`` freeze; ``ConfigError`` for a
    pattern that matches none of them, or when none would train."""
    stored = [full for _, full in adapter.iter_params()]
    names = stored + ([LM_HEAD] if adapter.tied else [])  # the tied head: the embedding
    frozen: set[str] = set()
    for pattern in patterns:
        _check_range(pattern, adapter.num_layers)
        hit = {n for n in names if _matches(pattern, n)}
        if not hit:
            raise ConfigError(
                f"train.freeze: '{pattern}' matches no parameter of this model (names look "
                f"like '{stored[1] if len(stored) > 1 else stored[0]}'; layers as layers.0-9, "
                "parts as embed_tokens or lm_head, or an fnmatch glob); fix or remove it"
            )
        frozen |= {EMBED if n == LM_HEAD and adapter.tied else n for n in hit}
    if frozen >= set(stored):
        raise ConfigError(
            "train.freeze freezes every parameter of this model: nothing would train; remove a "
            "pattern"
        )
    return frozenset(frozen)


def apply_freeze(adapter: HFAdapter, patterns: Iterable[str]) -> HFAdapter:
    """``adapter`` with ``frozen_names(adapter, patterns)`` set (its store groups mark them)."""
    adapter.frozen = frozen_names(adapter, patterns)
    return adapter


@dataclass(frozen=True)
class Trained:
    """What trains (``train.freeze``, ``HFAdapter.frozen``) and so what the backward computes:
    the embedding's, the final norm's and the LM head's gradients (the head: the embedding's
    when tied), each layer's frozen parameters (local names), whether a layer's input needs its
    gradient (something below it trains) and the lowest layer whose backward runs
    (``num_layers``: none; the layers below it run forward only)."""

    embed: bool
    norm: bool
    head: bool
    layer_frozen: tuple[frozenset[str], ...]
    input_grad: tuple[bool, ...]
    lowest: int

    @classmethod
    def of(cls, a: HFAdapter) -> Trained:
        embed = EMBED not in a.frozen
        layers = [a.trains(a.layer_group(i)) for i in range(a.num_layers)]
        below = [embed or any(layers[:i]) for i in range(a.num_layers)]
        runs = [i for i in range(a.num_layers) if layers[i] or below[i]]
        return cls(
            embed=embed,
            norm=NORM not in a.frozen,
            head=embed if a.tied else LM_HEAD not in a.frozen,
            layer_frozen=tuple(a.frozen_locals(a.layer_group(i)) for i in range(a.num_layers)),
            input_grad=tuple(below),
            lowest=min(runs, default=a.num_layers),
        )
