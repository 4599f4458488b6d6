"""Transfer chunks: a group's flat layout cut into pieces of at most one store slot.

A group has two flat layouts (see ``crates/slidedp-core/src/store/layout.rs``): the BF16 *slot*
layout the device buffers use (param at ``slot_offset``) and the FP32 *state* layout of the
master/Adam arrays (param at ``state_offset - group.state_offset``). A chunk is a range of one of
them; ``pieces`` says which part of which parameter falls into it, so a copy loops over the few
parameters of a chunk, never over elements.

Example::

    for start, length in chunks(group.slot_len, store.layout.slot_len):
        for p, lo, hi in pieces(params, "slot_offset", 0, start, length):
            ...  # elements [lo, hi) of parameter p sit at [p.slot_offset + lo - start, ...)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

from slidedp.store_layout import ParamLayout


def chunks(total: int, size: int) -> list[tuple[int, int]]:
    """``(start, length)`` of consecutive chunks covering ``[0, total)``."""
    return [(start, min(size, total - start)) for start in range(0, total, size)]


def pieces(
    params: Sequence[ParamLayout],
    key: Literal["slot_offset", "state_offset"],
    base: int,
    start: int,
    length: int,
) -> Iterator[tuple[ParamLayout, int, int]]:
    """``(param, lo, hi)``: elements ``[lo, hi)`` of ``param`` lie in the chunk ``[start, start +
    length)`` of the layout whose offsets are ``param.<key> - base``."""
    for p in params:
        at = (p.slot_offset if key == "slot_offset" else p.state_offset) - base
        lo, hi = max(start, at), min(start + length, at + p.numel)
        if lo < hi:
            yield p, lo - at, hi - at
