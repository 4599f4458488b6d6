"""The training log's host memory on several ranks is the node's: the PSS of each of its ranks,
summed (rank 0's own beside it), as ``slidedp estimate``'s host RAM counts the node."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from engine.tiny import make_model, read_metrics, write_config, write_data
from multirank.ranks import run_ranks
from slidedp.runtime.trainer import Trainer

BALLAST_BYTES = 256 << 20  # rank 1's own memory, which rank 0's PSS cannot contain


@pytest.mark.e2e
def test_two_ranks_log_their_node_s_pss_not_rank_0_s_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    init, held = Trainer.__init__, []

    def rank_1_holds_ballast(self: Trainer, *args: Any, **kwargs: Any) -> None:
        if os.environ["RANK"] == "1":  # written, so resident and private, before the ranks meet
            held.append(b"\x01" * BALLAST_BYTES)
        init(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "__init__", rank_1_holds_ballast)  # the forked ranks have it
    model = make_model(tmp_path, "qwen3", tied=False, layers=2)
    data = write_data(tmp_path / "data.jsonl", 16)
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", model, data, out, train={"max_steps": 2},
                          runtime={"ranks": 2}, output={"tensorboard": False})  # fmt: skip
    assert run_ranks(config, 2) == [0, 0]
    metrics = read_metrics(out)
    assert len(metrics) == 2
    for m in metrics:  # output.log_steps=1: every step is logged
        # the node's sum holds rank 1's PSS, which holds the ballast it alone maps
        assert m["host_pss_node_bytes"] - m["host_pss_rank0_bytes"] >= BALLAST_BYTES, m
        assert m["host_pss_rank0_bytes"] > 0
