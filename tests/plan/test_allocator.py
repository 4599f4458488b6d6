"""The CUDA caching allocator's settings our engine runs with (``plan.device``): expandable
segments unless the user set them, for our runs only (the bench's peers keep the user's)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.tiny import tiny_spec
from slidedp.bench import worker
from slidedp.cli import main
from slidedp.plan.device import ALLOCATOR_DEFAULT, ALLOCATOR_VARIABLES, prefer_expandable_segments

VARIABLE = ALLOCATOR_VARIABLES[0]


@pytest.fixture
def no_settings(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_expandable_segments_are_the_default(no_settings: pytest.MonkeyPatch) -> None:
    prefer_expandable_segments()
    assert os.environ[VARIABLE] == ALLOCATOR_DEFAULT


@pytest.mark.parametrize("name", ALLOCATOR_VARIABLES)
def test_the_users_settings_are_kept(no_settings: pytest.MonkeyPatch, name: str) -> None:
    no_settings.setenv(name, "max_split_size_mb:512")
    prefer_expandable_segments()
    assert os.environ[name] == "max_split_size_mb:512"
    assert all(os.environ.get(v) in (None, "max_split_size_mb:512") for v in ALLOCATOR_VARIABLES)


def test_our_commands_set_them_and_the_bench_leaves_them_to_its_workers(
    no_settings: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = str(tmp_path / "missing.json")  # an error, after the settings' choice
    assert main(["bench", "plot", "--png", str(tmp_path / "p.png"), missing]) != 0
    assert VARIABLE not in os.environ
    assert main(["env", "--json"]) == 0
    capsys.readouterr()
    assert os.environ[VARIABLE] == ALLOCATOR_DEFAULT


@pytest.mark.parametrize(
    ("system", "expected"),
    [("reference", None), pytest.param("ours", ALLOCATOR_DEFAULT, marks=pytest.mark.e2e)],
)  # ours trains its steps
def test_a_bench_worker_sets_them_for_ours_only(
    no_settings: pytest.MonkeyPatch, tmp_path: Path, system: str, expected: str | None
) -> None:
    spec = tiny_spec(tmp_path / "m", system)
    spec_path, result_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(json.dumps(spec.to_json()))
    assert worker.main([str(spec_path), str(result_path)]) == 0
    assert json.loads(result_path.read_text())["status"] == "ok"
    assert os.environ.get(VARIABLE) == expected
