"""Per-layer activation layouts: a checkpoint family and an offload ratio for each decoder layer.

Text form (``runtime.layers``): comma-separated ``[COUNTx]FAMILY[-rRATIO]`` entries. Families:
``F`` full-layer checkpointing (input saved, the layer replayed); ``S<mask>`` segment
checkpointing, seven bits over ``runtime.activations.segments.BOUNDARIES``; ``SAC<preset>``
selective checkpointing (``SAC_PRESETS``); ``N`` none. ``-rRATIO`` (default
``runtime.offload_ratio``) moves that fraction of the saved bytes to pinned host memory, whole
tensors in save order. At most one entry without a count takes the layers the others leave.

Example::

    layers = parse_layout("31xF-r0, 9xN", num_layers=40, default_ratio=0.0)
    format_layout(layers)  # '31xF-r0, 9xN-r0'
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from slidedp.errors import ConfigError

SEGMENT_BITS = 7
# named operator sets of selective checkpointing (runtime.activations.selective)
SAC_PRESETS = {
    "mm": "save every matmul output (q/k/v/o, gate/up/down); recompute norms, rotary, attention "
    "core, activation",
    "attn": "save the attention core's output; recompute everything else",
    "noact": "save every operator output except the MLP activation's",
}
FAMILIES = ("F", "S", "SAC", "N")
_ENTRY = re.compile(r"^(?:(\d+)\s*x\s*)?(F|N|S[01]{7}|SAC\.[a-z]+)(?:-r([0-9.]+))?$")


@dataclass(frozen=True)
class LayerPolicy:
    """One layer's activation layout: family (``F``, ``S``, ``SAC``, ``N``), its argument (the
    segment mask or the SAC preset) and the fraction of its saved bytes offloaded."""

    family: str
    arg: str = ""  # S: 7-bit mask ('1010100'); SAC: preset name
    ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown checkpoint family '{self.family}' (one of {FAMILIES})")
        if self.family == "S" and not re.fullmatch(r"[01]{7}", self.arg):
            raise ConfigError(f"segment mask must be {SEGMENT_BITS} bits, got '{self.arg}'")
        if self.family == "SAC" and self.arg not in SAC_PRESETS:
            raise ConfigError(
                f"unknown SAC preset '{self.arg}' (one of {', '.join(sorted(SAC_PRESETS))})"
            )
        if not 0.0 <= self.ratio <= 1.0:
            raise ConfigError(f"offload ratio must be in [0, 1], got {self.ratio}")

    @property
    def name(self) -> str:
        """The family with its argument, e.g. ``F``, ``S1010100``, ``SAC.mm``."""
        if self.family == "S":
            return f"S{self.arg}"
        if self.family == "SAC":
            return f"SAC.{self.arg}"
        return self.family

    def __str__(self) -> str:
        return f"{self.name}-r{self.ratio:g}"


def parse_entry(text: str, default_ratio: float) -> tuple[int | None, LayerPolicy]:
    """``"31xF-r0"`` → ``(31, LayerPolicy('F', ratio=0))``; no count → ``None``."""
    m = _ENTRY.match(text.strip())
    if m is None:
        raise ConfigError(
            f"cannot read layout entry '{text.strip()}': expected [COUNTx]FAMILY[-rRATIO], "
            "FAMILY one of F, N, S<7 bits>, SAC.<preset> (e.g. '31xF-r0', 'S1010100-r0.5')"
        )
    count, fam, ratio_text = m.groups()
    try:
        ratio = default_ratio if ratio_text is None else float(ratio_text)
    except ValueError:
        raise ConfigError(
            f"offload ratio '{ratio_text}' in '{text.strip()}' is not a number"
        ) from None
    if fam.startswith("SAC."):
        policy = LayerPolicy("SAC", fam[4:], ratio)
    elif fam.startswith("S"):
        policy = LayerPolicy("S", fam[1:], ratio)
    else:
        policy = LayerPolicy(fam, "", ratio)
    return (None if count is None else int(count)), policy


def parse_layout(text: str, num_layers: int, default_ratio: float) -> tuple[LayerPolicy, ...]:
    """The per-layer layout ``text`` describes for ``num_layers`` layers, in layer order."""
    entries = [parse_entry(e, default_ratio) for e in text.split(",") if e.strip()]
    if not entries:
        raise ConfigError("runtime.layers is empty: give e.g. 'F' (every layer F)")
    rest = [p for n, p in entries if n is None]
    if len(rest) > 1:
        raise ConfigError(f"runtime.layers '{text}': at most one entry without a count")
    counted = sum(n for n, _ in entries if n is not None)
    left = num_layers - counted
    if left < 0 or (left > 0 and not rest) or (left == 0 and rest and counted < num_layers):
        raise ConfigError(
            f"runtime.layers '{text}' describes {counted} layers, the model has {num_layers}"
            + ("" if rest else " (add an entry without a count for the rest)")
        )
    layers: list[LayerPolicy] = []
    for n, p in entries:
        layers.extend([p] * (left if n is None else n))
    return tuple(layers)


def format_layout(layers: Sequence[LayerPolicy]) -> str:
    """The compact text form: runs of equal layers, ``"31xF-r0, 9xN-r0"``."""
    runs: list[tuple[int, LayerPolicy]] = []
    for p in layers:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0] + 1, p)
        else:
            runs.append((1, p))
    return ", ".join(f"{n}x{p}" for n, p in runs)


def place(
    counts: Sequence[tuple[LayerPolicy, int]], retained_bytes: dict[LayerPolicy, int]
) -> tuple[LayerPolicy, ...]:
    """A placement across layers from counts per candidate (paper §3.5 "Layout across layers"):
    layers that offload first and contiguous (their copies overlap the whole forward), then the
    GPU-retained ones toward the decoder tail from lighter to heavier, so the backward (last
    layer first) frees the largest retained states first. ``retained_bytes`` ranks candidates."""
    offloading = [(p, n) for p, n in counts if p.ratio > 0]
    retained = [(p, n) for p, n in counts if p.ratio == 0]
    offloading.sort(key=lambda pn: -pn[0].ratio)
    retained.sort(key=lambda pn: retained_bytes[pn[0]])
    return tuple(p for p, n in offloading + retained for _ in range(n))


def place_by_kind(
    counts: Sequence[tuple[int, LayerPolicy, int]],
    retained_bytes: dict[tuple[int, LayerPolicy], int],
    layer_kinds: Sequence[int],
) -> tuple[LayerPolicy, ...]:
    """``place`` for layers of several kinds (``HFAdapter.layer_kinds``: each layer's kind):
    each kind's counts ``(kind, policy, count)`` placed, as ``place`` orders them, on that
    kind's layers in layer order."""
    layers: list[LayerPolicy | None] = [None] * len(layer_kinds)
    for kind in sorted(set(layer_kinds)):
        own = [i for i, k in enumerate(layer_kinds) if k == kind]
        placed = place([(p, n) for k, p, n in counts if k == kind and n > 0],
                       {p: b for (k, p), b in retained_bytes.items() if k == kind})  # fmt: skip
        if len(placed) != len(own):
            raise ValueError(f"layer {kind}'s kind has {len(own)} layers, {len(placed)} counted")
        for i, p in zip(own, placed, strict=True):
            layers[i] = p
    return tuple(p for p in layers if p is not None)
