"""``slidedp estimate`` agrees with ``validate`` on whether a run can start: what validate
refuses before the memory (the ranks' batch split, the sequence against the model) it refuses
with the same line, and a run the machine cannot hold exits 2 with validate's fixes, after the
table or the JSON; a reader that closes stdout early gets no complaint."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from cli.util import one_error_line, run, tiny_run_config
from slidedp.cli_args import quiet_closed_stdout
from slidedp.plan.machine import Machine

Capsys = pytest.CaptureFixture[str]
CPU = ("runtime.device=cpu",)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (("runtime.ranks=2", "train.global_batch_size=3"),
         "train.global_batch_size=3 is not divisible by the 2 ranks"),
        (("data.seq_len=160",), "data.seq_len=160 exceeds the model's max_position_embeddings"),
    ],
)  # fmt: skip
def test_estimate_refuses_what_validate_refuses(
    capsys: Capsys, tmp_path: Path, overrides: tuple[str, ...], needle: str
) -> None:
    config = str(tiny_run_config(tmp_path))
    lines = []
    for verb in ("validate", "estimate"):
        code, out, err = run(capsys, verb, config, *CPU, *overrides)
        assert code == 2, (verb, out, err)
        lines.append(one_error_line(err, verb, needle).partition(": error: ")[2])
        assert "fits this machine" not in out
    assert lines[0] == lines[1]  # the same check, the same words


def test_a_run_that_does_not_fit_exits_2_with_validates_fixes(
    capsys: Capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = str(tiny_run_config(tmp_path))
    probe = Machine.probe

    def small(*args: object, **kwargs: object) -> Machine:
        return replace(probe(*args, **kwargs), shm_free_bytes=1)  # type: ignore[arg-type]

    monkeypatch.setattr(Machine, "probe", small)
    fixes = "enlarge it (e.g. `mount -o remount,size=... /dev/shm`), free memory, or train a"
    code, _, validated = run(capsys, "validate", config, *CPU)
    assert code == 2
    code, out, err = run(capsys, "estimate", config, *CPU)
    assert code == 2
    assert "DOES NOT FIT: /dev/shm" in out  # the table first
    line = one_error_line(err, "estimate", "/dev/shm", fixes)
    assert line.partition(": error: ")[2].split("; ")[-1] == validated.split("; ")[-1].strip()
    code, out, err = run(capsys, "estimate", config, *CPU, "--json")
    assert code == 2
    assert json.loads(out)["fits"] is False  # the whole JSON, then the exit code
    one_error_line(err, "estimate", fixes)


def test_the_estimate_on_cpu_counts_no_gpu_and_refuses_gpus(capsys: Capsys, tmp_path: Path) -> None:
    config = str(tiny_run_config(tmp_path))
    code, out, _ = run(capsys, "estimate", config, *CPU, "runtime.ranks=2", "--json")
    assert code == 0
    report = json.loads(out)
    assert (report["world"], report["machine"]["gpu_count"]) == (2, 0)
    code, _, err = run(capsys, "estimate", config, "runtime.device=auto", "--gpus", "4")
    if report["machine"]["device"] == "cpu":  # a machine without CUDA
        assert code == 2
        one_error_line(err, "estimate", "--gpus 4", "runtime.ranks=4 runtime.device=cpu")


def test_a_closed_stdout_ends_the_printing_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone (`| head` after its lines)
    stream = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", stream)
    with quiet_closed_stdout():
        for _ in range(1000):
            print("x" * 1000)
    print("after")  # /dev/null now: no BrokenPipeError, at exit neither
    stream.close()


def test_estimate_of_a_run_of_several_nodes_needs_no_route_to_node_0(
    capsys: Capsys, tmp_path: Path
) -> None:
    """A prediction for a cluster made on a workstation: node 0's name need not resolve here
    (validate, run on the node, checks it)."""
    config = str(tiny_run_config(tmp_path))
    nodes = ("runtime.nodes=2", "runtime.master_addr=gpu-node-0.cluster.invalid")
    code, out, err = run(capsys, "estimate", config, *CPU, *nodes)
    assert code == 0, err
    assert "fits this machine" in out
    code, _, err = run(capsys, "validate", config, *CPU, *nodes)
    assert code == 2
    one_error_line(err, "validate", "runtime.master_addr 'gpu-node-0.cluster.invalid' does not")
