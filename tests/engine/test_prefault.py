"""The engine faults the host state its worker will update into the process before the first
updates need it (``UpdateWorker.prefault``): the groups in the order of their first updates
(forward with clipping, backward without), neither frozen nor GPU-resident ones."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from engine.tiny import make_model, write_config, write_data
from slidedp.config import load_config
from slidedp.runtime.trainer import Trainer
from slidedp.store_layout import StoreLayout

LAYERS = 3  # groups: the embedding 0, layers 1-3, the head 4


def _trainer(tmp_path: Path, clip: float, **sections: Any) -> Trainer:
    model = make_model(tmp_path, "qwen3", tied=False, layers=LAYERS)
    data = write_data(tmp_path / "data.jsonl", 8)
    train = {"max_steps": 1, "max_grad_norm": clip} | sections.pop("train", {})
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out", train=train,
                          **sections)  # fmt: skip
    return Trainer(load_config(config), log=False)


def _bytes(layout: StoreLayout, groups: list[int]) -> int:
    """What an update of ``groups`` writes: master and both moments (f32), the mirror (bf16)."""
    mirror = layout.mirror_len > 0
    return sum(layout.groups[g].trained_len * 12 + mirror * layout.groups[g].slot_len * 2
               for g in groups)  # fmt: skip


def _prefaulted(trainer: Trainer, expected: int) -> int:
    deadline = time.monotonic() + 30
    while trainer.engine.worker.prefaulted_bytes() < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return trainer.engine.worker.prefaulted_bytes()


@pytest.mark.parametrize(
    ("clip", "order"), [(1.0, [0, 1, 2, 3, 4]), (0.0, [4, 3, 2, 1, 0])], ids=["clip", "no-clip"]
)
def test_the_groups_are_faulted_in_in_the_order_of_their_first_updates(
    tmp_path: Path, clip: float, order: list[int]
) -> None:
    trainer = _trainer(tmp_path, clip)
    layout = trainer.store.layout
    assert trainer.engine.sync.host_update_order(layout) == order
    assert _prefaulted(trainer, _bytes(layout, order)) == _bytes(layout, order)


def test_frozen_and_resident_groups_are_left_out(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, 1.0, train={"freeze": ["layers.2"]},
                       runtime={"resident_layers": 1})  # fmt: skip
    engine, layout = trainer.engine, trainer.store.layout
    assert layout.groups[3].trained_len == 0  # layer 2 frozen
    assert engine.resident is not None
    held = [g for g in range(LAYERS + 2) if engine.resident.holds(g)]
    assert len(held) == 1
    assert layout.groups[held[0]].trained_len > 0  # trained, left out for residing
    order = engine.sync.host_update_order(layout)
    assert order == [g for g in (0, 1, 2, 4) if g not in held]
    assert _prefaulted(trainer, _bytes(layout, order)) == _bytes(layout, order)
