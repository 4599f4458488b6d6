"""The launcher's watch loop, with fake rank processes (no real ranks started)."""

from __future__ import annotations

from typing import Any

import pytest

from slidedp.runtime import launch as launch_module
from slidedp.runtime.dist import EXIT_PEER_FAILED


class _Proc:
    """A rank that runs for ``polls`` polls, then has exited with ``code``."""

    def __init__(self, code: int, polls: int) -> None:
        self.code, self.polls = code, polls

    def poll(self) -> int | None:
        self.polls -= 1
        return None if self.polls >= 0 else self.code

    def kill(self) -> None:
        self.polls = -1

    def wait(self) -> int:
        return self.code


def test_ranks_that_exit_between_two_polls_are_still_reported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both ranks exit in the same polling interval (the failing one and its peer): the
    failure is reported, never taken for success."""
    procs = iter([_Proc(EXIT_PEER_FAILED, 1), _Proc(1, 1)])

    def popen(*args: Any, **kwargs: Any) -> _Proc:
        return next(procs)

    monkeypatch.setattr("slidedp.runtime.launch.subprocess.Popen", popen)
    monkeypatch.setattr("slidedp.runtime.launch.time.sleep", lambda s: None)
    assert launch_module.launch(2, ["train", "x.yaml"]) == 1
    assert "rank 1 exited with 1; stopped ranks [0]" in capsys.readouterr().err
