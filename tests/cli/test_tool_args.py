"""The tool verbs' options (``profile``, ``plan``, ``bench``): a bad number is argparse's usage
error (exit 2, no traceback), an output path that cannot be written is refused before anything
is measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.util import one_error_line, run, tiny_run_config
from engine.tiny import make_model
from slidedp.cli import main

Capsys = pytest.CaptureFixture[str]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["profile", "layer", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["profile", "layer", "--batch", "-1"], "argument --batch: must be at least 1, got -1"),
        (["profile", "layer", "--seq-len", "x"], "argument --seq-len: must be an integer, got 'x'"),
        (["profile", "layer", "--ratios", "abc"], "argument --ratios: must be ratios in [0, 1]"),
        (["profile", "layer", "--top", "-1"], "argument --top: must be at least 1"),
        (
            ["profile", "layer", "--kernels", "eager,bogus"],
            "--kernels: unknown 'bogus' (known: eager",
        ),
        (["profile", "host", "--ranks", "0"], "argument --ranks: must be at least 1, got 0"),
        (["plan", "c.yaml", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["plan", "c.yaml", "--ratios", "2"], "argument --ratios: must be ratios in [0, 1]"),
    ],
)
def test_a_bad_number_is_a_usage_error(capsys: Capsys, argv: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert needle in err.splitlines()[-1]


def test_profile_layer_refuses_before_measuring(capsys: Capsys, tmp_path: Path) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    shape = ["profile", "layer", "--shape", str(model / "config.json"), "--device", "cpu"]
    (tmp_path / "file").write_text("")
    cases = [
        (["--seq-len", "100000"], "--seq-len 100000 exceeds the model's max_position_embeddings"),
        (["--json", str(tmp_path / "file" / "r.json")], "r.json: cannot write a file there"),
    ]
    for extra, needle in cases:
        code, _, err = run(capsys, *shape, *extra)
        assert code == 2, err
        one_error_line(err, "profile", needle)


def test_bench_train_refuses_an_unwritable_report_before_any_run(
    capsys: Capsys, tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("")
    code, out, err = run(capsys, "bench", "train", "--device", "cpu", "--shape", "qwen3-1.7b",
                         "--layers", "1", "--json", str(tmp_path / "file" / "r.json"),
                         "--debug")  # fmt: skip
    assert code == 2, err
    assert "r.json: cannot write a file there" in err
    assert "ok in" not in out + err  # no run was made


def test_plan_still_refuses_an_unwritable_out(capsys: Capsys, tmp_path: Path) -> None:
    config = tiny_run_config(tmp_path)
    (tmp_path / "file").write_text("")
    out = str(tmp_path / "file" / "p.json")  # checked before anything is measured
    code, _, err = run(capsys, "plan", str(config), "--gpu-memory", "80", "--out", out)
    assert code == 2, err
    one_error_line(err, "plan", "cannot write a file there")
