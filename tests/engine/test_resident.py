"""GPU-resident layers (``runtime.resident_layers``, ``runtime/resident.py``) on CPU f32, where
the "device" is host memory and the resident update runs the host AdamW kernel: training with
resident layers is the all-host run bit for bit (losses, norms, checkpoints, the export), the
resident layers never go through the window nor the host update lane, a checkpoint of a run
with resident layers is the all-host run's, and resuming one continues exactly. Also the
refusals, the memory accounting, and the GPU update's math (``adamw_single_pass``, compiled as
on the GPU, which runs on CPU tensors too) against the host kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from cli.util import one_error_line, run
from engine.tiny import (
    assert_bitwise_equal,
    make_model,
    read_metrics,
    saved_tensors,
    write_config,
    write_data,
)
from estimate.machines import H100
from slidedp.cli import main
from slidedp.config import load_config
from slidedp.errors import NonFiniteError, OutOfDeviceMemoryError
from slidedp.estimate import check_fits
from slidedp.estimate_report import estimate_run
from slidedp.kernels import Kernels
from slidedp.models.hf import HFAdapter
from slidedp.plan.cost import (
    resident_bytes_per_layer,
    resident_embedding_bytes,
    resident_layer_bytes,
)
from slidedp.plan.machine import Machine
from slidedp.plan.policy import Policy, resolve_policy
from slidedp.plan.resolve import plan_store
from slidedp.runtime.grad_lane import AdamArgs, GradLane, GradTicket
from slidedp.runtime.resident import (
    REGIONS,
    ResidentLayers,
    _compiled_pass,
    _Group,
    _Param,
    adamw_single_pass,
    adamw_tensor,
    hyperparameters,
)
from slidedp.runtime.trainer import Trainer
from slidedp.runtime.window import DeviceBuffer, Window
from slidedp.update import UpdateWorker

LAYERS = 3
TRAIN = {
    "max_steps": 8,
    "global_batch_size": 4,
    "learning_rate": 3e-3,
    "weight_decay": 0.1,
    "lr_scheduler": "cosine",
    "warmup_steps": 2,
}
# the grad norms of these runs lie in 1.6 .. 3.7 (test_parity): 1.0 clips every step
CLIP = {"off": 0.0, "on": 1.0}


class _Spy:
    """The groups the window loads and the host update lane updates (nonzero length)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loaded: set[int] = set()
        self.updated: set[int] = set()
        load, submit = Window.load, UpdateWorker.submit

        def spy_load(window: Window, buf: DeviceBuffer, group: int, version: int) -> None:
            self.loaded.add(group)
            load(window, buf, group, version)

        def spy_submit(worker: UpdateWorker, group: int, start: int, length: int,
                       *args: Any, **kwargs: Any) -> int:  # fmt: skip
            if length:
                self.updated.add(group)
            return submit(worker, group, start, length, *args, **kwargs)

        monkeypatch.setattr(Window, "load", spy_load)
        monkeypatch.setattr(UpdateWorker, "submit", spy_submit)


def _train(tmp_path: Path, model: Path, data: Path, name: str, *overrides: str,
           **train: Any) -> Path:  # fmt: skip
    out = tmp_path / name
    config = write_config(tmp_path / f"{name}.yaml", model, data, out, train=TRAIN | train)
    assert main(["train", str(config), *overrides]) == 0
    return out


# (architecture, tied embeddings, clipping, activation layout): the two dense architectures with
# clipping on and off; a mixture of experts (router loss on) and Gemma 3 (sliding layers, tied,
# soft-capped) clipped; a mixed layout, partly offloaded, where the resident layers are N and SAC
CASES = [
    ("qwen3", True, "off", "F"),
    ("qwen3", True, "on", "F"),
    ("llama", False, "off", "F"),
    ("llama", False, "on", "1xN-r0.5, 1xSAC.mm, 1xS1010100-r1"),
    ("qwen3_moe", False, "on", "F"),
    ("gemma3_text", True, "on", "F"),
]


@pytest.mark.e2e
@pytest.mark.parametrize(("arch", "tied", "clip", "layout"), CASES)
def test_resident_layers_train_bit_for_bit_like_the_all_host_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, tied: bool, clip: str, layout: str
) -> None:
    model = make_model(tmp_path, arch, tied=tied, layers=LAYERS)
    data = write_data(tmp_path / "data.jsonl", 40)
    adapter = HFAdapter.from_dir(model)
    layers = f"runtime.layers={layout}"
    host = _train(tmp_path, model, data, "host", layers, max_grad_norm=CLIP[clip])
    expected = read_metrics(host)
    assert any(r["clip_coef"] < 1 for r in expected) == (clip == "on")
    embeddings = {adapter.embed_group, adapter.head_group}
    for k, with_embeddings in ((1, False), (LAYERS, False), (0, True), (LAYERS, True)):
        spy = _Spy(monkeypatch)
        name = f"resident-{k}{'-embeddings' if with_embeddings else ''}"
        out = _train(tmp_path, model, data, name, layers, f"runtime.resident_layers={k}",
                     f"runtime.resident_embeddings={with_embeddings}",
                     max_grad_norm=CLIP[clip])  # fmt: skip
        resident = {adapter.layer_group(i) for i in range(k)}
        resident |= embeddings if with_embeddings else set()
        # the resident groups never went through the window nor the host AdamW; the others did
        assert not spy.loaded & resident
        assert not spy.updated & resident
        streamed = set(range(LAYERS + 2)) - resident
        assert streamed <= spy.loaded
        assert streamed <= spy.updated
        got = read_metrics(out)
        for key in ("loss", "grad_norm", "clip_coef", "lr"):
            assert [r[key] for r in got] == [r[key] for r in expected], (name, key)
        assert_bitwise_equal(saved_tensors(out / "final"), saved_tensors(host / "final"))
        assert_bitwise_equal(
            saved_tensors(out / "checkpoint-8"), saved_tensors(host / "checkpoint-8")
        )
        state = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
        assert state["policy"]["resident_layers"] == k
        assert state["policy"]["resident_embeddings"] == with_embeddings
        resolved = (out / "resolved_config.yaml").read_text()
        assert f"resident_layers: {k}" in resolved
        assert f"resident_embeddings: {str(with_embeddings).lower()}" in resolved


@pytest.mark.e2e
def test_a_checkpoint_with_resident_layers_is_the_all_host_one_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True, layers=LAYERS)
    data = write_data(tmp_path / "data.jsonl", 40)
    saves = ("output.save_steps=4",)
    host = _train(tmp_path, model, data, "host", *saves, max_grad_norm=1.0)
    resident = ("runtime.resident_layers=2", "runtime.resident_embeddings=true")
    full = _train(tmp_path, model, data, "full", *saves, *resident, max_grad_norm=1.0)
    # mid-run: the resident layers were written back into the store before the save
    assert_bitwise_equal(saved_tensors(full / "checkpoint-4"), saved_tensors(host / "checkpoint-4"))
    config = write_config(tmp_path / "resumed.yaml", model, data, tmp_path / "resumed",
                          train=TRAIN | {"max_grad_norm": 1.0})  # fmt: skip
    cfg = load_config(config, [f"train.resume={full / 'checkpoint-4'}", *resident])
    trainer = Trainer(cfg, log=False)
    assert trainer.engine.resident is not None
    assert trainer.engine.resident.holds(trainer.adapter.embed_group)
    records = trainer.run()
    assert [r["step"] for r in records] == [5, 6, 7, 8]
    uninterrupted = read_metrics(full)[4:]
    for key in ("loss", "grad_norm", "clip_coef"):
        assert [r[key] for r in records] == [r[key] for r in uninterrupted], key
    assert_bitwise_equal(
        saved_tensors(tmp_path / "resumed" / "checkpoint-8"), saved_tensors(full / "checkpoint-8")
    )
    assert_bitwise_equal(
        saved_tensors(tmp_path / "resumed" / "final"), saved_tensors(host / "final")
    )


@pytest.fixture
def tiny_run(tmp_path: Path) -> Path:
    model = make_model(tmp_path, "qwen3", tied=True, layers=LAYERS)
    data = write_data(tmp_path / "data.jsonl", 8)
    return write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")


def test_more_resident_layers_than_the_model_has_are_refused(
    tiny_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(Several ranks: tests/multirank/test_resident_ranks.py.)"""
    code, _, err = run(capsys, "validate", str(tiny_run), "runtime.resident_layers=4")
    assert code == 2
    one_error_line(err, "validate", "runtime.resident_layers=4", "3 decoder layers")
    code, _, err = run(capsys, "train", str(tiny_run), "runtime.resident_layers=-1")
    assert code == 2
    one_error_line(err, "train", "runtime.resident_layers must be >= 0")
    policy = tiny_run.parent / "policy.yaml"  # a policy file's key counts the same
    policy.write_text("resident_layers: 2\n")
    code, _, err = run(capsys, "train", str(tiny_run), f"runtime.policy={policy}",
                       "runtime.ranks=2", "runtime.grad_route=cpu")  # fmt: skip
    assert code == 2
    one_error_line(err, "train", "runtime.resident_layers=2 on 2 ranks needs runtime.grad_route")
    assert not (tiny_run.parent / "out").exists()


def test_a_policy_file_sets_resident_layers_and_the_policy_round_trips(tiny_run: Path) -> None:
    policy_file = tiny_run.parent / "policy.yaml"
    policy_file.write_text("resident_layers: 2\n")
    cfg = load_config(tiny_run, [f"runtime.policy={policy_file}"])
    adapter = HFAdapter.from_dir(cfg.model.path)
    policy = resolve_policy(cfg.runtime, adapter, mirror=False, device=torch.device("cpu"))
    assert policy.resident_layers == 2
    assert [policy.resident(i) for i in range(LAYERS)] == [True, True, False]
    assert policy.describe().endswith(", 2 GPU-resident")
    assert Policy.from_dict(policy.to_dict()) == policy
    older = {k: v for k, v in policy.to_dict().items() if k != "resident_layers"}
    assert Policy.from_dict(older).resident_layers == 0  # checkpoints of earlier runs


@pytest.mark.parametrize("clip", list(CLIP))
def test_the_estimate_counts_resident_layers_and_refuses_what_does_not_fit(
    tiny_run: Path, clip: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = load_config(tiny_run, [f"train.max_grad_norm={CLIP[clip]}"])
    adapter = HFAdapter.from_dir(base.model.path)
    host = estimate_run(base, adapter, H100, step_model=False)
    assert host.gpu is not None
    assert host.gpu.resident_bytes == 0
    layout = plan_store(base, adapter, H100)
    for k in (1, 2, LAYERS):
        cfg = load_config(tiny_run, [f"train.max_grad_norm={CLIP[clip]}",
                                     f"runtime.resident_layers={k}"])  # fmt: skip
        est = estimate_run(cfg, adapter, H100, step_model=False)
        # BF16 weights in the slot layout, FP32 master + m + v in the state layout, and the
        # BF16 gradient held to the step's end when not clipping (else among the parked ones)
        expected = 0
        for i in range(k):
            g = layout.groups[adapter.layer_group(i)]
            params = layout.params[g.params.start : g.params.end]
            grad = 0 if clip == "on" else 2 * sum(p.numel for p in params)
            expected += 2 * g.slot_len + 12 * g.state_len + grad
        assert est.gpu is not None
        assert est.gpu.resident_bytes == expected
        assert est.resident_layers == k
        per_layer = resident_bytes_per_layer(adapter, torch.bfloat16, clipping=clip == "on")
        assert expected == k * per_layer  # the solver's bound: here every layer is alike
        # every layer resident: the window has no layer slots
        slots = 2 * 2 * max(layout.groups[adapter.layer_group(i)].slot_len
                            for i in range(LAYERS)) if k == LAYERS else 0  # fmt: skip
        assert est.gpu.needed_bytes - host.gpu.needed_bytes == expected - slots
    # a GPU that holds the all-host run but not 2 resident layers: refused with the numbers
    two = load_config(tiny_run, [f"train.max_grad_norm={CLIP[clip]}", "runtime.resident_layers=2"])
    small = Machine(**{**H100.__dict__, "gpu_total_bytes": host.gpu.needed_bytes + 1000})
    check_fits(estimate_run(base, adapter, small, step_model=False))
    with pytest.raises(OutOfDeviceMemoryError, match=r"GPU [\d.]+ GiB needed"):
        check_fits(estimate_run(two, adapter, small, step_model=False))
    # the CLI prints the row (CPU: part of the working set in host RAM)
    code, out, _ = run(capsys, "estimate", str(tiny_run), "runtime.resident_layers=2")
    assert code == 0
    assert "of which 2 resident layers" in out
    assert "2 resident, clipping" in out
    # resident embeddings add their own bytes (plan.cost.resident_embedding_bytes)
    with_embeddings = load_config(tiny_run, [f"train.max_grad_norm={CLIP[clip]}",
                                             "runtime.resident_layers=2",
                                             "runtime.resident_embeddings=true"])  # fmt: skip
    est = estimate_run(with_embeddings, adapter, H100, step_model=False)
    alone = estimate_run(two, adapter, H100, step_model=False)
    assert est.gpu is not None
    assert alone.gpu is not None
    extra = resident_embedding_bytes(adapter, torch.bfloat16, clipping=clip == "on")
    assert est.gpu.resident_bytes - alone.gpu.resident_bytes == extra
    code, out, _ = run(capsys, "estimate", str(tiny_run), "runtime.resident_layers=2",
                       "runtime.resident_embeddings=true")  # fmt: skip
    assert code == 0
    assert "of which 2 resident layers and the embeddings" in out


@pytest.mark.e2e
def test_every_resident_group_waits_for_its_update_each_step(
    tiny_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA a group's update runs on the update stream, so the compute stream must wait for
    it before the group's weights are used, every step: each layer through ``buffer``, and the
    embedding and head, whose buffers the engine keeps, through ``ready`` where a streamed one
    would be loaded. Counted here on CPU (where the wait is a no-op): without the embedding's
    and head's per-step call they would be asked once, at the engine's start."""
    asked: dict[int, int] = {}
    ready = ResidentLayers.ready

    def spy(resident: ResidentLayers, group: int) -> None:
        asked[group] = asked.get(group, 0) + 1
        ready(resident, group)

    monkeypatch.setattr(ResidentLayers, "ready", spy)
    assert main(["train", str(tiny_run), f"runtime.resident_layers={LAYERS}",
                 "runtime.resident_embeddings=true"]) == 0  # fmt: skip
    steps = len(read_metrics(tiny_run.parent / "out"))
    adapter = HFAdapter.from_dir(load_config(tiny_run, []).model.path)
    groups = [adapter.embed_group, adapter.head_group]
    groups += [adapter.layer_group(i) for i in range(LAYERS)]
    assert steps > 1
    for group in groups:
        assert asked.get(group, 0) > steps, (group, asked)


@pytest.mark.e2e
def test_the_engine_allocates_what_the_accounting_counts(tiny_run: Path) -> None:
    """CPU f32, clipping (no gradient term): the resident weights and FP32 state the engine
    holds are ``resident_layer_bytes``; resident embeddings add their FP32 state, which is what
    the accounting adds (the update reads their gradient with no f32 copy)."""
    cfg = load_config(tiny_run, ["runtime.resident_layers=2", "train.max_grad_norm=1.0",
                                 "runtime.resident_embeddings=true"])  # fmt: skip
    trainer = Trainer(cfg, log=False)
    try:
        resident, adapter = trainer.engine.resident, trainer.adapter
        assert resident is not None
        weights = sum(resident.buffer(g).flat.numel() * 4 for g in (1, 2))
        per_layer = resident_layer_bytes(adapter, torch.float32, clipping=True)
        extra = resident_embedding_bytes(adapter, torch.float32, clipping=True)
        assert resident.state_bytes + weights == sum(per_layer[:2]) + extra
    finally:
        trainer.engine.close()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_gpu_update_is_the_host_kernel_to_rounding(compiled: bool) -> None:
    """``adamw_single_pass`` (the CUDA path, run here on CPU tensors; compiled as on the GPU,
    or eager) against the host kernel over 5 steps with clipping and decay: the same step,
    bias correction, decay on >=2-D tensors only, gradient scale and lr, and the BF16 weights
    cast from the new master in the same pass. Tolerance: the pass rounds like torch's fused
    AdamW (its step size and decay as f32 products), the host kernel in its own order: an ulp
    or two (~1e-7 relative) per step, which the bound allows; a wrong semantic (decay on a 1-D
    tensor, the scale missed, a step off by one) moves the weights by >= 1e-4."""
    gen = torch.Generator().manual_seed(0)
    params = [_Param("w", 0, 0, 64, True), _Param("b", 64, 64, 8, False)]
    state = {r: torch.rand(72, generator=gen) * (1 if r == "master" else 1e-3) for r in REGIONS}
    host = {r: t.clone() for r, t in state.items()}
    group = _Group(0, params, state, DeviceBuffer(72, torch.bfloat16, torch.device("cpu")))
    kernels = Kernels(1)
    kernel = _compiled_pass() if compiled else adamw_tensor
    for step in range(1, 6):
        grad = torch.randn(72, generator=gen).bfloat16()
        adam = AdamArgs(step, 1e-2, (0.9, 0.95), 1e-8, 0.1, 0.5, step)
        hyper = {d: hyperparameters(adam, d, torch.device("cpu")) for d in (True, False)}
        scale = torch.tensor([adam.grad_scale, 1.0])
        grads = {"w": grad[:64].clone(), "b": grad[64:].clone()}
        adamw_single_pass(group, grads, hyper, scale, kernel)
        for p in params:
            at = slice(p.state_at, p.state_at + p.numel)
            master, exp_avg, exp_avg_sq = (host[r][at] for r in REGIONS)
            kernels.adamw(master, exp_avg, exp_avg_sq, grad[at].float(), lr=adam.lr,
                          betas=adam.betas, eps=adam.eps, step=step, grad_scale=adam.grad_scale,
                          weight_decay=adam.weight_decay if p.decays else 0.0)  # fmt: skip
    for r in REGIONS:
        torch.testing.assert_close(state[r], host[r], rtol=1e-6, atol=1e-7)
    assert torch.equal(group.weights.flat, state["master"].bfloat16())
    # gated off (a non-finite global norm: the coefficient is NaN too): nothing changes
    kept = {r: t.clone() for r, t in state.items()} | {"weights": group.weights.flat.clone()}
    grads = {"w": torch.full((64,), float("inf")).bfloat16(), "b": grad[64:].clone()}
    adamw_single_pass(group, grads, hyper, torch.tensor([float("nan"), 0.0]), kernel)
    for r in REGIONS:
        assert torch.equal(state[r], kept[r]), r
    assert torch.equal(group.weights.flat, kept["weights"])


@pytest.mark.e2e
def test_the_compiled_update_compiles_in_one_thread_without_autotuning() -> None:
    """The compiled pass compiles with one thread, in its own process, and without autotuning.
    On a GPU machine the one thread keeps inductor's pool of worker processes (one per core,
    ~0.35 GiB of host memory each) from starting, and no autotuning keeps inductor from saving
    the pass's written inputs to pinned host memory while it times its configs (3 x 4 GiB for
    Qwen3-8B's embedding): on Qwen3-8B with the BF16 mirror each took the host past its memory
    (BENCHMARKS.md issue #16). On CPU inductor uses neither, so the settings are what is
    checked. In a fresh interpreter (nothing compiled before), the settings inductor compiles
    with are recorded at each entry of ``compile_fx``: the last, innermost one compiles, inside
    the pass's own options."""
    code = """
import torch, torch._inductor.compile_fx as fx, torch._inductor.config as cfg
seen, compile_fx = [], fx.compile_fx
def spy(*a, **k):
    seen.append(f"{cfg.compile_threads},{cfg.triton.autotune_pointwise}")
    return compile_fx(*a, **k)
fx.compile_fx = spy
from slidedp.runtime.resident import _compiled_pass
t = [torch.rand(8), torch.rand(8), torch.rand(8), torch.randn(8).bfloat16(),
     torch.empty(8).bfloat16(), torch.rand(8), torch.tensor([1.0, 1.0])]
_compiled_pass()(*t)
print(f"{cfg.compile_threads},{cfg.triton.autotune_pointwise}", *seen)
"""
    env = os.environ | {"TORCHINDUCTOR_COMPILE_THREADS": "4"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    setting, *seen = out.stdout.split()
    # the process's settings kept; the compile in one thread, without autotuning
    assert (setting, seen[-1]) == ("4,True", "1,False")


def _poison_gradient(monkeypatch: pytest.MonkeyPatch, group: int, call: int) -> None:
    """``group``'s gradient gets an infinite element in its ``call``-th ticket (0-based: the
    step); the counter restarts for every trainer built afterwards (``Trainer`` is wrapped)."""
    ticket, init = GradLane.ticket, Trainer.__init__
    calls = [0]

    def poisoned(g: int, grads: dict[str, torch.Tensor]) -> GradTicket:
        if g == group:
            if calls[0] == call:
                next(iter(grads.values())).view(-1)[0] = float("inf")
            calls[0] += 1
        return ticket(g, grads)

    def fresh(self: Trainer, *args: Any, **kwargs: Any) -> None:
        calls[0] = 0
        init(self, *args, **kwargs)

    monkeypatch.setattr(GradLane, "ticket", staticmethod(poisoned))
    monkeypatch.setattr(Trainer, "__init__", fresh)


@pytest.mark.e2e
def test_a_non_finite_resident_gradient_stops_or_skips_as_in_the_all_host_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True, layers=LAYERS)
    data = write_data(tmp_path / "data.jsonl", 16)
    adapter = HFAdapter.from_dir(model)
    _poison_gradient(monkeypatch, adapter.layer_group(1), call=1)
    name = adapter.groups[adapter.layer_group(1)].name
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out",
                          train=TRAIN | {"max_steps": 3})  # fmt: skip
    for k in (0, 2):  # without clipping: stopped at step 1, naming the layer
        cfg = load_config(config, [f"runtime.resident_layers={k}", f"output.dir={tmp_path}/s{k}",
                                   "train.max_grad_norm=0"])  # fmt: skip
        with pytest.raises(NonFiniteError, match=f"gradient of '{name}' is not finite") as info:
            Trainer(cfg, log=False).run()
        assert (info.value.step, info.value.what) == (1, "grad_norm")
    runs = {}
    for k in (0, 2):  # with clipping and skip: step 1 applies nothing, on the device neither
        skip = ["train.max_grad_norm=1.0", "train.on_nonfinite=skip"]
        cfg = load_config(config, [f"runtime.resident_layers={k}", f"output.dir={tmp_path}/k{k}",
                                   *skip])  # fmt: skip
        runs[k] = Trainer(cfg, log=False).run()
        assert runs[k][1]["skipped"] is True
    assert [r.get("loss") for r in runs[2]] == [r.get("loss") for r in runs[0]]
    assert_bitwise_equal(
        saved_tensors(tmp_path / "k2" / "checkpoint-3"),
        saved_tensors(tmp_path / "k0" / "checkpoint-3"),
    )
