"""``slidedp profile chunks``: the engine's gradient lane timed by chunk size on this CPU (a
small layer here), the ring kept at the same bytes, the cache and its key, the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from slidedp.cli import main
from slidedp.profile import chunks
from slidedp.profile.cache import cache_file
from slidedp.profile.chunks import (
    GRAD_SLOTS,
    LAYERS,
    _Bench,
    cached_chunks,
    candidate_chunks,
    chunk_facts,
    probe_chunks,
    ring_slots,
)

CPU = torch.device("cpu")
NUMEL = 3 << 20  # a layer of 3M parameters: 6 MiB of BF16


def test_the_candidates_are_the_whole_layer_and_each_size_that_cuts_it() -> None:
    assert candidate_chunks(NUMEL, (1, 2, 4, 8)) == [0, 1 << 19, 1 << 20, 2 << 20]
    assert candidate_chunks(100, (8, 16)) == [0]  # a layer smaller than any chunk


def test_a_chunked_ring_holds_as_many_whole_layers() -> None:
    assert ring_slots(0, NUMEL, 4) == 4
    assert ring_slots(1 << 20, NUMEL, 4) == 12
    assert ring_slots(2 << 20, NUMEL, 4) == 8  # 1.5 chunks a layer: two slots each


@pytest.mark.parametrize("chunk", [0, 1 << 20, 5 << 18])
def test_the_probe_sends_every_chunk_through_the_engines_lane(chunk: int) -> None:
    """Each measured pass is ``LAYERS`` real updates of the whole layer: every version is
    published and every master weight moved (a chunk left out would leave its weights at 0,
    where the store starts)."""
    bench = _Bench(chunk, NUMEL, 1, CPU, mirror=True)
    try:
        assert bench.slots == ring_slots(chunk, NUMEL, GRAD_SLOTS)
        assert not bench.store.has_mirror  # on CPU nothing is loaded as BF16
        assert bench.step() > 0
        assert bench.store.version(0) == LAYERS
        master = bench.store.param("layers.0.weight").view(-1)
        assert bool((master != 0).all())
        assert bench.window is None  # on CPU nothing is cast nor copied to a device
    finally:
        bench.close()


def _count_measures(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    measure = chunks._measure

    def counted(*args: Any) -> dict[str, Any]:
        calls.append(args[0])
        return measure(*args)

    monkeypatch.setattr(chunks, "_measure", counted)
    return calls


def _probe(tmp_path: Path, **given: Any) -> dict[str, Any]:
    return probe_chunks(NUMEL, 1, CPU, mirror=False, mib=(1, 2), cache_dir=str(tmp_path), **given)


def test_the_probe_measures_each_candidate_once_and_caches_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_measures(monkeypatch)
    report = _probe(tmp_path)
    assert calls == [0, 1 << 19, 1 << 20]
    rows = report["candidates"]
    assert [r["chunk_elems"] for r in rows] == calls
    assert [r["chunks"] for r in rows] == [1, 6, 3]
    assert [r["grad_slots"] for r in rows] == [4, 24, 12]
    assert all(r["step_s"] > 0 for r in rows)
    assert report["cached"] is None
    again = _probe(tmp_path)
    assert len(calls) == 3  # the second answer is the cached one
    facts = chunk_facts(1, None, NUMEL, mirror=False)
    assert again["cached"] == str(cache_file(str(tmp_path), "chunks", facts))
    assert again["candidates"] == rows
    assert cached_chunks(1, None, NUMEL, False, str(tmp_path)) == again
    # on CPU nothing is loaded: the mirror makes no other key there
    assert cached_chunks(1, None, NUMEL, True, str(tmp_path)) == again
    # another layer, another thread count or another GPU is another key, and beside a GPU
    # the mirror too
    assert cached_chunks(1, None, NUMEL + 1, False, str(tmp_path)) is None
    assert cached_chunks(2, None, NUMEL, False, str(tmp_path)) is None
    assert cached_chunks(1, "NVIDIA H100 80GB HBM3", NUMEL, False, str(tmp_path)) is None
    gpu = "NVIDIA H100 80GB HBM3"
    assert chunk_facts(1, gpu, NUMEL, True) != chunk_facts(1, gpu, NUMEL, False)
    _probe(tmp_path, force=True)
    assert len(calls) == 6


@pytest.mark.parametrize(
    "damage",
    [
        lambda r: r | {"candidates": []},
        lambda r: r | {"candidates": r["candidates"][1:]},  # no whole-layer row
        lambda r: r | {"candidates": [r["candidates"][0] | {"step_s": float("nan")}]},
        lambda r: r | {"layer_numel": 7},
    ],
)
def test_a_cached_report_that_does_not_read_is_measured_again(tmp_path: Path, damage: Any) -> None:
    _probe(tmp_path)
    path = cache_file(str(tmp_path), "chunks", chunk_facts(1, None, NUMEL, mirror=False))
    path.write_text(json.dumps(damage(json.loads(path.read_text()))))
    assert cached_chunks(1, None, NUMEL, False, str(tmp_path)) is None


def test_the_command_prints_each_candidate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    shape = tmp_path / "config.json"
    shape.write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 2048,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "vocab_size": 1000,
    }))  # fmt: skip
    monkeypatch.setattr(chunks, "CHUNK_MIB", (1,))
    argv = ["profile", "chunks", "--shape", str(shape), "--device", "cpu", "--threads", "1",
            "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # q, k, v, o, gate, up, down and the two norms (and q/k norms) of one layer
    assert report["layer_numel"] == 256 * (256 + 2 * 128 + 256) + 3 * 256 * 2048 + 2 * 256 + 128
    assert [r["chunk_elems"] for r in report["candidates"]] == [0, 1 << 19]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "whole layer" in text
    assert "1 MiB" in text
    assert "loads: none (CPU)" in text
    assert "cached:" in text


@pytest.mark.gpu
@pytest.mark.parametrize("mirror", [True, False])
def test_on_a_gpu_the_probe_loads_and_returns_through_the_streams(
    tmp_path: Path, mirror: bool
) -> None:
    """Loads from the mirror, or cast through the staging ring, and the gradients' D2H into
    pinned slots on the lane's stream: every version published, every weight moved, the
    device buffer the layer's BF16 (as published before the last step's updates)."""
    cuda = torch.device("cuda")
    bench = _Bench(1 << 20, NUMEL, 4, cuda, mirror)
    try:
        assert bench.store.has_mirror == mirror
        assert bench.step() > 0
        assert bench.store.version(0) == LAYERS
        master = bench.store.param("layers.0.weight").view(-1)
        assert bool((master != 0).all())
        assert bench.window is not None
        buf = bench.window.slots[0]
        buf.group = None
        bench.window.load(buf, 0, LAYERS)
        torch.cuda.synchronize()
        assert torch.equal(buf.flat[:NUMEL].cpu(), master.to(torch.bfloat16))
    finally:
        bench.close()
    report = probe_chunks(NUMEL, 4, cuda, mirror=mirror, mib=(1,), cache_dir=str(tmp_path))
    assert report["mirror"] == mirror
    assert all(r["step_s"] > 0 for r in report["candidates"])
