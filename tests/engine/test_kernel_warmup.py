"""``runtime.kernel_warmup``: the layer run that warms the kernels while the store is built
(only where a CUDA run compiles its layer kernels, at one rank's rows and sequence with the
run's compute), what it runs (one forward and backward under ``F`` of each layer kind, on a
thread), and its failure said in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.tiny import make_model, tiny_config, write_config, write_data
from slidedp.config import load_config
from slidedp.models.fast import Compute
from slidedp.models.hf import HFAdapter
from slidedp.profile import layer as layer_profile
from slidedp.profile.layer import ProfileSpec
from slidedp.runtime import kernel_warmup
from slidedp.runtime.kernel_warmup import KernelWarmup, warmup_spec

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here


def _run(tmp_path: Path, **runtime: Any) -> tuple[Any, HFAdapter]:
    model = make_model(tmp_path, "qwen3", tied=True)
    config = write_config(tmp_path / "c.yaml", model, write_data(tmp_path / "d.jsonl", 8),
                          tmp_path / "out", train={"global_batch_size": 8},
                          data={"seq_len": 48}, runtime=runtime)  # fmt: skip
    cfg = load_config(config)
    return cfg, HFAdapter.from_dir(cfg.model.path)


def test_a_child_warms_only_where_a_cuda_run_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, adapter = _run(tmp_path)
    assert warmup_spec(cfg, adapter, torch.device("cpu")) is None  # nothing compiles on CPU

    chosen = Compute("eager", "")
    monkeypatch.setattr(kernel_warmup, "resolve_compute", lambda *_: chosen)
    assert warmup_spec(cfg, adapter, CUDA) is None  # eager layers: nothing to compile
    for chosen, compiled in ((Compute("liger", ""), False), (Compute("eager", "inductor"), True)):
        spec = warmup_spec(cfg, adapter, CUDA)
        assert spec is not None
        assert (spec.layer_kernels, spec.layer_compile) == (chosen.kernels, compiled)
        assert (spec.batch, spec.seq_len, spec.device) == (8, 48, "cuda")  # one rank's rows
        assert spec.shape == str(Path(cfg.model.path) / "config.json")

    off = dataclasses.replace(
        cfg, runtime=dataclasses.replace(
            cfg.runtime, launch=dataclasses.replace(cfg.runtime.launch, kernel_warmup=False)
        )
    )  # fmt: skip
    assert warmup_spec(off, adapter, CUDA) is None


def test_the_child_runs_each_layer_kind_once_forward_and_backward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[tuple[str, int, int, int]] = []

    def measure(prof: Any, policy: Any, args: ProfileSpec, kind: int) -> None:
        assert prof.adapter.compute is not None  # the run's compute patched in first
        ran.append((str(policy), args.warmup + args.steps, kind, args.batch))

    monkeypatch.setattr(layer_profile, "measure", measure)
    # Qwen3.5-MoE's tiny layers: linear attention, then full attention (two kinds)
    config = tmp_path / "config.json"
    tiny_config("qwen3_5_moe_text", tied=False, layers=4).to_json_file(config)
    spec = ProfileSpec(shape=str(config), batch=3, seq_len=16, device="cpu", dtype="float32")
    layer_profile.warm_kernels(spec)
    kinds = sorted(set(HFAdapter.from_dir(tmp_path).layer_kinds))
    assert len(kinds) == 2
    # each kind's first layer, once (its forward and its replay with the backward), at one
    # rank's rows
    assert ran == [("F-r0", 1, kind, 3) for kind in kinds]


def test_the_warmup_runs_its_layer_or_says_why_not_in_one_line(tmp_path: Path) -> None:
    cfg, _ = _run(tmp_path)
    spec = ProfileSpec(shape=str(Path(cfg.model.path) / "config.json"), batch=2, seq_len=16,
                       device="cpu", dtype="float32")  # fmt: skip
    assert KernelWarmup(spec).finish() is None  # the layer ran on its thread
    assert KernelWarmup(None).finish() is None  # nothing started, nothing to say

    missing = dataclasses.replace(spec, shape=str(tmp_path / "nowhere" / "config.json"))
    note = KernelWarmup(missing).finish()
    assert note is not None
    assert "\n" not in note
    assert note.startswith("the kernel warm-up failed (")
    assert "nowhere" in note  # the error the thread met, as itself
    assert note.endswith("): the first step compiles its kernels")
