"""GPU-resident layers and embeddings on one GPU (BF16) against the all-host run: the resident
groups' AdamW is torch's fused kernel on the device instead of the host kernel, so the runs
differ by its rounding only and must track each other within the bf16 bound of the GPU parity
tests.

Run on the GPU machine: ``pytest -m "gpu and slow" tests/engine/test_gpu_resident.py``; set
``SLIDEDP_PARITY_JSON=FILE`` to keep the loss deltas.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import slidedp.runtime.resident as resident_module
from engine.test_gpu_parity import TRAIN, _data, _small_qwen3
from engine.tiny import read_metrics, write_config
from slidedp.config import load_config
from slidedp.runtime.grad_lane import AdamArgs, GradLane
from slidedp.runtime.resident import adamw_tensor
from slidedp.runtime.trainer import Trainer

LAYERS = 4  # _small_qwen3
EAGER = {"kernels": "eager", "compile": False}


def _run(
    root: Path, model_dir: Path, data: Path, name: str, clip: float, **runtime: Any
) -> list[float]:
    out = root / f"out-{name}"
    config = write_config(root / f"c-{name}.yaml", model_dir, data, out,
                          train=TRAIN | {"max_grad_norm": clip},
                          runtime={"device": "cuda", **runtime})  # fmt: skip
    trainer = Trainer(load_config(str(config), ["data.seq_len=128"]), log=False)
    k = runtime.get("resident_layers", 0)
    if k or runtime.get("resident_embeddings"):  # the resident state lives in HBM
        resident = trainer.engine.resident
        assert resident is not None
        group = trainer.adapter.layer_group(0) if k else trainer.adapter.embed_group
        assert resident.buffer(group).flat.is_cuda
        assert resident.state_bytes > 0
    trainer.run()
    return [r["loss"] for r in read_metrics(out)]


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("resident")
    return _small_qwen3(root), _data(root)


@pytest.mark.e2e
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clipped", "overlap"])
def test_resident_layers_track_the_all_host_run(
    tmp_path: Path, model_and_data: tuple[Path, Path], clip: float
) -> None:
    model_dir, data = model_and_data
    host = _run(tmp_path, model_dir, data, "host", clip, **EAGER)
    runs = {
        "2 resident": _run(tmp_path, model_dir, data, "r2", clip, resident_layers=2, **EAGER),
        "all resident": _run(tmp_path, model_dir, data, "r4", clip, resident_layers=LAYERS,
                             **EAGER),
        "embeddings resident": _run(tmp_path, model_dir, data, "emb", clip,
                                    resident_embeddings=True, **EAGER),
        "everything resident": _run(tmp_path, model_dir, data, "r4-emb", clip,
                                    resident_layers=LAYERS, resident_embeddings=True, **EAGER),
        # the default layer compute (compiled, or Liger where installed) on resident buffers
        "2 resident, default compute": _run(tmp_path, model_dir, data, "r2-default", clip,
                                            resident_layers=2),
    }  # fmt: skip
    deltas = {name: max(abs(a - b) for a, b in zip(losses, host, strict=True))
              for name, losses in runs.items()}  # fmt: skip
    summary = {"clip": clip, "steps": len(host), "max_abs_delta_loss": deltas,
               "last_loss": {"host": host[-1]} | {n: r[-1] for n, r in runs.items()}}  # fmt: skip
    if path := os.environ.get("SLIDEDP_PARITY_JSON"):
        with Path(path).with_suffix(".resident.jsonl").open("a") as f:
            f.write(json.dumps(summary) + "\n")
    print(summary)
    assert host[0] == runs["2 resident"][0]  # the same weights before any update
    # the bound of the engine's GPU parity tests (tests/engine/test_gpu_parity.py): 1e-3
    for name, delta in deltas.items():
        assert delta <= 1e-3, (name, delta)


@pytest.mark.e2e
@pytest.mark.gpu
def test_the_resident_update_overlaps_the_next_forward(
    tmp_path: Path, model_and_data: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The update runs on its own stream: the compute stream is free as soon as it is issued,
    and waits for a group's update only where the group's weights are first used. The kernel
    is made slow (a GPU sleep before the pass) so the order is observable; on the compute
    stream the first check fails, without the wait in ``buffer`` the second, and a gate that
    kept the update from being applied the last."""
    model_dir, data = model_and_data
    config = write_config(tmp_path / "c.yaml", model_dir, data, tmp_path / "out", train=TRAIN,
                          runtime={"device": "cuda", "resident_layers": 2, **EAGER})  # fmt: skip
    trainer = Trainer(load_config(str(config), ["data.seq_len=128"]), log=False)

    def slow_pass(*args: torch.Tensor) -> None:
        torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]  # ~25 ms at 2 GHz
        adamw_tensor(*args)

    monkeypatch.setattr(resident_module, "_compiled_pass", lambda: slow_pass)
    try:
        resident = trainer.engine.resident
        assert resident is not None
        group = trainer.adapter.layer_group(0)
        before = resident.buffer(group).flat.clone()
        views = trainer.engine.window.views(resident.buffer(group), group)
        ticket = GradLane.ticket(group, {name: torch.ones_like(w) for name, w in views.items()})
        resident.keep(ticket, AdamArgs(1, 1e-2, (0.9, 0.95), 1e-8, 0.0, 1.0, 1))
        torch.cuda.synchronize()
        resident.update(torch.ones((), device="cuda"))  # issued: no host wait
        resident.publish()
        compute = torch.cuda.current_stream()
        compute.synchronize()  # the norms and the gate only: the update is elsewhere
        assert resident._stream is not None
        assert not resident._stream.query(), "the update ran on the compute stream"
        weights = resident.buffer(group).flat
        after = weights.clone()  # on the compute stream: after the update
        assert not compute.query(), "the compute stream did not wait for the update"
        torch.cuda.synchronize()
        assert not torch.equal(after, before)
    finally:
        trainer.engine.close()


@pytest.mark.gpu
def test_the_compiled_update_pins_no_host_memory() -> None:
    """The first update of large tensors pins no host memory: the pass is not autotuned, so
    inductor never saves the inputs it writes to pinned host memory to time its configs (3 x 4
    GiB for Qwen3-8B's embedding, the OOM kill of BENCHMARKS.md issue #16). In a fresh
    interpreter with no headroom under the GPU memory peak (the autotuner copies to the host
    what does not fit it): with autotuning the four written tensors (3 x 256 MiB of
    f32, 128 MiB of BF16 weights) are pinned."""
    code = """
import torch
from slidedp.runtime.resident import _compiled_pass
cuda = torch.device("cuda")
kernel = _compiled_pass()
n = 4 * 2**24
f32 = [torch.zeros(n, device=cuda) for _ in range(3)]
grad, weight = (torch.zeros(n, device=cuda, dtype=torch.bfloat16) for _ in range(2))
torch.cuda.reset_peak_host_memory_stats()
kernel(*f32, grad, weight, torch.ones(8, device=cuda), torch.tensor([1.0, 1.0], device=cuda))
torch.cuda.synchronize()
print(torch.cuda.host_memory_stats().get("allocated_bytes.all.peak", 0))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) < 2**20  # the pass's own small copies at most
