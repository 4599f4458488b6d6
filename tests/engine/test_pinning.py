"""What a rank page-locks of the store (``runtime.pinning``): every byte its copies touch, and on
the sharded route about its share of the mirror only, not every rank's slots and weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from slidedp.kernels import Kernels
from slidedp.models.hf import HFAdapter
from slidedp.runtime.lanes import LaneClock
from slidedp.runtime.pinning import PAGE, dma_views, merged_pages
from slidedp.runtime.routes import signal_args
from slidedp.runtime.window import Shard, Window, WindowSpec
from slidedp.store import HostStore

CPU = torch.device("cpu")


def test_pages_are_rounded_out_merged_and_kept_inside_the_buffer() -> None:
    assert merged_pages([(10, 20)], limit=10 * PAGE) == [(0, PAGE)]
    # two shares in one page become one range; an empty range is dropped
    assert merged_pages([(PAGE + 5, PAGE + 9), (PAGE + 100, 2 * PAGE + 1), (7, 7)], 10 * PAGE) == [
        (PAGE, 3 * PAGE)
    ]
    assert merged_pages([(0, PAGE), (PAGE, 2 * PAGE)], 10 * PAGE) == [(0, 2 * PAGE)]  # touching
    assert merged_pages([(0, 10), (3 * PAGE, 3 * PAGE + 1)], 10 * PAGE) == [
        (0, PAGE),
        (3 * PAGE, 4 * PAGE),
    ]
    # the buffer starts 100 bytes into a page: rounding follows the pages, not the buffer
    assert merged_pages([(0, 10)], limit=10 * PAGE, origin=100) == [(0, PAGE - 100)]
    assert merged_pages([(5 * PAGE, 10 * PAGE + 50)], limit=10 * PAGE + 50) == [
        (5 * PAGE, 10 * PAGE + 50)  # clamped to the buffer's end
    ]


def _store(tmp_path: Path, world: int) -> tuple[HFAdapter, HostStore]:
    config = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         vocab_size=512, tie_word_embeddings=False)  # fmt: skip
    adapter = HFAdapter(config)
    store = HostStore.create(adapter.group_specs(), 0, str(tmp_path), "f32", 2 * world, 8192, True)
    return adapter, store


def _window(adapter: HFAdapter, store: HostStore, rank: int, world: int, sharded: bool) -> Window:
    layers = [adapter.layer_group(i) for i in range(adapter.num_layers)]
    spec = WindowSpec(torch.bfloat16, layers, 2, 1.0, staging_base=0, staging_count=0,
                      shard=Shard(rank, world) if sharded else None)  # fmt: skip
    return Window(store, Kernels(1), CPU, LaneClock(CPU), spec)


def _covered(views: list[torch.Tensor], region: torch.Tensor) -> torch.Tensor:
    """Which bytes of ``region`` lie in one of ``views``."""
    base, size = region.data_ptr(), region.numel() * region.element_size()
    mask = torch.zeros(size, dtype=torch.bool)
    for v in views:
        lo = v.data_ptr() - base
        if 0 <= lo < size:
            mask[lo : lo + v.numel()] = True
    return mask


@pytest.mark.parametrize("sharded", [False, True])
def test_a_rank_locks_what_its_copies_use_and_its_own_slots_only(
    tmp_path: Path, sharded: bool
) -> None:
    world = 2
    adapter, store = _store(tmp_path, world)
    mirror, grad = store.region("mirror"), store.region("grad")
    slot_bytes = store.layout.slot_len * grad.element_size()
    locked = []
    for rank in range(world):
        window = _window(adapter, store, rank, world, sharded)
        shares = [window.share(g) for g in range(len(store.layout.groups))] if sharded else None
        views = dma_views(store, staging=window.staging_range(), grad=(2 * rank, 2),
                          mirror_shares=shares)  # fmt: skip
        covered = _covered(views, mirror)
        for g, layout in enumerate(store.layout.groups):  # every byte the window's loads read
            lo, hi = window.share(g)
            at = int(layout.mirror_offset) * 2
            assert covered[at + 2 * lo : at + 2 * hi].all(), (rank, g)
        on_grad = _covered(views, grad)
        own = slice(2 * rank * slot_bytes, (2 * rank + 2) * slot_bytes)
        # its own slots, not the other rank's (but for the pages its slots begin and end in)
        assert on_grad[own].all()
        assert on_grad.sum() <= 2 * slot_bytes + 2 * PAGE
        locked.append(int(covered.sum()))
    mirror_bytes = mirror.numel() * 2
    if not sharded:
        assert locked == [mirror_bytes] * world
    else:  # its half, and at most a page more per group where shares meet a page
        pages = len(store.layout.groups) * 2 * PAGE
        for n in locked:
            assert mirror_bytes // world - pages <= n <= mirror_bytes // world + pages
        assert sum(locked) < 0.75 * world * mirror_bytes


def test_on_the_cpu_route_a_rank_locks_its_landing_slots_not_its_f32_slots(
    tmp_path: Path,
) -> None:
    world = 2
    adapter, store = _store(tmp_path, world)
    args = signal_args(world, 2, "bf16", store.layout.slot_len)
    landing = HostStore.create(**args, shm_dir=str(tmp_path))
    slots = landing.region("grad")
    assert slots.dtype == torch.bfloat16
    assert slots.numel() == 2 * world * store.layout.slot_len
    slot_bytes = store.layout.slot_len * 2
    for rank in range(world):
        window = _window(adapter, store, rank, world, sharded=False)
        views = dma_views(store, staging=window.staging_range(), grad=(2 * rank, 2),
                          mirror_shares=None, landing=landing)  # fmt: skip
        on_landing = _covered(views, slots)
        assert on_landing[2 * rank * slot_bytes : (2 * rank + 2) * slot_bytes].all()
        assert on_landing.sum() <= 2 * slot_bytes + 2 * PAGE
        assert not _covered(views, store.region("grad")).any()  # only the host writes those
