"""Activation offload (``runtime.offload_ratio: 1``): the backward prefetches the next layer's
saved tensors while the current layer recomputes, so each reload only waits for a copy already
issued; a fractional ratio offloads a prefix of the saved tensors, whole."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from engine.tiny import make_model, write_config, write_data
from slidedp.cli import main
from slidedp.runtime.activations.base import LayerState
from slidedp.runtime.activations.full import FullExecutor
from slidedp.runtime.activations.offload import ActivationOffload, offload_count


@pytest.mark.e2e
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


@pytest.mark.e2e
@pytest.mark.gpu
def test_reloaded_activations_are_the_compute_streams_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reload's device copies come from the compute stream's pool: the offload stream owns
    no segment, so the blocks a layer's backward frees serve the next allocation (on the H100
    a pool of the offload stream's own held several layers' worth beside the compute stream's)."""
    import torch

    from slidedp.config import load_config
    from slidedp.runtime.trainer import Trainer

    owners: list[set[int]] = []
    reload = ActivationOffload.reload

    def watched_reload(self: ActivationOffload, layer: int, state: LayerState) -> None:
        reload(self, layer, state)
        assert self.stream is not None
        segments = torch.cuda.memory._snapshot()["segments"]
        owners.append({s["stream"] for s in segments} & {self.stream.cuda_stream})

    monkeypatch.setattr(ActivationOffload, "reload", watched_reload)
    model = make_model(tmp_path, "qwen3", tied=True, layers=3)
    data = write_data(tmp_path / "data.jsonl", 8)
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out",
                          train={"max_steps": 3, "dtype": "bfloat16"},
                          runtime={"device": "cuda", "offload_ratio": 1,
                                   "kernel_warmup": False},  # its layer would reload once more
                          output={"tensorboard": False})  # fmt: skip
    records = Trainer(load_config(config), log=False).run()
    assert all(math.isfinite(r["loss"]) for r in records)
    assert owners == [set()] * 9  # 3 steps x 3 layers, none on the offload stream
