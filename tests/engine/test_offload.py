"""Activation offload (``runtime.offload_ratio: 1``): the backward prefetches the next layer's
input while the current layer recomputes, so each reload only waits for a copy already issued."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.tiny import make_model, write_config, write_data
from slidedp.cli import main
from slidedp.models.hf import HFAdapter
from slidedp.runtime.transfer import ActivationOffload


def test_the_backward_reloads_inputs_prefetched_one_layer_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, int] | tuple[str, int, bool]] = []
    prefetch, reload, backward = (
        ActivationOffload.prefetch, ActivationOffload.reload, HFAdapter.layer_backward,
    )  # fmt: skip

    def logged_prefetch(self: ActivationOffload, layer: int, host: Any) -> None:
        events.append(("prefetch", layer))
        prefetch(self, layer, host)

    def logged_reload(self: ActivationOffload, layer: int, host: Any) -> Any:
        events.append(("reload", layer, layer in self._ahead))  # True: no copy issued here
        return reload(self, layer, host)

    def logged_backward(self: HFAdapter, layer: int, *args: Any) -> Any:
        events.append(("backward", layer))
        return backward(self, layer, *args)

    monkeypatch.setattr(ActivationOffload, "prefetch", logged_prefetch)
    monkeypatch.setattr(ActivationOffload, "reload", logged_reload)
    monkeypatch.setattr(HFAdapter, "layer_backward", logged_backward)
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
