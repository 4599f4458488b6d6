"""Which of the store's slot memory a rank page-locks: only what its own DMAs touch.

The store's staging and gradient regions hold every rank's slots, and the BF16 mirror every
group's weights. A rank copies only through its own slots (its gradient copies land in the
store's gradient slots, or on the cpu route of several ranks in its landing slots of the signal
store, whose f32 sums only the host writes), and on the sharded route it loads
only its share of each group from the mirror (the all-gather rebuilds the rest), so locking the
whole regions in every rank locked each page ``world`` times and cost start-up time (Qwen3-32B
on four H200s: 23.8 s of pinning against 7.0 on one). A copy from memory that is not
page-locked stays correct (CUDA stages it), only slower, so what is left out is what no copy
of this rank reads on the training path.

Ranges are rounded out to whole pages and merged where they meet: CUDA registers pages, and a
process may not register one page twice.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from slidedp.errors import HostIOError
from slidedp.runtime.transfer import pin, unpin
from slidedp.runtime.window import Window
from slidedp.store import HostStore

PAGE = 4096


def merged_pages(
    ranges: Iterable[tuple[int, int]], limit: int, origin: int = 0
) -> list[tuple[int, int]]:
    """Byte offsets ``[start, end)`` of a buffer whose first byte lies ``origin`` bytes into a
    page, rounded out to whole pages but kept within ``[0, limit)``, sorted, and merged where
    they overlap or touch; empty ranges dropped."""
    out: list[tuple[int, int]] = []
    for start, end in sorted((s, e) for s, e in ranges if e > s):
        lo = max((start + origin) // PAGE * PAGE - origin, 0)
        hi = min(-(-(end + origin) // PAGE) * PAGE - origin, limit)
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def pin_dma_memory(
    store: HostStore, window: Window, landing: HostStore, grad: tuple[int, int]
) -> list[torch.Tensor]:
    """Page-lock what this rank's copies use (``dma_views`` of the window's staging slots and
    mirror shares, and the gradient slots ``grad`` of ``landing``, the store its gradient
    copies land in); returns the views to unpin."""
    shares = None
    if window.shard is not None:
        shares = [window.share(g) for g in range(len(store.layout.groups))]
    views = dma_views(store, staging=window.staging_range(), grad=grad, mirror_shares=shares,
                      landing=landing)  # fmt: skip
    for done, view in enumerate(views):
        try:
            pin(view, "the store's slots")
        except HostIOError:
            for pinned in views[:done]:  # the store may be unmapped and another mapped there
                unpin(pinned)
            raise
    return views


def dma_views(
    store: HostStore,
    *,
    staging: tuple[int, int],
    grad: tuple[int, int],
    mirror_shares: list[tuple[int, int]] | None,
    landing: HostStore | None = None,
) -> list[torch.Tensor]:
    """Byte views of the memory this rank's copies read or write: the store's staging slots
    ``staging`` = (first, count), the gradient slots ``grad`` of ``landing`` (None: of the
    store; both have the same slot length), and the store's mirror: all of it
    (``mirror_shares`` None: the replicated route) or, per group, the element range
    ``(lo, hi)`` of its mirror slice this rank loads (the sharded route)."""
    slot_len = store.layout.slot_len
    views: list[torch.Tensor] = []
    for memory, (first, count) in (
        (store.region("staging"), staging),
        ((store if landing is None else landing).region("grad"), grad),
    ):
        if memory.numel() and count:
            size = memory.element_size()
            views += _views(memory, [(first * slot_len * size, (first + count) * slot_len * size)])
    mirror = store.region("mirror")
    if not mirror.numel():
        return views
    if mirror_shares is None:
        return [*views, mirror.view(torch.uint8)]
    size = mirror.element_size()
    base = [int(g.mirror_offset) for g in store.layout.groups]
    ranges = [
        ((base[g] + lo) * size, (base[g] + hi) * size) for g, (lo, hi) in enumerate(mirror_shares)
    ]
    return views + _views(mirror, ranges)


def _views(memory: torch.Tensor, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    raw = memory.view(torch.uint8)
    pages = merged_pages(ranges, raw.numel(), raw.data_ptr() % PAGE)
    return [raw[lo:hi] for lo, hi in pages]
