"""Activation offload (``runtime.offload_ratio: 1``): the backward prefetches the next layer's
saved tensors while the current layer recomputes, so each reload only waits for a copy already
issued; a fractional ratio offloads a prefix of the saved tensors, whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.tiny import make_model, write_config, write_data
from slidedp.cli import main
from slidedp.runtime.activations.base import LayerState
from slidedp.runtime.activations.full import FullExecutor
from slidedp.runtime.activations.offload import ActivationOffload, offload_count


def test_the_backward_reloads_inputs_prefetched_one_layer_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, int] | tuple[str, int, bool]] = []
    prefetch, reload, backward = (
        ActivationOffload.prefetch, ActivationOffload.reload, FullExecutor.backward,
    )  # fmt: skip

    def logged_prefetch(self: ActivationOffload, layer: int) -> None:
        events.append(("prefetch", layer))
        prefetch(self, layer)

    def logged_reload(self: ActivationOffload, layer: int, state: LayerState) -> None:
        events.append(("reload", layer, layer in self._ahead))  # True: no copy issued here
        reload(self, layer, state)

    def logged_backward(self: FullExecutor, run: Any, *args: Any) -> Any:
        events.append(("backward", run.layer))
        return backward(self, run, *args)

    monkeypatch.setattr(ActivationOffload, "prefetch", logged_prefetch)
    monkeypatch.setattr(ActivationOffload, "reload", logged_reload)
    monkeypatch.setattr(FullExecutor, "backward", logged_backward)
    model = make_model(tmp_path, "qwen3", tied=True, layers=3)
    data = write_data(tmp_path / "data.jsonl", 8)
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out",
                          train={"max_steps": 1}, runtime={"offload_ratio": 1},
                          output={"tensorboard": False})  # fmt: skip
    assert main(["train", str(config)]) == 0
    assert events == [
        ("prefetch", 2),  # during the head's loss
        ("reload", 2, True), ("prefetch", 1), ("backward", 2),
        ("reload", 1, True), ("prefetch", 0), ("backward", 1),
        ("reload", 0, True), ("backward", 0),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("saved", "ratio", "count"),
    [
        ([4, 4, 8], 0.0, 0),
        ([4, 4, 8], 0.25, 1),  # exactly a quarter: the first tensor
        ([4, 4, 8], 0.3, 2),  # more than the first: whole tensors, the next one too
        ([4, 4, 8], 0.5, 2),
        ([4, 4, 8], 0.51, 3),
        ([4, 4, 8], 1.0, 3),
        ([], 1.0, 0),
    ],
)
def test_a_ratio_offloads_the_shortest_prefix_holding_that_share(
    saved: list[int], ratio: float, count: int
) -> None:
    assert offload_count(saved, ratio) == count
