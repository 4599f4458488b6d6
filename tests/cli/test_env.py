"""``slidedp env`` on a machine with several GPUs, faked: the link matrix and a missing or broken
``nvidia-smi`` (which must never hang or fail the command)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import slidedp.envinfo as envinfo
from cli.util import run

MATRIX = "\tGPU0\tGPU1\nGPU0\t X \tNV18\nGPU1\tNV18\t X "
TWO_GPUS = [
    {"index": i, "name": "NVIDIA H200", "memory_bytes": 150_000_000_000, "capability": "9.0"}
    for i in range(2)
]


def _fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.parent.mkdir()
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(exe.parent))


def _two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    versions: dict[str, Any] = {"cuda": "12.8", "driver": "570.1", "nccl": "2.26.2"}
    monkeypatch.setattr(envinfo, "_gpus", lambda: (TWO_GPUS, versions))


def test_several_gpus_show_the_link_matrix(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_nvidia_smi(tmp_path, monkeypatch, f"[ \"$1 $2\" = 'topo -m' ] && printf '{MATRIX}'")
    _two_gpus(monkeypatch)
    code, out, _ = run(capsys, "env")
    assert code == 0
    assert "GPUs: 2" in out
    assert "  [1] NVIDIA H200, 139.7 GiB, sm 9.0" in out
    assert "CUDA 12.8, driver 570.1, NCCL 2.26.2" in out
    assert out.endswith("GPU links (nvidia-smi topo -m):\n" + MATRIX.rstrip() + "\n")
    code, out, _ = run(capsys, "env", "--json")
    assert json.loads(out)["gpu_links"] == MATRIX.rstrip()  # the header's leading tab kept


@pytest.mark.parametrize("body", ["exit 1", "sleep 30", None], ids=["failing", "hanging", "absent"])
def test_a_missing_or_broken_nvidia_smi_is_tolerated(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    body: str | None,
) -> None:
    if body is None:
        monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    else:
        _fake_nvidia_smi(tmp_path, monkeypatch, body)
    monkeypatch.setattr(envinfo, "_NVIDIA_SMI_TIMEOUT_S", 0.5)
    _two_gpus(monkeypatch)
    code, out, _ = run(capsys, "env", "--json")
    assert code == 0
    assert json.loads(out)["gpu_links"] is None
    assert "GPU links" not in run(capsys, "env")[1]
