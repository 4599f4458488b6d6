"""``slidedp bench train --context-parallel R``: ours splitting each sequence over R ranks, the
reference projected by FLOP/s (measured at a shorter length where --seq does not fit), the keys
the bench sets, bad arguments."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from bench.tiny import tiny_config, write_tiny_config
from slidedp.bench import predict as bench_predict
from slidedp.bench import train as bench_train
from slidedp.bench.measure import RunSpec
from slidedp.bench.ours import ours_raw_config
from slidedp.cli import main
from slidedp.plan import step_spec
from slidedp.plan.step_spec import Prediction, StepSpec
from slidedp.runtime.flops import model_flops_per_token

BASE = ["bench", "train", "--seq", "16", "--device", "cpu", "--batch", "2", "--warmup", "1"]
CONTEXT = ["--ranks", "2", "--context-parallel", "2", "--systems", "ours,reference"]


def _cli(config: Path, out: Path, *extra: str) -> int:
    return main([*BASE, "--steps", "1", "--shape", str(config), "--json", str(out), *extra])


@pytest.mark.e2e
def test_two_cpu_ranks_split_each_sequence(tmp_path: Path) -> None:
    """Ours on 2 CPU ranks at R=2 (one group reads the batch's 2 rows of 16 tokens, each rank 8
    of each row) beside the reference on one rank, projected to 2."""
    config = write_tiny_config(tmp_path / "m")
    out = tmp_path / "cp.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert _cli(config, out, *CONTEXT, "--no-collectives") == 0
    report = json.loads(out.read_text())
    assert report["context_parallel"]["keys_set"] == {
        "runtime.context_parallel": 2, "runtime.kernels": "eager", "runtime.compile": False,
        "runtime.policy": "fixed",
    }  # fmt: skip
    assert report["ours_config"]["runtime"]["kernels"] == "eager"  # the reference's layers too
    reference, ours = report["runs"]  # no run of ours on one rank: one is what it splits
    assert (reference["system"], reference["world"], reference["seq_len"]) == ("reference", 1, 16)
    assert (ours["system"], ours["world"], ours["status"]) == ("ours", 2, "ok")
    assert ours["tokens_per_step"] == 2 * 16  # B x S x groups: one group of 2 ranks
    assert ours["kernels"].startswith("eager")
    (row,) = report["scaling"]
    assert (row["context_parallel"], row["global_batch"], row["reference_seq_len"]) == (2, 2, 16)
    # at S' = S the FLOP/s projection is 2 x the reference's tokens/s
    assert row["reference_projected_tokens_per_s"] == pytest.approx(2 * reference["tokens_per_s"])
    text = printed.getvalue()
    assert "context parallel: each sequence over 2 of 2 ranks" in text
    assert "runtime.kernels=eager, runtime.compile=false, runtime.policy=fixed" in text
    assert "batch 2 per group of 2 (each sequence split over 2 ranks)" in text
    assert "(projected, measured at S=16: 2 x its tokens/s on 1)" in text


def _fake_child(calls: list[RunSpec], fits_seq: int) -> Any:
    """Results as a worker would write them; the reference runs out of memory above
    ``fits_seq`` tokens and runs at 1000 tokens/s at or below it."""

    def run_child(spec: RunSpec, workdir: Path) -> tuple[dict[str, Any], int]:
        calls.append(spec)
        result = {"system": spec.system, "batch": spec.batch, "host_pss_end_bytes": 2**30,
                  "gpu_peak_reserved_bytes": None}  # fmt: skip
        if spec.system == "reference" and spec.seq_len > fits_seq:
            return result | {"status": "oom", "error": "OutOfMemoryError"}, 2**30
        tokens = spec.global_batch * spec.seq_len
        step_s = tokens / 1000 if spec.system == "reference" else 0.02
        result |= {"status": "ok", "step_times_s": [step_s], "tokens_per_step": tokens}
        if spec.system == "ours":
            waits = ("wait_h2d_s", "wait_update_s", "wait_d2h_s", "wait_offload_s")
            result["lanes_s"] = dict.fromkeys(waits, 0.001)
        return result, 0

    return run_child


@pytest.mark.parametrize(
    ("extra", "fits_seq", "tried", "why"),
    [([], 8, [16, 8], "S did not fit one GPU"), (["--ref-seq", "4"], 16, [4], "--ref-seq")],
)
def test_reference_where_seq_does_not_fit_is_projected_by_flops(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    fits_seq: int,
    tried: list[int],
    why: str,
) -> None:
    calls: list[RunSpec] = []
    monkeypatch.setattr(bench_train, "run_child", _fake_child(calls, fits_seq))
    config = write_tiny_config(tmp_path / "m")
    out = tmp_path / "cp.json"
    assert _cli(config, out, *CONTEXT, "--no-collectives", *extra) == 0
    assert [(s.system, s.seq_len) for s in calls] == [
        *(("reference", seq) for seq in tried),
        ("ours", 16),
    ]
    ours = calls[-1]
    assert (ours.world, ours.context, ours.name) == (2, 2, "ours-b2-x2-replicated-gpu-cp2")
    raw = ours_raw_config(ours, tmp_path / "d.jsonl", tmp_path / "o")
    assert raw["runtime"]["context_parallel"] == 2
    assert (raw["runtime"]["ranks"], raw["train"]["global_batch_size"]) == (2, 2)
    report = json.loads(out.read_text())
    (row,) = report["scaling"]
    at = tried[-1]
    flops = {s: model_flops_per_token(tiny_config(), s) for s in (at, 16)}
    # 1000 tokens/s at S' is 1000 x F(S') FLOP/s; on 2 GPUs at S: 2 x that / F(S)
    assert row["reference_seq_len"] == at
    assert row["reference_projected_tokens_per_s"] == pytest.approx(
        2 * 1000 * flops[at] / flops[16]
    )
    assert flops[at] < flops[16]  # the attention term: fewer FLOPs per token at S' < S
    assert row["ours_over_reference_projected"] == pytest.approx(
        (2 * 16 / 0.02) / row["reference_projected_tokens_per_s"]
    )
    # on one rank at S: no ours to divide, and the reference at S' is not compared there
    assert all(v is None for r in report["ratios"] for k, v in r.items() if k != "batch")
    printed = capsys.readouterr().out
    assert f"measured at S'={at} ({why}): 2 x its " in printed
    assert f"at S={at}, not --seq" in printed
    assert "/ FLOPs per token at S=16)" in printed


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ranks", "2", "--context-parallel", "3"],
         "--context-parallel 3: needs --gpus N (or --ranks N --device cpu) and R >= 2 dividing "
         "the 2 ranks: use a divisor of 2 from 2 up"),
        (["--context-parallel", "2"], "--context-parallel 2: needs --gpus N"),
        (["--ref-seq", "8"], "--ref-seq needs --context-parallel R"),
        (["--ranks", "2", "--context-parallel", "2", "--set", "runtime.kernels=liger"],
         "--set runtime.kernels=liger: --context-parallel runs runtime.kernels=eager"),
        (["--set", "runtime.context_parallel=2"],
         "--set runtime.context_parallel=2: 'runtime.context_parallel' is set by the bench"),
        (["--ranks", "2", "--context-parallel", "2", "--seq", "15"],
         "--context-parallel 2: runtime.context_parallel=2: data.seq_len=15 must divide by it"),
    ],
)  # fmt: skip
def test_bad_context_arguments_are_one_error_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    config = write_tiny_config(tmp_path / "m")
    out = tmp_path / "cp.json"
    assert _cli(config, out, *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"slidedp bench train: error: {message}"), err
    assert err.count("\n") == 1
    assert not out.exists()  # nothing written


def _predicted_specs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, context: dict[str, Any] | None, **runtime: Any
) -> tuple[dict[str, Any], StepSpec, list[str]]:
    """``predict_report`` of one run of ours on 2 ranks at 4096 tokens (``context``: the
    report's ``context_parallel`` section, None without one): its row, the step spec it
    predicted and the probes it asked for (a layer profile without candidates, so that every
    layer is priced by FLOPs at R=1 too)."""
    write_tiny_config(tmp_path, max_position_embeddings=8192)
    ours = bench_train.ours_config([])
    ours_runtime = {**ours["runtime"], "kernels": "eager", "compile": False, **runtime}
    report: dict[str, Any] = {
        "device": "cpu", "device_name": "cpu", "peak_flops": None, "seq_len": 4096,
        "ours_config": {"train": ours["train"], "runtime": ours_runtime},
        "runs": [{"system": "ours", "status": "ok", "batch": 1, "world": 2, "seq_len": 4096,
                  "route": "replicated/gpu", "step_time_s": 1.0, "mirror": False}],
    }  # fmt: skip
    if context is not None:
        report["context_parallel"] = context
    asked: list[str] = []

    def probe(kind: str, _args: dict[str, Any], _out: Path) -> dict[str, Any]:
        asked.append(kind)
        return {"adamw_gbps": 40.0} if kind == "host" else {"candidates": []}

    specs: list[StepSpec] = []

    def predict_step(spec: StepSpec) -> Prediction:
        specs.append(spec)
        return step_spec.predict_step(spec)

    monkeypatch.setattr(bench_predict, "predict_step", predict_step)
    (row,) = bench_predict.predict_report(report, tmp_path, probe)
    return row, specs[0], asked


def test_predict_splits_the_sequence_like_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--predict`` of a ``--context-parallel 2`` run: each rank's S/2 tokens and its
    exchanges, by the run's attention scheme, as ``slidedp estimate`` predicts it; no layer
    profile of the whole sequence."""
    whole, whole_spec, whole_asked = _predicted_specs(tmp_path / "a", monkeypatch, None)
    split, split_spec, split_asked = _predicted_specs(tmp_path / "b", monkeypatch, {"size": 2})
    assert (whole["context_parallel"], whole["context_attention"]) == (1, None)
    assert whole_asked == ["host", "layer"]
    assert whole_spec.all_to_all_forward_s == ()
    # 4 query and 2 key/value heads divide by 2: Ulysses (runtime.context_attention=auto)
    assert (split["context_parallel"], split["context_attention"]) == (2, "ulysses")
    assert split_asked == ["host"]
    # Ulysses: each rank's H/2 heads over the whole sequence, its S/2 tokens' matmuls: half the
    # FLOPs of every layer (rel 1e-12: the same float sums, scaled)
    for f1, f2 in zip(whole_spec.forward_s, split_spec.forward_s, strict=True):
        assert f2 == pytest.approx(f1 / 2, rel=1e-12)
    assert len(split_spec.all_to_all_forward_s) == 2
    assert all(s > 0 for s in split_spec.all_to_all_forward_s)
    # allgather, asked for: its last rank attends over more keys than Ulysses' share
    gather, gather_spec, _ = _predicted_specs(
        tmp_path / "c", monkeypatch, {"size": 2}, context_attention="allgather"
    )
    assert gather["context_attention"] == "allgather"
    assert all(g > u for g, u in zip(gather_spec.forward_s, split_spec.forward_s, strict=True))
