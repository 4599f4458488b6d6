"""``train.freeze`` around the run: the store without moments for frozen parameters, the shared
preflight's refusals, resume (bit-identical; another freeze set refused) and the estimate."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from engine.tiny import make_model, write_config, write_data
from slidedp.cli import main
from slidedp.config import load_config
from slidedp.errors import UnknownParameterError
from slidedp.runtime.trainer import Trainer
from slidedp.store import GroupSpec, HostStore, ParamSpec


def test_a_frozen_parameter_has_master_weights_and_no_moments() -> None:
    groups = [
        GroupSpec("embed", [ParamSpec("e", (10, 8), frozen=True)]),
        GroupSpec("layer", [ParamSpec("w", (4, 8), frozen=True), ParamSpec("n", (8,))]),
    ]
    store = HostStore.create(groups, staging_slots=1, grad_dtype="f32", grad_slots=1)
    unfrozen = HostStore.plan([GroupSpec(g.name, [ParamSpec(p.name, p.shape) for p in g.params])
                               for g in groups], 1, "f32", 1)  # fmt: skip
    layout = store.layout
    assert layout.moment_len == 16  # "n" alone, one cache line of f32
    assert layout.state_len == unfrozen.state_len
    assert unfrozen.moment_len == unfrozen.state_len == 80 + 32 + 16
    assert store.region("exp_avg").numel() == store.region("exp_avg_sq").numel() == 16
    assert [p.name for p in layout.params] == ["e", "n", "w"]  # trained first in a group
    assert layout.groups[1].trained_len == 16
    store.param("n", "exp_avg").fill_(1.0)
    store.master("w").fill_(2.0)
    assert store.group_state(1, "exp_avg").sum().item() == 8.0
    assert store.frozen("w")
    assert not store.frozen("n")
    with pytest.raises(UnknownParameterError, match="'w' is frozen: it has no exp_avg"):
        store.param("w", "exp_avg")


def test_bad_freeze_patterns_are_refused_by_validate_and_train_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_model(tmp_path, "qwen3", tied=False, layers=2)
    data = write_data(tmp_path / "data.jsonl", 8)
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", model, data, out, train={"max_steps": 1})
    everything = "train.freeze=[embed_tokens,layers.0-1,norm,lm_head]"
    cases = [
        ("train.freeze=[embed_tokens,vision_tower]", "'vision_tower' matches no parameter"),
        ("train.freeze=[layers.1-2]", "'layers.1-2' is not a range of this model's layers 0-1"),
        ("train.freeze=[layers.1-0]", "'layers.1-0' is not a range"),
        (everything, "freezes every parameter of this model: nothing would train"),
    ]
    for (override, message), verb in itertools.product(cases, ("validate", "train")):
        capsys.readouterr()
        assert main([verb, str(config), override]) == 2, (verb, override)
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert message in err, err
        assert not out.exists()
    assert main(["validate", str(config), "train.freeze=[layers.1]"]) == 0


def _trainer(config: Path, *overrides: str) -> Trainer:
    return Trainer(load_config(config, list(overrides)), log=False)


@pytest.mark.e2e
def test_a_frozen_run_resumes_bit_identically_and_refuses_another_freeze(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True, layers=3)
    data = write_data(tmp_path / "data.jsonl", 16)
    train = {"max_steps": 4, "max_grad_norm": 0.05, "freeze": ["layers.0", "*.mlp.*"]}
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "full", train=train)
    full = _trainer(config, "output.save_steps=2")
    full_records = full.run()
    resumed = _trainer(config, f"output.dir={tmp_path / 'resumed'}",
                       f"train.resume={tmp_path / 'full/checkpoint-2'}")  # fmt: skip
    records = resumed.run()
    for key in ("loss", "grad_norm", "clip_coef"):
        assert [r[key] for r in records] == [r[key] for r in full_records[2:]], key
    for t in (full, resumed):
        t.engine.drain()
    for region in ("master", "exp_avg", "exp_avg_sq"):
        bits = [t.store.region(region).view(torch.int32) for t in (full, resumed)]
        assert torch.equal(*bits), region
    state = json.loads((tmp_path / "full/checkpoint-4/trainer_state.json").read_text())
    assert state["train"]["freeze"] == train["freeze"]

    for other in ("train.freeze=[layers.0]", "train.freeze=[]"):
        for verb in ("validate", "train"):
            capsys.readouterr()
            args = [verb, str(config), f"output.dir={tmp_path / 'full'}", "train.resume=auto",
                    "train.max_steps=6", other]  # fmt: skip
            assert main(args) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1, err
            assert "was trained with another train.freeze" in err, err
            assert "damaged" not in err, err  # every checkpoint is intact


def test_the_estimate_counts_the_smaller_store_and_says_by_how_much(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_model(tmp_path, "llama", tied=False, layers=2)
    data = write_data(tmp_path / "data.jsonl", 8)
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    assert main(["estimate", str(config), "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["estimate", str(config), "--json", "train.freeze=[embed_tokens]"]) == 0
    frozen = json.loads(capsys.readouterr().out)
    embed_bytes = 2 * 4 * 256 * 64  # no exp_avg, exp_avg_sq of the [V, H] embedding (f32)
    assert frozen["frozen_saved_bytes"] == embed_bytes
    assert plain["store_bytes"] - frozen["store_bytes"] == embed_bytes
    assert main(["estimate", str(config), "train.freeze=[embed_tokens]"]) == 0
    assert "train.freeze: 16,384 parameters without Adam moments" in capsys.readouterr().out
