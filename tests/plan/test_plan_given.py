"""A plan given to ``slidedp train --plan``: every value it decides becomes the config key that
decides it (what runs is what ``resolved_config.yaml`` records), a config key set otherwise is
refused in one line, and a hand-edited plan is checked by the config's schema, each problem one
line naming the file, before anything is written (``plan.given``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from cli.util import one_error_line, run, snapshot
from plan.test_plan_json import _run
from slidedp.config import RESOLVED_CONFIG, load_config
from slidedp.models.hf import HFAdapter
from slidedp.plan.given import take_plan
from slidedp.plan.machine import Machine
from slidedp.plan.policy import PLAN_FILE, write_plan
from slidedp.plan.resolve import resolve_plan


def _plan(tmp_path: Path, path: Path, *overrides: str) -> Path:
    """The plan of ``path``'s config with ``overrides`` on this machine, in tmp_path/given/."""
    cfg = load_config(path, list(overrides))
    plan = resolve_plan(cfg, HFAdapter.from_dir(cfg.model.path), Machine.probe(cfg, measure=False))
    (tmp_path / "given").mkdir(exist_ok=True)
    return write_plan(plan, tmp_path / "given")


MADE = ("train.adam_beta1=0.8", "train.weight_decay=0.1", "runtime.update_threads=1",
        "runtime.loss_chunk_tokens=16", "runtime.layers=2xN, F")  # fmt: skip


def test_take_plan_writes_every_value_it_decides_into_the_config(tmp_path: Path) -> None:
    path = _run(tmp_path)
    given = _plan(tmp_path, path, *MADE)
    cfg, plan = take_plan(load_config(path, []), given)
    assert (cfg.train.adam_beta1, cfg.train.weight_decay) == (0.8, 0.1)
    layout = cfg.runtime.layout
    assert (layout.update_threads, layout.loss_chunk_tokens, layout.layers) == (
        1, 16, "2xN-r0, 1xF-r0")  # fmt: skip
    assert (cfg.train.dtype, cfg.runtime.launch.device, layout.kernels) == (
        "float32",
        "cpu",
        "eager",
    )
    # the config resolves to the plan itself (but why auto chose eager: it was told to)
    machine = Machine.probe(cfg, measure=False)
    ran = resolve_plan(cfg, HFAdapter.from_dir(cfg.model.path), machine)
    assert _decided(ran.to_json()) == _decided(plan.to_json())


@pytest.mark.e2e
def test_the_run_trains_and_records_the_plans_optimizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _run(tmp_path)
    given = _plan(tmp_path, path, *MADE)
    code, _, err = run(capsys, "train", str(path), "--plan", str(given))
    assert code == 0, err
    out = tmp_path / "out"
    recorded = yaml.safe_load((out / RESOLVED_CONFIG).read_text())
    assert (recorded["train"]["adam_beta1"], recorded["train"]["weight_decay"]) == (0.8, 0.1)
    assert recorded["runtime"]["loss_chunk_tokens"] == 16
    ran = json.loads((out / PLAN_FILE).read_text())
    assert _decided(ran) == _decided(json.loads(given.read_text()))


def _decided(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan but why ``kernels: auto`` chose its kernels (a plan's run is told them)."""
    plan["policy"]["compute"].pop("reason")
    return plan


@pytest.mark.parametrize(
    ("keys", "needles"),
    [
        (["train.adam_beta1=0.5", "train.weight_decay=0.5"],
         ["train.adam_beta1=0.5 but", "runs 0.9", "train.weight_decay=0.5 but", "runs 0.0"]),
        (["runtime.update_threads=2"], ["runtime.update_threads=2 but", "runs 1"]),
        (["runtime.loss_chunk_tokens=8"], ["runtime.loss_chunk_tokens=8 but", "runs 1024"]),
        (["train.dtype=bfloat16"], ["train.dtype=bfloat16 but", "runs float32"]),
        (["runtime.layers=N"], ["runtime.layers=N (offload_ratio 0.0) but", "runs 3xF-r0"]),
    ],
)  # fmt: skip
def test_a_config_key_set_otherwise_than_the_plan_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keys: list[str], needles: list[str]
) -> None:
    path = _run(tmp_path)
    given = _plan(tmp_path, path, "runtime.update_threads=1")
    before = snapshot(tmp_path / "out", itself=True)
    code, _, err = run(capsys, "train", str(path), *keys, "--plan", str(given))
    assert code == 2
    one_error_line(err, "train", *needles, "keep each key in one place", str(given))
    assert snapshot(tmp_path / "out", itself=True) == before == {}


def test_a_config_that_says_what_the_plan_says_runs_it(tmp_path: Path) -> None:
    path = _run(tmp_path, layers="2xN, F")  # the same layout, written otherwise
    given = _plan(tmp_path, path, "train.adam_beta1=0.8")
    cfg, _ = take_plan(load_config(path, ["train.adam_beta1=0.8"]), given)
    assert cfg.runtime.layout.layers == "2xN-r0, 1xF-r0"


def _set(*where: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(plan: dict[str, Any]) -> None:
        part = plan
        for key in where[:-1]:
            part = part[key]
        part[where[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "needles"),
    [
        (_set("policy", "param_route", value="bogus"), ["runtime.param_route must be one of"]),
        (_set("threads", value=-3), ["runtime.update_threads must be >= 0"]),
        (_set("threads", value="four"), ["runtime.update_threads must be an integer"]),
        (_set("device", value="tpu"), ["runtime.device must be one of"]),
        (_set("loss_chunk_tokens", value=0), ["runtime.loss_chunk_tokens must be >= 1"]),
        (_set("optim", "eps", value=-1), ["train.adam_epsilon must be > 0"]),
        (_set("version_timeout_s", value=-1), ["runtime.version_timeout_s must be > 0"]),
        (_set("dtype", value="int8"), ["train.dtype must be one of"]),
        (_set("foo", value=1), ["'plan' has unknown keys ['foo']"]),
        (_set("policy", "foo", value=1), ["'policy' has unknown keys ['foo']"]),
        (_set("optim", "betas", value=[0.9]), ["optim.betas must be [beta1, beta2]"]),
        (_set("policy", "layers", value="F"), ["policy.layers must count every layer"]),
        (_set("policy", "layers", value="2xF-r0"), ["was made for another model", "this model 3"]),
        (_set("policy", "resident_layers", value=9), ["policy.resident_layers=9"]),
        (_set("policy", "compute", "kernels", value="liger"), ["runs Liger kernels on cpu"]),
    ],
)  # fmt: skip
def test_a_hand_edited_plan_is_one_line_naming_it_before_anything_is_written(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edit: Callable[[dict[str, Any]], None],
    needles: list[str],
) -> None:
    path = _run(tmp_path)
    given = _plan(tmp_path, path)
    plan = json.loads(given.read_text())
    edit(plan)
    given.write_text(json.dumps(plan))
    code, _, err = run(capsys, "train", str(path), "--plan", str(given))
    assert code == 2
    one_error_line(err, "train", str(given), *needles)
    assert snapshot(tmp_path / "out", itself=True) == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU host: the plan's GPU is missing")
def test_a_plan_for_a_gpu_is_refused_on_a_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _run(tmp_path)  # its runtime.device: cpu
    given = _plan(tmp_path, path)
    plan = json.loads(given.read_text())
    plan |= {"device": "cuda", "dtype": "bfloat16"}
    given.write_text(json.dumps(plan))
    code, _, err = run(capsys, "train", str(path), "runtime.device=auto", "--plan", str(given))
    assert code == 2
    one_error_line(err, "train", f"{given} runs on cuda", "this machine has none")
    code, _, err = run(capsys, "train", str(path), "--plan", str(given))
    one_error_line(err, "train", "runtime.device=cpu but", "runs cuda")
    assert snapshot(tmp_path / "out", itself=True) == {}


def test_a_policy_files_values_are_checked_as_the_configs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, policy = _run(tmp_path), tmp_path / "policy.yaml"
    policy.write_text("param_route: bogus\n")
    code, _, err = run(capsys, "validate", str(path), f"runtime.policy={policy}")
    assert code == 2
    one_error_line(err, "validate", f"runtime.policy {policy}: runtime.param_route must be one of")
