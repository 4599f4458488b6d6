"""AutoPolicy as the default on CUDA (``autopolicy.default``): the rule is a function of the
config and the device, the CPU keeps the fixed default, a config naming a layout or a policy
file keeps it, and a run too short to pay a cold selection back runs the fixed default with a
banner line that says why."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cli.util import run, tiny_run_config
from engine.tiny import make_model, write_config, write_data
from estimate.machines import H100
from slidedp.autopolicy.default import (
    ASSUMED_GAIN,
    break_even_fallback,
    break_even_steps,
    default_policy,
)
from slidedp.config import load_config
from slidedp.config_runtime import RuntimeSection
from slidedp.models.hf import HFAdapter
from slidedp.plan.policy import effective_runtime
from slidedp.preflight import apply_default_policy


def test_cuda_selects_unless_the_config_names_a_layout() -> None:
    rule = default_policy(RuntimeSection(), "cuda")
    assert rule.auto
    assert rule.implicit
    for named in ({"layers": "24xSAC.mm, 12xN"}, {"offload_ratio": 1.0},
                  {"resident_layers": 2}, {"resident_embeddings": True}):  # fmt: skip
        kept = default_policy(RuntimeSection.from_keys(**named), "cuda")
        assert not kept.auto
        assert next(iter(named)) in kept.why
    for policy in ("fixed", "my-policy.yaml"):
        assert not default_policy(RuntimeSection.from_keys(policy=policy), "cuda").auto
    explicit = default_policy(RuntimeSection.from_keys(policy="auto"), "cpu")
    assert explicit.auto
    assert not explicit.implicit


def test_cpu_several_nodes_and_torchrun_keep_the_fixed_default() -> None:
    assert not default_policy(RuntimeSection(), "cpu").auto
    assert not default_policy(
        RuntimeSection.from_keys(nodes=2, master_addr="10.0.0.1"), "cuda"
    ).auto
    assert not default_policy(RuntimeSection(), "cuda", world_size_env=2).auto


def test_fixed_runs_the_config_keys() -> None:
    rt = RuntimeSection.from_keys(policy="fixed", layers="N")
    assert effective_runtime(rt) is rt


def test_break_even() -> None:
    # a 1.6 s step made 1.2x faster saves 0.267 s: 120 s pay back after 450 steps
    assert break_even_steps(1.6, 120.0) == pytest.approx(120.0 / (1.6 * (1 - 1 / ASSUMED_GAIN)))
    assert break_even_steps(1.6, 120.0) == pytest.approx(450.0)
    line = break_even_fallback(100, 1.6)
    assert line is not None
    assert "train.max_steps=100" in line
    assert "450" in line
    assert break_even_fallback(1000, 1.6) is None
    assert break_even_fallback(100, 1.6, selection_s=0.0) is None  # a cached selection
    assert break_even_fallback(100, None) is None  # no prediction: it selects


def test_a_short_run_on_cuda_keeps_the_fixed_default(tmp_path: Path) -> None:
    """The tiny model's predicted step on the H100 is milliseconds: 3 steps never pay a cold
    selection back, so the config stays fixed and the banner line says why; a long run, or a
    config naming its layout, is not touched the same way."""
    model = make_model(tmp_path, "qwen3", tied=False)
    data = write_data(tmp_path / "train.jsonl", 8)
    cfg = load_config(write_config(tmp_path / "run.yaml", model, data, tmp_path / "out"), [])
    adapter = HFAdapter.from_dir(cfg.model.path)
    kept, line = apply_default_policy(cfg, adapter, H100, None)
    assert kept is cfg
    assert line is not None
    assert "train.max_steps=3" in line
    named = replace(cfg, runtime=cfg.runtime.with_keys(layers="N"))
    assert apply_default_policy(named, adapter, H100, None) == (named, None)
    cpu = replace(H100, device="cpu", dtype="float32", gpu_name=None, gpu_total_bytes=None)
    on_cpu = apply_default_policy(cfg, adapter, cpu, None)  # fixed, and said (below)
    assert on_cpu[0] is cfg
    assert on_cpu[1] is not None
    assert on_cpu[1].startswith("policy   the fixed default on CPU")


def test_a_cpu_run_says_it_keeps_the_fixed_default(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """On CPU AutoPolicy is not the default: validate and train say so once (nothing did)."""
    config = str(tiny_run_config(tmp_path))
    line = ("policy   the fixed default on CPU: AutoPolicy is the default on CUDA "
            "(runtime.policy: auto selects here too)")  # fmt: skip
    code, out, err = run(capsys, "validate", config, "runtime.device=cpu")
    assert code == 0, err
    assert out.count(line) == 1
    code, out, err = run(capsys, "validate", config, "runtime.device=cpu", "runtime.policy=fixed")
    assert code == 0, err
    assert "policy   " not in out  # asked for: nothing to say
