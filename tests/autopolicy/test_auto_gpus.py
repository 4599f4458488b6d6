"""``runtime.policy: auto`` on 2 GPUs (NCCL): ``slidedp train runtime.gpus=2`` measures in a
child process (layer profile, host probe, the link probe over both GPUs), chooses the layout and
the routes once, and both ranks train the choice; ``slidedp bench train --routes
replicated/gpu,auto`` runs AutoPolicy beside the fixed default in one command.

Run on a 2-GPU machine: ``pytest -m multi_gpu tests/autopolicy/test_auto_gpus.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from bench.tiny import write_tiny_config
from engine.tiny import make_model, read_metrics, write_config, write_data
from slidedp.cli import main
from slidedp.plan.policy import resident_text
from slidedp.plan.predict import ROUTES

pytestmark = pytest.mark.e2e  # every test here trains end to end

STEPS = 4
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@pytest.mark.multi_gpu
@needs_two_gpus
def test_auto_on_two_gpus_trains_and_records_the_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = make_model(tmp_path, "qwen3", tied=True, layers=4)
    data = write_data(tmp_path / "data.jsonl", STEPS * 8, min_len=32, max_len=64)
    out = tmp_path / "run"
    train = {"max_steps": STEPS, "global_batch_size": 8, "dtype": "bfloat16",
             "max_grad_norm": 1.0}  # fmt: skip
    config = write_config(tmp_path / "auto.yaml", model, data, out, train=train,
                          runtime={"device": "cuda", "gpus": 2, "policy": "auto"},
                          output={"tensorboard": False})  # fmt: skip
    assert main(["train", str(config)]) == 0
    printed = capfd.readouterr().out
    (line,) = [x for x in printed.splitlines() if x.startswith("policy   auto: ")]
    print(line)
    assert "measured in a child process" in line
    assert "; routes " in line
    assert "(predicted " in line  # the links were measured: the model predicted each route
    rt = yaml.safe_load((out / "resolved_config.yaml").read_text())["runtime"]
    route = (rt["param_route"], rt["grad_route"])
    assert (rt["policy"], rt["gpus"]) == ("", 2)
    assert route in ROUTES
    # GPU-resident groups (each rank owns its groups' state) only on the gpu gradient route
    shown = resident_text(rt["resident_layers"], rt["resident_embeddings"])
    assert rt["grad_route"] == "gpu" or not (rt["resident_layers"] or rt["resident_embeddings"])
    assert line.startswith(f"policy   auto: {rt['layers']}, {shown}")
    assert f"; routes {route[0]}/{route[1]} (predicted " in line
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    policy = state["policy"]
    assert (policy["layers"], policy["param_route"], policy["grad_route"]) == (rt["layers"], *route)
    assert len(read_metrics(out)) == STEPS
    (links,) = (tmp_path / "cache").rglob("links-*.json")
    probe = json.loads(links.read_text())
    assert probe["gpus"] == 2
    assert probe["reduce_gbps"] > 0
    assert probe["gather_gbps"] > 0

    # a resumed run keeps what it ran with, measuring nothing
    for f in (tmp_path / "cache").rglob("*.json"):
        f.unlink()
    overrides = [f"train.max_steps={STEPS + 2}", "train.resume=auto"]
    assert main(["train", str(config), *overrides]) == 0
    printed = capfd.readouterr().out
    kept = f"{rt['layers']}, {shown}, routes {route[0]}/{route[1]} (kept from checkpoint-"
    assert f"policy   auto: {kept}" in printed
    assert not list((tmp_path / "cache").rglob("*.json"))


@pytest.mark.multi_gpu
@needs_two_gpus
def test_bench_runs_auto_beside_the_fixed_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = write_tiny_config(tmp_path / "m", hidden_size=256, intermediate_size=768, head_dim=64)
    out = tmp_path / "report.json"
    argv = ["bench", "train", "--shape", str(config), "--seq", "64", "--batch", "2",
            "--warmup", "1", "--steps", "2", "--device", "cuda", "--gpus", "2", "--systems",
            "ours", "--routes", "replicated/gpu,auto", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    runs = [(r["world"], r["route"], r["status"]) for r in report["runs"]]
    assert runs == [(1, None, "ok"), (2, "replicated/gpu", "ok"), (2, "auto", "ok")]
    auto = report["runs"][2]
    assert auto["policy"].startswith(f"policy   auto: {auto['layout']}, ")
    assert " GPU-resident" in auto["policy"]
    assert tuple(auto["chosen_route"].split("/")) in ROUTES
    table = [row["route"] for row in report["route_table"]]
    assert table == ["replicated/gpu", f"auto ({auto['chosen_route']})"]
