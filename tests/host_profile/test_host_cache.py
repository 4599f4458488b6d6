"""The host probe's cache: one that cannot be written (``XDG_CACHE_HOME`` a file) is one
warning line, the probe's report returned all the same."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slidedp.profile import host


def test_a_cache_that_cannot_be_written_is_one_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cpu = torch.device("cpu")
    report = host.probe_host(1, cpu, state_bytes=1 << 20, budget_s=0.01, cache_dir=str(blocker))
    assert report["state_bytes"] == 1 << 20
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("slidedp: warning: not cached:"), err
