"""A launched run of several ranks checks its resume point once: the launcher decides (checksums
verified, a damaged newest checkpoint skipped with one warning) and its ranks load that decision
without reading the checkpoint's files again; the resumed run continues bit for bit."""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.tiny import make_model, read_metrics, write_config, write_data
from multirank.ranks import run_ranks

# Imported at every interpreter's start (PYTHONPATH): each CRC-32 pass over a file, in every
# process (the launcher, and the ranks forked from its copy), appends "PID PATH" to a log.
COUNTING_SITECUSTOMIZE = """
import os
import slidedp.io.manifest as manifest

_crc32 = manifest.crc32


def _counted(path):
    with open(os.environ["CRC_LOG"], "a") as log:
        log.write(f"{os.getpid()} {path}\\n")
    return _crc32(path)


manifest.crc32 = _counted
"""


def _config(tmp_path: Path, out: Path) -> Path:
    model = make_model(tmp_path, "qwen3", tied=False, layers=2)
    data = write_data(tmp_path / "data.jsonl", 30)
    train = {"max_steps": 4, "global_batch_size": 4, "lr_scheduler": "constant",
             "verify_checksums": True}  # fmt: skip
    return write_config(tmp_path / f"{out.name}.yaml", model, data, out, train=train,
                        runtime={"ranks": 2, "version_timeout_s": 300},
                        output={"tensorboard": False, "save_steps": 2})  # fmt: skip


@pytest.mark.e2e
def test_the_launcher_checks_the_checkpoint_once_and_its_ranks_load_its_decision(
    tmp_path: Path,
) -> None:
    straight = tmp_path / "straight"
    assert run_ranks(_config(tmp_path, straight), 2) == [0, 0]
    out = tmp_path / "resumed"
    for step in (2, 4):
        shutil.copytree(straight / f"checkpoint-{step}", out / f"checkpoint-{step}")
    with (out / "checkpoint-4" / "model.safetensors").open("r+b") as f:
        f.truncate(100)  # the newest is damaged: auto falls back to checkpoint-2
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(COUNTING_SITECUSTOMIZE)
    crc_log = tmp_path / "crc.log"
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
        "CRC_LOG": str(crc_log),
    }
    done = subprocess.run(
        [sys.executable, "-m", "slidedp", "train", str(_config(tmp_path, out)),
         "train.resume=auto"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "warning: damaged" in line]
    assert len(warnings) == 1, done.stderr  # said once, by rank 0
    assert "checkpoint-4 (model.safetensors has 100 bytes" in warnings[0]

    # one checksum pass over the resumed checkpoint, in one process (was: the launcher's, then
    # each rank's again)
    passes = [line.split(" ", 1) for line in crc_log.read_text().splitlines()]
    resumed = out / "checkpoint-2"
    counted = collections.Counter(Path(p).relative_to(resumed).as_posix() for _, p in passes
                                  if Path(p).is_relative_to(resumed))  # fmt: skip
    manifest = json.loads((resumed / "manifest.json").read_text())["files"]
    assert counted == {name: 1 for name in manifest}
    assert len({pid for pid, p in passes if Path(p).is_relative_to(resumed)}) == 1

    # the launcher's decision carried the damaged checkpoint to set aside, and the run goes on
    # as the uninterrupted one (same ranks: the same sums, bit for bit)
    assert (out / "checkpoint-4.damaged").is_dir()
    steps = [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(out)]
    assert steps == [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(straight)][2:]
