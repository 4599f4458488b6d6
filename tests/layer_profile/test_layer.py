"""``slidedp profile layer`` on CPU with a tiny shape: candidates, merged ratios, the Pareto
marks, the JSON, the PNG and the cache."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from slidedp.cli import main
from slidedp.profile import layer
from slidedp.profile.pareto import layer_time, mark_pareto

TINY = {
    "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
    "max_position_embeddings": 128,
}  # fmt: skip


def _args(tmp_path: Path, *extra: str) -> list[str]:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    return ["profile", "layer", "--shape", str(config), "--batch", "2", "--seq-len", "16",
            "--device", "cpu", "--families", "F,S0000100,N", "--ratios", "0,0.5,1",
            "--warmup", "1", "--steps", "2", "--cache-dir", str(tmp_path / "cache"),
            "--json", str(tmp_path / "p.json"), *extra]  # fmt: skip


def _profile(tmp_path: Path, *extra: str) -> dict[str, Any]:
    assert main(_args(tmp_path, *extra)) == 0
    report: dict[str, Any] = json.loads((tmp_path / "p.json").read_text())
    return report


def test_every_candidate_is_measured_once_per_distinct_offloaded_set(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    report = _profile(tmp_path, "--png", str(tmp_path / "p.png"))
    names = [c["policy"] for c in report["candidates"]]
    # F saves one tensor: 0.5 and 1 offload the same one, so F has two candidates
    assert [n for n in names if n.startswith("F")] == ["F-r0", "F-r1"]
    assert len([n for n in names if n.startswith("S0000100")]) == 3
    assert len([n for n in names if n.startswith("N")]) == 3
    for c in report["candidates"]:
        assert c["forward_s"] > 0
        assert c["backward_s"] > 0
        assert c["estimated_retained_bytes"] + c["estimated_offloaded_bytes"] > 0
    assert report["candidates"][names.index("F-r1")]["estimated_retained_bytes"] == 0
    assert any(c["pareto"] for c in report["candidates"])
    assert (tmp_path / "p.png").stat().st_size > 10_000
    for key in ("gpu", "shape", "batch", "seq_len", "dtype", "torch", "transformers", "slidedp"):
        assert key in report


def test_a_profile_is_cached_by_its_facts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _profile(tmp_path)
    assert first["cached"] is None

    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached profile was measured again")

    monkeypatch.setattr(layer, "measure", no_measuring)
    again = _profile(tmp_path)
    assert again["cached"] is not None
    assert again["candidates"] == first["candidates"]
    assert "cached" in capsys.readouterr().out
    assert main(_args(tmp_path, "--force")) == 1
    assert "measured again" in capsys.readouterr().err
    # the same config.json in another directory is the same model: the bench writes its model
    # into a new directory each run, and its runs never met the cache while the key held the
    # path (transformers' _name_or_path; BENCHMARKS.md, issue #16)
    elsewhere = tmp_path / "copy"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text((tmp_path / "config.json").read_text())
    argv = _args(tmp_path)
    argv[argv.index("--shape") + 1] = str(elsewhere / "config.json")
    assert main(argv) == 0
    assert json.loads((tmp_path / "p.json").read_text())["cached"] is not None


def test_pareto_marks_the_points_nothing_beats_in_both_memory_and_time() -> None:
    def point(mem: int, t: float) -> SimpleNamespace:
        return SimpleNamespace(retained_bytes=mem, estimated_retained_bytes=0, forward_s=t,
                               backward_s=0.0, reload_s=reload, pareto=None)  # fmt: skip

    reload = 0.0
    pts = [point(10, 5.0), point(5, 6.0), point(20, 4.0), point(12, 5.5), point(5, 7.0)]
    reload = 9.0  # nothing on the device, but its copy back takes longer than any layer
    pts.append(point(0, 1.0))
    mark_pareto(pts)
    assert [p.pareto for p in pts] == [True, True, True, False, False, True]
    assert layer_time(pts[-1]) == 18.0  # copy-bound: the forward and the backward wait for it


def test_the_kernel_view_times_each_compute_variant_and_breaks_it_down(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """CPU: Liger is skipped with its reason; the compiled variant (``aot_eager``: the traced
    graph, eager kernels) runs the same operators as eager."""
    args = _args(tmp_path, "--kernels", "eager,liger,compiled", "--backend", "aot_eager")
    report = _profile(tmp_path, *args[len(_args(tmp_path)) :])
    eager, liger, compiled = report["variants"]
    assert "CUDA/Triton only" in liger["skipped"]
    assert compiled["compute"].startswith("eager, compiled (aot_eager)")
    for v in (eager, compiled):
        assert v["step_ms"] > 0
        assert v["tflops"] == pytest.approx(report["layer_flops"] / v["step_ms"] / 1e9)
        shares = [k["share"] for k in v["kernels"]]
        assert shares == sorted(shares, reverse=True)
        assert 0 < sum(shares) <= 1 + 1e-9
    assert "aten::mm" in {k["kernel"] for k in eager["kernels"]}
    # one layer: 6 x (q, k, v, o, gate, up, down weights + S_eff * d_attn) per token
    tiny = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 16 * 64
    assert report["layer_flops"] == 2 * 16 * 6 * tiny
    printed = capsys.readouterr().out
    assert "liger           skipped: " in printed
    assert "TFLOP/s  (eager, not compiled" in printed


def test_candidates_are_what_the_layer_takes_and_their_text_selects_the_same_tensors() -> None:
    """A MoE layer gets no S mask and no SAC.noact (the runtime refuses them there); a ratio
    written as the layout's text offloads the tensors the measured candidate offloaded."""
    import torch

    from engine.tiny import tiny_config
    from slidedp.models.hf import HFAdapter
    from slidedp.plan.cost import layer_footprint
    from slidedp.plan.layout import parse_entry
    from slidedp.runtime.activations.offload import offload_count

    f32 = torch.float32
    moe = HFAdapter(tiny_config("qwen3_moe", tied=True, layers=2))
    families = {p.family + p.arg for p in layer.candidates(layer.FAMILIES, "0", moe, 2, 16, f32)}
    assert families == {"F", "SACmm", "SACattn", "N"}
    dense = HFAdapter(tiny_config("qwen3", tied=True, layers=2))
    for p in layer.candidates(layer.FAMILIES, "0,0.3,0.5,0.7,1", dense, 2, 16, f32):
        saved = list(layer_footprint(dense, p, 2, 16, f32).saved)
        _, written = parse_entry(str(p), 0.0)
        assert offload_count(saved, written.ratio) == offload_count(saved, p.ratio), str(p)


@pytest.mark.parametrize("changed", ["cpu", "logical_cores", "torch", "slidedp"])
def test_a_profile_whose_key_changed_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, changed: str
) -> None:
    """The key holds the host's CPU model and core count, the world size and the library
    versions beside the GPU, shape, batch, sequence and dtype: a change of any of them is a
    miss, never the old report (issue #16; the world size: ``test_auto``)."""
    first = _profile(tmp_path)
    assert {"cpu", "logical_cores", "world", "liger_kernel"} <= set(first)
    assert first["world"] == 1
    stale = {
        "cpu": lambda: monkeypatch.setattr(layer, "cpu_model", lambda: "another CPU"),
        "logical_cores": lambda: monkeypatch.setattr(os, "cpu_count", lambda: 512),
        "torch": lambda: monkeypatch.setattr(torch, "__version__", "0.0.1"),
        "slidedp": lambda: monkeypatch.setattr(layer, "__version__", "0.0.1"),
    }
    stale[changed]()
    again = _profile(tmp_path)
    assert again["cached"] is None  # measured, not read
    assert again[changed] != first[changed]
    assert len(list((tmp_path / "cache").glob("layer-*.json"))) == 2


def test_a_run_with_tiled_mlps_is_profiled_with_them(tmp_path: Path) -> None:
    """``runtime.mlp_tile_tokens`` reaches the profile (``ProfileSpec.mlp_tile_tokens``): its
    candidates are measured with the tiles, and ``N`` keeps the MLP's input (saved either way)
    without its four intermediates (2 x 16 tokens, 4 x 128 floats a token)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    saved = []
    for tile in (0, 5):
        spec = layer.ProfileSpec(
            shape=str(config), batch=2, seq_len=16, families="N", ratios="0", device="cpu",
            warmup=1, steps=2, cache_dir=str(tmp_path / "cache"), mlp_tile_tokens=tile,
        )  # fmt: skip
        (c,) = layer.profile_layer(spec)["candidates"]
        saved.append(c["estimated_offloaded_bytes"] + c["estimated_retained_bytes"])
    assert saved[0] - saved[1] == 2 * 16 * 4 * 128 * 4
