"""The measurement child of ``runtime.policy: auto`` (``autopolicy.measure``): a crash reaches the
launcher as the exception itself, its traceback before it."""

from __future__ import annotations

from pathlib import Path

import pytest

from slidedp.autopolicy import measure
from slidedp.errors import exception_line

# the shape of torch's compiler errors: the cause in the first paragraph, advice after it
COMPILER_ERROR = (
    "backend='inductor' raised:\nRuntimeError: AOT Autograd failed to partition the joint "
    "forward-backward graph.\n\nThe partitioner determines which intermediate values ...\n\n"
    "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace"
)


def test_an_exception_line_is_its_type_and_its_first_paragraph() -> None:
    assert exception_line(RuntimeError(COMPILER_ERROR)) == (
        "RuntimeError: backend='inductor' raised: RuntimeError: AOT Autograd failed to "
        "partition the joint forward-backward graph."
    )
    assert exception_line(KeyError("x")) == "KeyError: 'x'"


def test_a_crash_in_the_child_ends_its_stderr_with_the_exception_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def crash(_cfg: object) -> None:
        raise RuntimeError(COMPILER_ERROR)

    monkeypatch.setattr(measure, "load_config", lambda _path: None)
    monkeypatch.setattr(measure, "measure", crash)
    assert measure.main([str(tmp_path / "config.yaml")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    # the line measure_in_child puts in its ConfigError (the 2xH200 run said "Set
    # TORCHDYNAMO_VERBOSE=1 ..." instead)
    assert lines[-1] == exception_line(RuntimeError(COMPILER_ERROR))
