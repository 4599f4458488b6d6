"""``slidedp estimate`` of the two recorded context-parallel runs against what they measured:
the GPU's peak reserved within 5% and the step within 10% (the issue's targets), on machines
built as the records' (2 and 4 H200s of one host, their host memory and /dev/shm).

- Qwen3-8B, one row of 131,072 tokens over 2 H200s (R=2, Ulysses, 36xF-r0, clipping 1.0):
  30.64 s a step, 43.41 GiB peak reserved on rank 0
  (benchmarks/2026-11-28-context-parallel-2xh200.md, context-2xh200/).
- Qwen3-14B, one row of 262,144 tokens over 4 H200s (R=4, Ulysses, 40xF-r0, clipping 1.0):
  77.0 s a step, 58.48 GiB peak reserved (benchmarks/context-4xh200/, the bench's JSON).
- Qwen3-14B, one row of 524,288 tokens over 4 H200s (40xF-r0): 287.45 s a step, 108.84 GiB
  reserved at the step's end (benchmarks/context-4xh200/metrics-qwen3-14b-524288-r4.jsonl).
- Qwen3-8B cut to 4 layers, one row of 1,048,576 tokens over 4 H200s (4xF-r1,
  ``offload_ratio: 1``): 88.29 s its second step, 91.55 GiB reserved
  (metrics-qwen3-8b-4layers-1048576-r4.jsonl).

The last two logged ``torch.cuda.memory_reserved()`` after the step, not the peak: the caching
allocator keeps what it reserved, so it is the peak's floor (both within 5% of the estimate).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import Qwen3Config

from engine.tiny import write_config, write_data
from slidedp.config import load_config
from slidedp.estimate_report import Estimate, estimate_run
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import SHAPES
from slidedp.plan.machine import GIB, Machine

H200_BYTES = 143771 * 2**20  # torch's total_memory of an H200 (139.80 GiB)


@dataclass(frozen=True)
class Record:
    shape: str
    seq_len: int
    gpus: int
    yarn_factor: float
    shm_gib: float
    available_gib: float
    step_s: float  # measured, the run's steady step
    peak_reserved_gib: float  # measured, torch.cuda.max_memory_reserved (or its floor)
    layers: int | None = None  # the model cut to this many decoder layers
    offload_ratio: float = 0.0


RECORDS = {
    "qwen3-8b-131072-r2": Record("qwen3-8b", 131072, 2, 4.0, 256.0, 250.53, 30.64, 43.41),
    "qwen3-14b-262144-r4": Record("qwen3-14b", 262144, 4, 8.0, 512.0, 499.77, 77.0, 58.48),
    "qwen3-14b-524288-r4": Record("qwen3-14b", 524288, 4, 16.0, 512.0, 502.19, 287.45, 108.84),
    "qwen3-8b-4layers-1048576-r4": Record(
        "qwen3-8b", 1048576, 4, 32.0, 512.0, 499.42, 88.29, 91.55, layers=4, offload_ratio=1.0
    ),
}


def _estimate(tmp_path: Path, record: Record) -> Estimate:
    model = tmp_path / record.shape
    rope = {"rope_type": "yarn", "factor": record.yarn_factor,
            "original_max_position_embeddings": 32768}  # fmt: skip
    cut = {"num_hidden_layers": record.layers} if record.layers else {}
    Qwen3Config(**{**SHAPES[record.shape], "max_position_embeddings": record.seq_len,
                   "rope_scaling": rope, **cut}).save_pretrained(model)  # fmt: skip
    data = write_data(tmp_path / "data.jsonl", 2)
    path = write_config(tmp_path / "run.yaml", model, data, tmp_path / "out")
    r = record.gpus
    cfg = load_config(path, [
        "runtime.device=auto", f"runtime.gpus={r}", f"runtime.context_parallel={r}",
        "runtime.kernels=eager", "runtime.compile=false", "runtime.policy=fixed",
        f"runtime.offload_ratio={record.offload_ratio}", f"data.seq_len={record.seq_len}",
        "train.global_batch_size=1", "train.max_grad_norm=1.0",
    ])  # fmt: skip
    machine = Machine(device="cuda", dtype="bfloat16", cores=16 * r,
                      shm_free_bytes=int(record.shm_gib * GIB),
                      mem_available_bytes=int(record.available_gib * GIB),
                      gpu_name="NVIDIA H200", gpu_total_bytes=H200_BYTES,
                      gpu_count=r)  # fmt: skip
    return estimate_run(cfg, HFAdapter.from_dir(model), machine)


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_the_estimate_of_a_recorded_context_parallel_run(tmp_path: Path, name: str) -> None:
    """The peak reserved within 5% of the record's (the estimate's peak, without the CUDA
    context that torch does not count), the step-time model within 10% of its step: the
    bounds the project holds the estimate to (memory) and the step-time model to (10 of 11
    one-GPU configurations, docs/estimate.md). With attention's rate falling past 131,072 keys
    (``plan.attention_rate.attention_efficiency``) the four steps are within 2.1%; at one rate for
    every row the 1M row was 0.853x."""
    record = RECORDS[name]
    est = _estimate(tmp_path, record)
    assert est.gpu is not None
    assert est.gpu.peak_reserved_bytes / GIB == pytest.approx(record.peak_reserved_gib, rel=0.05)
    assert est.step_model is not None
    assert est.step_model.step_s == pytest.approx(record.step_s, rel=0.10)
