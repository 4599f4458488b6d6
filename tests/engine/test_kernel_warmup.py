"""``runtime.kernel_warmup``: the layer run that warms the kernels while the store is built
(only where a CUDA run compiles its layer kernels, at one rank's rows and sequence with the
run's compute), what it runs (one forward and backward under ``F`` of each layer kind, on a
thread), and its failure said in one line."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.tiny import make_model, tiny_config, write_config, write_data
from slidedp.config import load_config
from slidedp.io.hf_load import fill_master
from slidedp.models.fast import Compute
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import resolve_shape
from slidedp.profile import layer as layer_profile
from slidedp.profile.layer import ProfileSpec
from slidedp.runtime import kernel_warmup
from slidedp.runtime.kernel_warmup import KernelWarmup, warmup_spec
from slidedp.runtime.startup import StartupClock, build_store

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here


def _run(tmp_path: Path, **runtime: Any) -> tuple[Any, HFAdapter]:
    model = make_model(tmp_path, "qwen3", tied=True)
    config = write_config(tmp_path / "c.yaml", model, write_data(tmp_path / "d.jsonl", 8),
                          tmp_path / "out", train={"global_batch_size": 8},
                          data={"seq_len": 48}, runtime=runtime)  # fmt: skip
    cfg = load_config(config)
    return cfg, HFAdapter.from_dir(cfg.model.path)


def test_it_warms_only_where_a_cuda_run_compiles(
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


def test_it_runs_each_layer_kind_once_forward_and_backward(
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
    layer_profile.warm_kernels(spec, HFAdapter(resolve_shape(spec.shape)))
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


def test_a_build_that_fails_waits_for_the_warmup_before_its_error_goes_on(tmp_path: Path) -> None:
    cfg, _ = _run(tmp_path)
    spec = ProfileSpec(shape=str(Path(cfg.model.path) / "config.json"), batch=2, seq_len=16,
                       device="cpu", dtype="float32")  # fmt: skip
    with pytest.raises(RuntimeError, match="the store failed"), KernelWarmup(spec) as warmup:
        raise RuntimeError("the store failed")
    assert warmup.ran_s is not None  # its thread ended before the error left the block


def _seeded_store(adapter: HFAdapter) -> dict[str, torch.Tensor]:
    """The master weights of ``adapter``'s store as a run without weights builds it."""
    store, _ = build_store(adapter, {"staging_slots": 2}, lambda s: fill_master(adapter, s, 0),
                           StartupClock())  # fmt: skip
    return {n: store.param(n).clone() for _, n in adapter.iter_params()}


def test_the_seeded_init_beside_the_warmup_is_bit_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up runs its layer on its thread while the store is built: the seeded init
    draws the same values with it as without. transformers sets torch's process-wide default
    dtype (the config's) while it builds a model, and Qwen3.5-MoE's init draws its A_log in
    the default dtype: a model built on the warm-up's thread is held here inside that build
    for the whole init (the worst interleaving), so the warm-up builds its own beforehand."""
    path = tmp_path / "qwen3_5_moe"
    config = tiny_config("qwen3_5_moe_text", tied=False, layers=2)
    config.dtype = torch.bfloat16  # as a hub checkpoint's config says
    config.save_pretrained(path)
    adapter = HFAdapter.from_dir(path)
    model, building, release = type(adapter.skeleton), threading.Event(), threading.Event()
    build = model.__init__

    def held(self: Any, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            building.set()
            release.wait(60)
        build(self, *args, **kwargs)

    monkeypatch.setattr(model, "__init__", held)
    alone = _seeded_store(adapter)
    spec = ProfileSpec(shape=str(path / "config.json"), batch=2, seq_len=16, device="cpu",
                       dtype="float32")  # fmt: skip
    warmup = KernelWarmup(spec)
    building.wait(1)  # a thread building a model: now inside its build
    beside = _seeded_store(adapter)
    release.set()
    assert warmup.finish() is None  # it ran its layers
    assert torch.get_default_dtype() == torch.float32
    assert [n for n in alone if not torch.equal(alone[n], beside[n])] == []
