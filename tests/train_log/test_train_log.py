"""The training log: metrics.jsonl records, log lines, progress bar, TensorBoard, banner.

(The directory is not called ``logging``: on ``sys.path`` that would shadow the standard
library's ``logging``.)
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from slidedp.config import OutputSection
from slidedp.errors import ConfigError
from slidedp.runtime.flops import FLOPS_FORMULA
from slidedp.runtime.node_pss import pss_bytes
from slidedp.runtime.trackers import TensorBoardTracker
from slidedp.runtime.train_log import LogSteps, RunFacts, StepLog


def _flops_per_token(seq_len: int) -> float:
    return 1e6 + 1e3 * seq_len  # a stand-in: the real one is tested with the flops module


def _record(step: int, **extra: Any) -> dict[str, Any]:
    return {
        "step": step,
        "loss": float(step),
        "grad_norm": 0.5 * step,
        "lr": 1e-3,
        "tokens": 100,
        "seq_len": 20,
        "step_time_s": 0.5,
        "wait_h2d_s": 0.01,
        "wait_update_s": 0.02,
        "compute_s": 0.4,
    } | extra


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Writer:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.closed = False

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        self.scalars.append((tag, scalar_value, global_step))

    def add_text(self, tag: str, text_string: str, global_step: int | None = None) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _log(
    tmp_path: Path, stream: io.StringIO | None, *, total: int = 5, start: int = 0, **kw: Any
) -> StepLog:
    steps = LogSteps(total=total, start=start, every=kw.pop("every", 2))
    return StepLog(tmp_path, flops_per_token=_flops_per_token, steps=steps, stream=stream, **kw)


def _metrics(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_every_step_is_recorded_and_every_log_step_printed_with_interval_averages(
    tmp_path: Path,
) -> None:
    out = io.StringIO()
    log = _log(tmp_path, out)
    for step in range(1, 6):
        log.step(_record(step))
    log.close()
    metrics = _metrics(tmp_path)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    tflops = (1e6 + 1e3 * 20) * 100 / 0.5 / 1e12
    assert all(m["tflops"] == pytest.approx(tflops) and m["mfu"] is None for m in metrics)
    assert [("host_pss_node_bytes" in m) for m in metrics] == [False, True, False, True, True]
    # one process: the node's ranks are this process
    assert metrics[1]["host_pss_node_bytes"] == metrics[1]["host_pss_rank0_bytes"] > 0
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 2/5", "step 4/5", "step 5/5"]
    assert "loss 1.5000" in lines[0]  # the mean of steps 1 and 2
    assert "grad_norm 1.0000" in lines[0]  # the last step's
    assert "loss 3.5000" in lines[1]
    assert "200 tok/s" in lines[0]  # 200 tokens in 1 s
    assert f"{tflops:.3g} TFLOP/s" in lines[0]
    assert "MFU n/a" in lines[0]
    assert "waits 30 ms/step" in lines[0]
    assert "host PSS" in lines[0]
    assert "ETA 0:00:0" in lines[0]
    assert "\r" not in out.getvalue()  # no progress bar when not on a terminal


def test_a_terminal_gets_a_progress_bar_under_the_lines(tmp_path: Path) -> None:
    out = _Terminal()
    log = _log(tmp_path, out, every=5)
    for step in range(1, 6):
        log.step(_record(step))
    log.close()
    text = out.getvalue()
    assert f"\r[{'#' * 6}{'.' * 24}] 1/5 20% ETA" in text
    assert "\r[##############################] 5/5 100% ETA 0:00:00" in text
    assert "\r\x1b[Kstep 5/5 | loss 3.0000" in text
    assert text.endswith("\n")


def test_mfu_uses_the_peak_and_tensorboard_gets_the_scalars(tmp_path: Path) -> None:
    out, writer = io.StringIO(), _Writer()
    log = _log(tmp_path, out, peak_flops=1e9, writer=TensorBoardTracker(writer), total=2,
               every=1)  # fmt: skip
    log.step(_record(1))
    log.step(_record(2, skipped=True, nonfinite="loss", loss=None, grad_norm=None))
    log.close()
    expected = (1e6 + 1e3 * 20) * 100 / 0.5 / 1e9
    assert _metrics(tmp_path)[0]["mfu"] == pytest.approx(expected)
    assert f"MFU {100 * expected:.1f}%" in out.getvalue()
    tags = {(tag, step) for tag, _, step in writer.scalars}
    assert {("train/loss", 1), ("train/grad_norm", 1), ("train/lr", 2), ("train/mfu", 2)} <= tags
    assert ("train/loss", 2) not in tags  # a skipped step has no loss
    assert writer.closed
    assert "1 skipped | this step skipped (non-finite loss)" in out.getvalue().splitlines()[-1]


def test_mfu_of_a_context_parallel_run_sums_the_peaks_of_the_sequence_s_gpus(
    tmp_path: Path,
) -> None:
    """A record's tokens are one sequence split over R GPUs: R GPUs' peaks computed them."""
    out = io.StringIO()
    log = _log(tmp_path, out, peak_flops=1e9, batch_gpus=2, total=1, every=1)
    log.step(_record(1))
    log.close()
    expected = (1e6 + 1e3 * 20) * 100 / 0.5 / 1e9 / 2
    assert _metrics(tmp_path)[0]["mfu"] == pytest.approx(expected)
    assert f"MFU {100 * expected:.1f}%" in out.getvalue()


def test_a_resumed_run_keeps_the_records_up_to_its_step(tmp_path: Path) -> None:
    first = _log(tmp_path, None)
    for step in range(1, 5):  # a run that got to step 4, then was resumed from checkpoint-2
        first.step(_record(step, loss=1.0))
    first.close()
    resumed = _log(tmp_path, None, start=2)
    resumed.step(_record(3, loss=7.0))
    resumed.close()
    assert [(m["step"], m["loss"]) for m in _metrics(tmp_path)] == [(1, 1.0), (2, 1.0), (3, 7.0)]


def test_the_banner_names_what_a_run_needs() -> None:
    facts = RunFacts(
        model="qwen3 (/models/q)",
        params=123_456,
        layers=2,
        ranks=2,
        global_batch_size=8,
        seq_len=512,
        start_step=10,
        max_steps=100,
        resumed_from="run/checkpoint-10",
        store_bytes=3 << 30,
        pinned_bytes=1 << 30,
        device="cuda",
        dtype="bfloat16",
        window="2 layer slots, 1,024 B",
        policy="replicated/gpu, layers 2xF-r0",
        compute="eager, not compiled, attention SDPA",
        isa="avx512",
        threads=16,
        peak_flops=900e12,
        context_parallel=2,
        startup="  start-up: store created 1.9 s, weights 12.0 s, engine 8.3 s",
    )
    text = "\n".join(facts.lines())
    for part in (
        "123,456 parameters",
        "2 rank(s)",
        "8 x 512 = 4,096 tokens per step",
        "steps 11..100 of 100 (resumed from run/checkpoint-10)",
        "store 3.00 GiB",
        "still available",
        "pinned 1.00 GiB",
        "avx512 path, 16 thread(s)",
        "layer compute: eager, not compiled, attention SDPA",
        FLOPS_FORMULA,
        "900 TFLOP/s (measured bf16 GEMM) per GPU, x 2 GPUs computing each sequence",
        "start-up: store created 1.9 s, weights 12.0 s, engine 8.3 s",
    ):
        assert part in text, part


def test_host_pss_is_read_from_proc() -> None:
    pss = pss_bytes(os.getpid())
    assert pss is not None
    assert 1 << 20 < pss < 1 << 40


def test_tensorboard_defaults_to_installed_and_cannot_be_forced_without_it() -> None:
    installed = importlib.util.find_spec("tensorboard") is not None
    assert OutputSection(dir="out").tensorboard is installed
    assert OutputSection(dir="out", tensorboard=False).tensorboard is False
    if not installed:
        with pytest.raises(ConfigError, match="tensorboard is not installed: pip install"):
            OutputSection(dir="out", tensorboard=True)
