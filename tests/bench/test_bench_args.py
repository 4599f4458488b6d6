"""The bench verbs' arguments: a bad number is argparse's usage line (exit 2), a bad input one
error line (exit 2), an output file's folder is made before anything is measured, and every
bench JSON says where it was measured (``bench.provenance``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.tiny import write_tiny_config
from cli.util import one_error_line, run
from slidedp.bench.predict import regime_on
from slidedp.bench.provenance import with_provenance
from slidedp.cli import main
from slidedp.cli_args import writable
from slidedp.errors import ConfigError

Capsys = pytest.CaptureFixture[str]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["kernels", "--threads", "x"], "argument --threads: must be comma-separated integers"),
        (["kernels", "--threads", "1,0"], "argument --threads: must be comma-separated integers"),
        (["kernels", "--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
        (["kernels", "--numel", "0"], "argument --numel: must be at least 1, got 0"),
        (["nodes", "--link-gbit", "0"], "argument --link-gbit: must be a number above 0, got 0"),
        (["nodes", "--gpus-per-node", "0"], "argument --gpus-per-node: must be at least 1"),
        (["predict", "r.json", "--probes", "d", "--host-gbps", "0"],
         "argument --host-gbps: must be a number above 0, got 0"),
        (["model", "t.json", "--slots", "0"], "argument --slots: must be at least 1, got 0"),
    ],
)  # fmt: skip
def test_a_bad_number_is_a_usage_error(capsys: Capsys, argv: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert needle in err.splitlines()[-1]


def test_an_output_file_gets_its_folder_and_a_file_in_the_way_is_refused(tmp_path: Path) -> None:
    writable("--json", str(tmp_path / "new" / "deeper" / "r.json"))
    assert (tmp_path / "new" / "deeper").is_dir()  # made now: the write after the run works
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"r\.json: cannot write a file there \(.*file is a f"):
        writable("--json", str(tmp_path / "file" / "sub" / "r.json"))
    with pytest.raises(ConfigError, match="cannot write a file there"):
        writable("--json", str(tmp_path))  # a folder


@pytest.mark.parametrize(
    "verb",
    [["kernels", "--numel", "8"], ["nodes", "--predict", "qwen3-1.7b"], ["model", "t.json"],
     ["predict", "r.json", "--probes", "."]],
)  # fmt: skip
def test_every_writing_verb_refuses_its_json_before_measuring(
    capsys: Capsys, tmp_path: Path, verb: list[str]
) -> None:
    (tmp_path / "file").write_text("")
    code, out, err = run(capsys, "bench", *verb, "--json", str(tmp_path / "file" / "r.json"))
    assert code == 2, err
    one_error_line(err, "bench", "r.json: cannot write a file there")
    assert out == ""  # nothing measured or printed


def test_plot_refuses_its_png_before_reading(capsys: Capsys, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "file").write_text("")
    code, _, err = run(capsys, "bench", "plot", "missing.json", "--png",
                       str(tmp_path / "file" / "x.png"))  # fmt: skip
    assert code == 2
    one_error_line(err, "bench plot", "x.png: cannot write a file there")


def test_not_a_trace_and_not_a_probe_are_one_line(capsys: Capsys, tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text('{"a": 1}')
    code, _, err = run(capsys, "bench", "model", str(tmp_path / "t.json"))
    assert code == 2
    one_error_line(err, "bench", "t.json: not a trace (no traceEvents list)")
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"shape": "qwen3-1.7b", "model": {"layers": 28}, "runs": []}))
    probes = tmp_path / "probes"
    probes.mkdir()
    (probes / "kernels.json").write_text("[1, 2]")  # an older `bench kernels --json`: a list
    code, _, err = run(capsys, "bench", "predict", str(report), "--probes", str(probes))
    assert code == 2
    one_error_line(err, "bench", "kernels.json in --probes is not a probe")


def test_bench_train_refuses_before_any_run(capsys: Capsys, tmp_path: Path) -> None:
    shape = str(write_tiny_config(tmp_path / "m"))
    base = ["bench", "train", "--shape", shape, "--device", "cpu", "--seq", "16"]
    for extra, needle in [
        (["--seq", "100000"], "--seq 100000 exceeds the model's max_position_embeddings="),
        (["--seq", "100000"], "--set model.max_position_embeddings=N"),
        (["--gpu-limit", "10"], "--gpu-limit caps GPU memory, and this bench runs on the CPU"),
        (["--systems", "ours", "--peer-set", "zero3-offload.x=1"],
         "zero3-offload is not in --systems 'ours'"),
    ]:  # fmt: skip
        code, out, err = run(capsys, *base, *extra)
        assert code == 2, err
        one_error_line(err, "bench train", needle)
        assert " ..." not in out + err  # no system started


def test_a_report_carries_its_provenance() -> None:
    rows = with_provenance([{"threads": 1}])
    assert rows["rows"] == [{"threads": 1}]
    report = with_provenance({"runs": []})
    for made in (rows, report):
        p = made["provenance"]
        assert set(p) == {"argv", "date_utc", "versions", "host"}
        assert set(p["versions"]) >= {"slidedp", "torch", "transformers", "deepspeed"}
        assert set(p["host"]) >= {"cpu_model", "cores", "gpus"}
        assert p["date_utc"].endswith("+00:00")


def test_the_regime_on_cpu_names_the_compute_not_a_gpu() -> None:
    regime = "GPU-bound (compute 91% of the step)"
    assert regime_on(regime, "cuda") == regime
    assert regime_on(regime, "cpu") == "compute-bound (compute 91% of the step)"
    assert regime_on("H2d-bound: compute waits 3 ms for it", None).startswith("H2d-bound")


@pytest.mark.e2e
def test_kernels_json_is_its_rows_and_provenance(capsys: Capsys, tmp_path: Path) -> None:
    out = tmp_path / "new" / "k.json"
    argv = ["--numel", "64", "--threads", "1", "--repeats", "1", "--json", str(out)]
    assert main(["bench", "kernels", *argv]) == 0
    report = json.loads(out.read_text())
    assert [r["threads"] for r in report["rows"]] == [1]
    assert report["provenance"]["host"]["cores"] >= 1
