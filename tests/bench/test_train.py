"""``slidedp bench train``: the command end to end on CPU, the report, OOM as a result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from bench.tiny import fake_sweep, tiny_spec, write_tiny_config
from slidedp.autopolicy.validate import is_out_of_memory
from slidedp.bench import worker
from slidedp.bench.measure import RunSpec, process_tree, tree_pss_bytes
from slidedp.bench.ours import ours_raw_config
from slidedp.bench.plot import plot_sweep
from slidedp.bench.report import Model, print_report, ratios, summarise
from slidedp.bench.shape import shape_config, shape_weights
from slidedp.bench.train import ours_config, ours_configs
from slidedp.cli import main
from slidedp.errors import ConfigError
from slidedp.profile.pareto import require_matplotlib

RUN_KEYS = {
    "system", "batch", "status", "step_times_s", "step_time_s", "tokens_per_step",
    "tokens_per_s", "tflops", "mfu", "gpu_peak_reserved_gib", "host_pss_peak_gib",
    "host_pss_gib_per_billion_params", "losses",
}  # fmt: skip
REPORT_KEYS = {
    "shape", "model", "seq_len", "device", "device_name", "peak_flops", "flops_formula",
    "flops_per_token", "warmup_steps", "steps", "ours_config", "runs", "ratios",
}  # fmt: skip


def _cli(config: Path, out: Path, *extra: str) -> int:
    args = ["bench", "train", "--shape", str(config), "--seq", "16", "--device", "cpu"]
    return main([*args, "--warmup", "1", "--steps", "1", "--json", str(out), *extra])


@pytest.mark.e2e
def test_ours_a_variant_and_the_reference_end_to_end_on_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One bench command, checked as five (each run is a worker that imports torch: tens of
    seconds on 2 cores): ours, its variant ours:n (every layer N) and the reference, ours and
    ours:n traced, under a host limit that touches none; ours' time to its first step in its
    parts; then ``bench predict`` on its report with a probe run apart. (The startup and the
    untouched limit were each a worker of their own once: the same runs' figures.)"""
    config = write_tiny_config(tmp_path / "m")
    trace = tmp_path / "trace.json"
    extra = ("--batch", "2", "--systems", "ours,ours:n,reference",
             "--set", "ours:n.runtime.layers=N", "--set", "ours:n.runtime.update_threads=1",
             "--trace", str(trace),
             "--host-limit", "64")  # fmt: skip
    assert _cli(config, tmp_path / "report.json", *extra) == 0
    printed = capsys.readouterr().out
    _ours_and_reference_ran(tmp_path, printed)
    _a_host_limit_above_every_run_touches_none(tmp_path, printed)
    _ours_reports_its_time_to_the_first_step_in_parts(tmp_path)
    _a_variant_of_ours_ran_in_its_own_worker(tmp_path)
    _bench_predict_reads_probes_run_apart(tmp_path, capsys)


def _ours_and_reference_ran(tmp: Path, printed: str) -> None:
    """The report's keys, each run's figures, the trace of ours, the ratios and the printout."""
    report = json.loads((tmp / "report.json").read_text())
    spans = [e for e in json.loads((tmp / "trace.json").read_text())["traceEvents"]
             if e["ph"] == "X"]  # fmt: skip
    assert {e["name"] for e in spans} >= {"compute", "h2d", "d2h"}, "our measured step traced"
    assert set(report) >= REPORT_KEYS
    assert report["flops_formula"].startswith("6*N_matmul(active) + 6*L*S*d_attn")
    ours, n, ref = report["runs"]
    assert [r["system"] for r in (ours, n, ref)] == ["ours", "ours:n", "reference"]
    for run in (ours, n, ref):
        assert set(run) >= RUN_KEYS
        assert run["status"] == "ok"
        assert len(run["step_times_s"]) == 1
        assert run["tokens_per_step"] == 32
        assert run["tokens_per_s"] > 0
        assert run["host_pss_peak_gib"] > 0.05  # a python process with torch, sampled
        assert run["gpu_peak_reserved_gib"] is None
        assert run["mfu"] is None
    assert set(ours["exposed_wait_s"]) == {"h2d", "update", "d2h", "offload"}
    assert ours["update_threads"] >= 1  # the host kernels' threads per rank
    assert n["update_threads"] == 1  # as the variant set them
    # the reference computes with the kernels ours does (CPU: eager, not compiled)
    assert ours["kernels"] == ref["kernels"]
    assert ours["kernels"].startswith("eager, not compiled, attention SDPA")
    assert report["ratios"] == [
        {  # fsdp2 did not run: no ratio against it
            "batch": 2,
            "ours_over_reference": ours["tokens_per_s"] / ref["tokens_per_s"],
            "ours:n_over_reference": n["tokens_per_s"] / ref["tokens_per_s"],
        }
    ]
    assert "ours/reference" in printed
    assert "exposed wait" in printed
    assert printed.count("layer compute: eager, not compiled") == 3  # each run's line
    assert printed.count("to the first step") == 2  # ours' and its variant's


def _a_host_limit_above_every_run_touches_none(tmp: Path, printed: str) -> None:
    """``--host-limit 64``: reported, and under it every run is untouched (an oom would exit 0
    too: its status says)."""
    report = json.loads((tmp / "report.json").read_text())
    assert report["host_limit_gib"] == 64
    assert [r["status"] for r in report["runs"]] == ["ok"] * 3
    assert "limits (a smaller machine than this one): host 64 GiB" in printed


def _ours_reports_its_time_to_the_first_step_in_parts(tmp: Path) -> None:
    """The run of ours says how long it took to reach its first step, part by part."""
    ours = json.loads((tmp / "report.json").read_text())["runs"][0]
    s = ours["startup_s"]
    built = ("store_create_s", "fill_state_s", "mirror_s", "data_s", "engine_s", "kernels_s")
    assert set(s) == {"process_s", "config_s", "trainer_init_s", *built, "pin_s",
                      "resident_load_s", "other_init_s", "kernel_warmup_s", "first_step_s",
                      "arena_s", "to_first_step_s"}  # fmt: skip
    assert all(v >= 0 for v in s.values()), s
    assert s["process_s"] > 0.5  # the interpreter and torch's import count
    assert min(s["store_create_s"], s["engine_s"]) > 0
    assert s["data_s"] >= 0  # the tiny data is read in about a millisecond
    assert s["fill_state_s"] > 0  # the tiny model initialised into the store
    assert s["mirror_s"] < 0.05  # no BF16 mirror on CPU: nothing cast
    assert s["pin_s"] == 0  # nothing to page-lock without CUDA
    assert s["resident_load_s"] == 0  # nothing GPU-resident in the default policy
    assert s["kernels_s"] < 0.05  # no kernel warm-up on CPU: nothing compiles, none waited for
    assert s["kernel_warmup_s"] == 0
    assert ours["startup_notes"] == []
    # the parts add up (each rounded to the millisecond)
    whole = s["trainer_init_s"] - sum(s[k] for k in built)
    assert s["other_init_s"] == pytest.approx(whole, abs=6e-3)
    before = s["process_s"] + s["config_s"] + s["trainer_init_s"] + s["first_step_s"]
    assert s["to_first_step_s"] == pytest.approx(before, abs=4e-3)
    assert s["first_step_s"] > 0
    assert s["arena_s"] == 0  # nothing offloaded in the default layout
    assert ours["weights"] == "initialised from the config (seed 42)"  # no safetensors there


def test_fsdp2_baseline_runs_on_cpu(tmp_path: Path) -> None:
    spec = tiny_spec(tmp_path, "fsdp2")
    result = worker.run(spec)
    assert result["status"] == "ok"
    assert len(result["step_times_s"]) == 2
    assert min(result["step_times_s"]) > 0
    assert all(5.0 < loss < 6.0 for loss in result["losses"])  # about ln(256)


def _spec(tmp_path: Path, system: str) -> RunSpec:
    return RunSpec(
        system=system, config_dir=str(tmp_path), batch=1, seq_len=8, warmup=0, steps=1,
        device="cpu", ours=ours_config([]),
    )  # fmt: skip


def test_out_of_memory_is_a_result_other_errors_are_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def oom(spec: RunSpec) -> dict[str, Any]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def bug(spec: RunSpec) -> dict[str, Any]:
        raise ValueError("a bug")

    monkeypatch.setitem(worker.SYSTEMS, "fsdp2", oom)
    result = worker.run(_spec(tmp_path, "fsdp2"))
    assert result["status"] == "oom"
    assert result["error"].startswith("OutOfMemoryError: CUDA out of memory")
    monkeypatch.setitem(worker.SYSTEMS, "fsdp2", bug)
    with pytest.raises(ValueError, match="a bug"):
        worker.run(_spec(tmp_path, "fsdp2"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def _raw(system: str, batch: int, step_s: float | None) -> dict[str, Any]:
    if step_s is None:
        return {"system": system, "batch": batch, "status": "oom", "error": "OutOfMemoryError"}
    return {
        "system": system, "batch": batch, "status": "ok", "step_times_s": [step_s, step_s],
        "tokens_per_step": 1000, "gpu_peak_reserved_bytes": 2**31, "host_pss_end_bytes": 2**30,
    }  # fmt: skip


def test_report_means_ratios_and_oom(capsys: pytest.CaptureFixture[str]) -> None:
    model = Model(flops_per_token=1e9, peak_flops=1e13, params=2 * 10**9)
    runs = [
        summarise(_raw("ours", 4, 0.5), 2**31, model),
        summarise(_raw("reference", 4, 0.25), 0, model),
        summarise(_raw("fsdp2", 4, None), 0, model),
    ]
    ours = runs[0]
    assert ours["tokens_per_s"] == 2000
    assert ours["tflops"] == 2.0
    assert ours["mfu"] == 0.2
    assert ours["host_pss_peak_gib"] == 2.0  # the sampled peak beats the value at exit
    assert ours["host_pss_gib_per_billion_params"] == 1.0
    assert runs[1]["host_pss_peak_gib"] == 1.0
    assert runs[1]["gpu_peak_reserved_gib"] == 2.0
    assert ratios(runs) == [{"batch": 4, "ours_over_fsdp2": None, "ours_over_reference": 0.5}]
    report = {
        "shape": "x", "model": {"layers": 2, "params": 2e9}, "seq_len": 8, "warmup_steps": 1,
        "steps": 2, "device_name": "gpu", "peak_flops": 1e13, "flops_per_token": 1e9,
        "flops_formula": "f", "runs": runs, "ratios": ratios(runs),
    }  # fmt: skip
    print_report(report)
    printed = capsys.readouterr().out
    assert "OOM" in printed
    assert "ours/fsdp2 -x, ours/reference 0.50x" in printed


def test_bench_owned_keys_and_bad_systems_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ours_config(["runtime.slots=3"])["runtime"]["slots"] == 3
    # auto uncalibrated and unvalidated in the bench (it runs the default beside), unless
    # --set asks for it
    assert ours_config([])["runtime"]["policy_validate_steps"] == 0
    assert ours_config([])["runtime"]["policy_calibrate_steps"] == 0
    validated = ours_config(["runtime.policy_validate_steps=3"])
    assert validated["runtime"]["policy_validate_steps"] == 3
    with pytest.raises(ConfigError, match=r"'train\.global_batch_size' is set by the bench"):
        ours_config(["train.global_batch_size=8"])
    with pytest.raises(ConfigError, match=r"'model\.path' is set by the bench"):
        ours_config(["model.path=/x"])
    with pytest.raises(ConfigError, match=r"'train\.max_steps' must look like section\.key=value"):
        ours_config(["train.max_steps"])
    config = write_tiny_config(tmp_path / "m")
    assert _cli(config, tmp_path / "r.json", "--systems", "ours,deepspeed") == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "slidedp bench train: error: --systems 'ours,deepspeed': use a comma-separated "
        "subset of ours,reference,fsdp2,zero3-offload,zero3-optim-offload,zero-offload,"
        "fsdp2-resident,roundpipe"
    )
    assert not (tmp_path / "r.json").exists()


def test_pss_is_summed_over_the_process_tree() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in process_tree(os.getpid())
        assert tree_pss_bytes(os.getpid()) > tree_pss_bytes(child.pid) > 0
    finally:
        child.kill()
        child.wait()


def test_sweep_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    model = Model(flops_per_token=1e9, peak_flops=None, params=10**9)
    runs = [summarise(_raw(s, b, 0.1 * b), 0, model) for s in ("ours", "fsdp2") for b in (4, 8)]
    runs.append(summarise(_raw("fsdp2", 16, None), 0, model))
    report = {"shape": "x", "device_name": "gpu", "seq_len": 8, "runs": runs}
    plot_sweep(report, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(
        ConfigError, match=r"--png needs matplotlib: pip install 'slidedp\[bench\]'"
    ):
        require_matplotlib()


@pytest.mark.gpu
def test_three_systems_on_the_gpu(tmp_path: Path) -> None:
    config = write_tiny_config(tmp_path / "m", hidden_size=256, intermediate_size=768, head_dim=64)
    out = tmp_path / "report.json"
    assert _cli(config, out, "--device", "cuda", "--sweep", "2,4") == 0
    report = json.loads(out.read_text())
    assert report["peak_flops"] > 1e13
    assert report["device_name"]
    assert [(r["batch"], r["system"]) for r in report["runs"]] == [
        (b, s) for b in (2, 4) for s in ("ours", "reference", "fsdp2")
    ]
    for run in report["runs"]:
        assert run["status"] == "ok", run
        assert run["gpu_peak_reserved_gib"] > 0
        assert 0 < run["mfu"] < 1
    for row in report["ratios"]:
        assert row["ours_over_fsdp2"] > 0
        assert row["ours_over_reference"] > 0


@pytest.mark.e2e
def test_ours_with_runtime_policy_auto_and_the_reference_run_the_chosen_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the bench's processes too
    config = write_tiny_config(tmp_path / "m")
    out = tmp_path / "report.json"
    extra = ("--batch", "2", "--systems", "ours,reference", "--set", "runtime.policy=auto")
    assert _cli(config, out, *extra) == 0
    assert "policy   auto: " in capsys.readouterr().out
    ours, ref = json.loads(out.read_text())["runs"]
    # the layout the banner names (chosen, or the default kept: that rests on the host rate
    # measured here)
    assert ours["policy"].startswith(f"policy   auto: {ours['layout']}, 0 GPU-resident")
    assert ref["layout"] == ours["layout"]
    assert list((tmp_path / "cache" / "slidedp" / "profile").glob("layer-*.json"))


def _bench_predict_reads_probes_run_apart(ran: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench predict`` on the report of an earlier bench run of ours (its row of ours, as
    ``--systems ours`` writes it) and a layer probe run apart."""
    apart = ran / "apart"
    apart.mkdir()
    config = ran / "m" / "config.json"
    report = apart / "report.json"
    earlier = json.loads((ran / "report.json").read_text())
    earlier["runs"] = [r for r in earlier["runs"] if r["system"] == "ours"]
    report.write_text(json.dumps(earlier))
    probes = apart / "probes"
    probes.mkdir()
    args = {
        "shape": str(config), "batch": 2, "seq_len": 16, "families": "F", "ratios": "0",
        "device": "cpu", "dtype": "float32", "warmup": 1, "steps": 2,
        "cache_dir": str(apart / "cache"), "force": False, "layer_kernels": "auto",
        "layer_compile": None,
    }  # fmt: skip
    child = [sys.executable, "-m", "slidedp.bench.predict", "layer", json.dumps(args)]
    subprocess.run([*child, str(probes / "layer.json")], check=True)
    out = apart / "predicted.json"
    cli = ["bench", "predict", str(report), "--probes", str(probes), "--json", str(out)]
    assert main([*cli, "--host-gbps", "40"]) == 0
    (row,) = json.loads(out.read_text())["rows"]  # and its "provenance"
    assert row["adamw_gbps"] == 40
    assert row["measured_step_s"] == json.loads(report.read_text())["runs"][0]["step_time_s"]
    assert "calibrated from" in capsys.readouterr().out
    # without a host rate, or for a batch no probe covers: one line naming what is missing
    assert main(cli) == 2
    assert "no host probe in" in capsys.readouterr().err
    report.write_text(report.read_text().replace('"batch": 2', '"batch": 4'))
    assert main([*cli, "--host-gbps", "40"]) == 2
    assert "no layer profile of this model's layer at batch 4" in capsys.readouterr().err


def test_model_overrides_reach_every_system_through_the_shape_config() -> None:
    """``--set model.*`` (here the 128K setting of Qwen3's YaRN) changes the config.json every
    system builds, and only once: ours reads it from there, its own overrides cleared."""
    ours = ours_config(
        [
            "model.max_position_embeddings=131072",
            "model.rope_scaling={rope_type: yarn, factor: 4.0, "
            "original_max_position_embeddings: 32768}",
        ]
    )
    config, applied = shape_config("qwen3-4b", 2, ours)
    assert config.max_position_embeddings == 131072
    assert config.num_hidden_layers == 2
    assert config.rope_parameters["rope_type"] == "yarn"
    assert config.rope_parameters["factor"] == 4.0
    assert applied["max_position_embeddings"] == 131072
    assert ours["model"]["rope_scaling"] is None
    assert ours["model"]["max_position_embeddings"] is None
    plain, none = shape_config("qwen3-4b", 0, ours_config([]))
    assert plain.max_position_embeddings == 40960
    assert none == {}


def test_ours_variants_take_the_plain_sets_then_their_own() -> None:
    systems = ["ours", "ours:auto", "ours:v1.5", "zero3-offload"]
    items = ["ours:auto.runtime.policy=auto", "runtime.slots=3", "ours:v1.5.runtime.slots=4",
             "train.max_grad_norm=0.5"]  # fmt: skip
    configs = ours_configs(items, systems)
    assert list(configs) == ["ours", "ours:auto", "ours:v1.5"]
    assert [c["runtime"]["slots"] for c in configs.values()] == [3, 3, 4]  # the variant's wins
    assert [c["runtime"]["policy"] for c in configs.values()] == ["", "auto", ""]
    assert {c["train"]["max_grad_norm"] for c in configs.values()} == {0.5}
    # variants alone: ours' config is still made, the reference and the report follow it
    assert list(ours_configs([], ["ours:auto"])) == ["ours", "ours:auto"]
    with pytest.raises(ConfigError, match=r"the variant ours:x is not in --systems 'ours'; name"):
        ours_configs(["ours:x.runtime.slots=3"], ["ours"])
    with pytest.raises(ConfigError, match=r"every system trains the bench's one model"):
        ours_configs(["ours:x.model.max_position_embeddings=64"], ["ours", "ours:x"])
    with pytest.raises(ConfigError, match=r"'train\.global_batch_size' is set by the bench"):
        ours_configs(["ours:x.train.global_batch_size=8"], ["ours:x"])
    with pytest.raises(ConfigError, match=r"runtime"):
        ours_configs(["ours:x.runtime.no_such_key=1"], ["ours:x"])  # checked by load_config


def test_ours_variants_are_rows_ratios_and_summaries_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The workers replaced by results a worker would write: what each run of ours' family was
    given, and what the report, the summary and the figure make of their rows."""
    pytest.importorskip("matplotlib")
    step_s = {"ours": 1.0, "ours:auto": 0.5, "zero3-offload": 2.0}
    specs, figures, out = fake_sweep(
        monkeypatch, tmp_path, step_s, "--systems", "ours:auto,ours,zero3-offload",
        "--set", "runtime.slots=3", "--set", "ours:auto.runtime.policy=auto",
    )  # fmt: skip
    by_name = {(s.full_system, s.batch): s for s in specs}
    ours, auto = by_name["ours", 2], by_name["ours:auto", 2]
    assert (ours.system, ours.variant, auto.system, auto.variant) == ("ours", "", "ours", "auto")
    assert (ours.ours["runtime"]["policy"], auto.ours["runtime"]["policy"]) == ("", "auto")
    assert ours.ours["runtime"]["slots"] == auto.ours["runtime"]["slots"] == 3
    assert ours.name != auto.name  # their spec and result files apart
    report = json.loads(out.read_text())
    assert report["ours_config"] == {"train": ours.ours["train"], "runtime": ours.ours["runtime"]}
    assert report["ours_variants"] == {
        "ours:auto": {"train": auto.ours["train"], "runtime": auto.ours["runtime"]}
    }
    for row in report["ratios"]:  # each of ours' family over every other system, not each other
        assert row["ours_over_zero3-offload"] == pytest.approx(2.0)
        assert row["ours:auto_over_zero3-offload"] == pytest.approx(4.0)
        assert not [k for k in row if k.endswith(("_over_ours", "_over_ours:auto"))]
    geomeans = {(p["ours"], p["system"]): p["geomean_ours_over_peer"]
                for p in report["summary"]["peers"]}  # fmt: skip
    assert geomeans == {
        ("ours", "zero3-offload"): pytest.approx(2.0),
        ("ours:auto", "zero3-offload"): pytest.approx(4.0),
    }
    printed = capsys.readouterr().out
    # ratios only against the systems that ran: no fsdp2 or reference here
    assert "(tokens/s): ours/zero3-offload 2.00x, ours:auto/zero3-offload 4.00x" in printed
    assert "/fsdp2" not in printed
    assert "/reference" not in printed
    assert "summary: ours:auto/zero3-offload: geometric mean 4.00x over batches 2, 4" in printed
    (figure,) = figures
    legend = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert legend == ["ours:auto", "ours", "zero3-offload (ours 2.00x, ours:auto 4.00x)"]
    # a report of a variant alone: no row of ours, so no ratio of ours
    alone = [r for r in report["runs"] if r["system"] != "ours"]
    assert {k for row in ratios(alone) for k in row} == {"batch", "ours:auto_over_zero3-offload"}


def _a_variant_of_ours_ran_in_its_own_worker(tmp: Path) -> None:
    """ours and ours:n (every layer N: nothing recomputed) in their own workers, each given its
    layout and traced into its own file; on CPU the two layouts train bit for bit alike."""
    ours, n, _ = json.loads((tmp / "report.json").read_text())["runs"]
    assert (ours["system"], n["system"]) == ("ours", "ours:n")
    assert (ours["layout"], n["layout"]) == ("2xF-r0", "2xN-r0")
    assert n["losses"] == ours["losses"]
    assert (tmp / "trace.json").exists()
    assert (tmp / "trace-n.json").exists()


def test_a_model_directory_with_weights_is_where_ours_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--shape`` naming a directory with safetensors (the time to the first step of a real
    model): every run carries it, ours reads its model from there, the report names it; a
    config alone, or a named shape, is a seeded init; a cut or a changed model is refused (the
    weights would not match it)."""
    model = tmp_path / "m"
    model.mkdir()
    save_file({"w": torch.zeros(1)}, str(model / "model.safetensors"))
    specs, _, out = fake_sweep(monkeypatch, tmp_path, {"ours": 1.0}, "--systems", "ours")
    assert {s.weights_dir for s in specs} == {str(model)}
    assert json.loads(out.read_text())["weights_dir"] == str(model)
    raw = ours_raw_config(specs[0], tmp_path / "tokens.jsonl", tmp_path / "out")
    assert raw["model"]["path"] == str(model)
    assert shape_weights(str(model / "config.json"), 0, {}) == str(model)
    assert shape_weights(str(write_tiny_config(tmp_path / "alone")), 0, {}) == ""
    other = model / "other.json"  # a config of its own beside the weights: not theirs
    other.write_text((model / "config.json").read_text())
    assert shape_weights(str(other), 0, {}) == ""
    assert shape_weights("qwen3-4b", 0, {}) == ""
    with pytest.raises(ConfigError, match="and --layers changes that model"):
        shape_weights(str(model), 1, {})
    with pytest.raises(ConfigError, match=r"and --set model\.max_position_embeddings changes"):
        shape_weights(str(model), 0, {"max_position_embeddings": 64})
