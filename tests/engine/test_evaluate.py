"""Evaluation (``runtime.evaluate``): the held-out loss against a plain PyTorch forward, the
held-out split, the best checkpoint, and 2 ranks against 1.

Tolerance of the parity (1e-6 relative): both sides run the same HF modules in float32 on the
same weights and batches; they differ only in the order of the loss's summation (chunks of
``loss_chunk_tokens`` per batch summed in float64 here vs one cross-entropy per batch there),
which moves a mean of ~7 by ~1e-7 relative. A wrong weight version (one step off at lr 1e-2),
a missed row or a wrong denominator moves it by >= 1e-3.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from engine.tiny import make_model, read_metrics, write_config, write_data
from multirank.ranks import run_ranks
from slidedp.cli import main
from slidedp.config import load_config
from slidedp.data.build import run_data
from slidedp.models.hf import HFAdapter
from slidedp.runtime.evaluate import Evaluator, eval_batches
from slidedp.runtime.trainer import Trainer

RTOL = 1e-6


def _config(tmp_path: Path, out: str = "out", **sections: Any) -> Path:
    model = make_model(tmp_path, "qwen3", tied=False, layers=3)
    data = write_data(tmp_path / "data.jsonl", 16)
    held = write_data(tmp_path / "held.jsonl", 7, seed=5)  # 7 rows: the last batch filled up
    keys = {
        "data": {"eval_path": str(held)},
        "train": {"max_steps": 3, "global_batch_size": 4, "learning_rate": 1e-2,
                  "eval_steps": 1},
        "output": {"tensorboard": False, "save_steps": 1},
    }  # fmt: skip
    for section, values in sections.items():
        keys[section] = keys.get(section, {}) | values
    return write_config(tmp_path / f"{out}.yaml", model, data, tmp_path / out, **keys)


def _plain_eval_loss(config: Path, checkpoint: Path) -> float:
    """The mean token loss of HF's own model (the checkpoint's weights) over the held-out set."""
    cfg = load_config(config)
    adapter = HFAdapter.from_dir(Path(cfg.model.path))
    _, held = run_data(cfg, adapter.config, adapter.vocab_size)
    assert held is not None
    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    model.train(False)  # no dropout
    total, labels = 0.0, 0
    with torch.no_grad():
        for batch, _ in eval_batches(held):
            logits = model(**batch.model_inputs()).logits[:, :-1].float()  # [B, S-1, V]
            targets = batch.labels[:, 1:]
            total += F.cross_entropy(logits.transpose(1, 2), targets, reduction="sum").item()
            labels += int((targets != -100).sum())
    return total / labels


@pytest.mark.e2e
def test_the_eval_loss_is_a_plain_forward_of_the_same_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path)
    assert main(["train", str(config)]) == 0
    records = read_metrics(tmp_path / "out")
    line = f"eval_loss {records[-1]['eval_loss']:.4f} ppl {records[-1]['eval_perplexity']:.2f}"
    assert line in capsys.readouterr().out.splitlines()[-3]  # the last step's line
    assert [r["step"] for r in records if "eval_loss" in r] == [1, 2, 3]
    for r in records:
        plain = _plain_eval_loss(config, tmp_path / "out" / f"checkpoint-{r['step']}")
        assert r["eval_loss"] == pytest.approx(plain, rel=RTOL), r["step"]
        assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]), rel=1e-12)
    assert len({r["eval_loss"] for r in records}) == 3  # the weights moved between them


def test_evaluation_saves_no_activation_and_updates_nothing(tmp_path: Path) -> None:
    trainer = Trainer(load_config(_config(tmp_path)), log=False)
    try:
        master = trainer.store.region("master").clone()
        for executor in trainer.engine.executors:  # what saves activations and runs backward
            executor.forward = executor.backward = _must_not_run  # type: ignore[method-assign,assignment]
        assert isinstance(trainer.evaluator, Evaluator)
        first, again = trainer.evaluator.run(0), trainer.evaluator.run(0)
        assert again["eval_loss"] == first["eval_loss"]
        assert torch.equal(trainer.store.region("master"), master)
    finally:
        trainer.engine.close()


def _must_not_run(*args: object, **kwargs: object) -> object:
    raise AssertionError("evaluation ran a training executor")


@pytest.mark.e2e
def test_the_best_checkpoint_is_kept_beside_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    losses = iter([3.0, 1.0, 2.0, 2.5, 0.5])

    def scripted(self: Evaluator, version: int) -> dict[str, float]:
        loss = next(losses)
        return {"eval_loss": loss, "eval_perplexity": math.exp(loss)}

    monkeypatch.setattr(Evaluator, "run", scripted)
    output = {"save_steps": 0, "save_total_limit": 1, "save_best": True}
    config = _config(tmp_path, train={"max_steps": 4}, output=output)
    assert main(["train", str(config)]) == 0
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert json.loads((out / "best").read_text()) == {
        "checkpoint": "checkpoint-2",
        "eval_loss": 1.0,
        "held_out": str((tmp_path / "held.jsonl").resolve()),
    }
    # resumed: the best so far is remembered; a better last evaluation is the last checkpoint,
    # the newest of save_total_limit=1: the best before it goes as any other
    resumed = _config(tmp_path, train={"max_steps": 5, "resume": "auto"}, output=output)
    assert main(["train", str(resumed)]) == 0
    assert json.loads((out / "best").read_text())["checkpoint"] == "checkpoint-5"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-5"]


@pytest.mark.e2e
def test_a_best_of_other_held_out_data_is_not_compared_after_a_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    losses = iter([1.0, 2.0, 3.0])

    def scripted(self: Evaluator, version: int) -> dict[str, float]:
        loss = next(losses)
        return {"eval_loss": loss, "eval_perplexity": math.exp(loss)}

    monkeypatch.setattr(Evaluator, "run", scripted)
    output, train = {"save_steps": 0, "save_best": True}, {"lr_scheduler": "constant"}
    first = _config(tmp_path, train={**train, "max_steps": 1}, output=output)
    assert main(["train", str(first)]) == 0
    other = write_data(tmp_path / "other.jsonl", 5, seed=9)
    resumed = _config(tmp_path, data={"eval_path": str(other)}, output=output,
                      train={**train, "max_steps": 3, "resume": "auto"})  # fmt: skip
    capsys.readouterr()
    for verb in ("validate", "train"):
        assert main([verb, str(resumed)]) == 0
        printed, err = capsys.readouterr()
        assert f"; held out: {other} (input_ids): 5 samples → 5 in " in printed  # both banners
        assert err.count("warning:") == 1, err
        assert (
            f"best names checkpoint-1 (eval loss 1 on {(tmp_path / 'held.jsonl').resolve()}); "
            f"this run evaluates {other.resolve()}: its losses are not compared with that one, "
            "the first becomes the best"
        ) in err
    best = json.loads((tmp_path / "out" / "best").read_text())
    assert (best["checkpoint"], best["eval_loss"]) == ("checkpoint-2", 2.0)  # not 1.0's


@pytest.mark.e2e
def test_two_ranks_give_the_one_rank_eval_loss(tmp_path: Path) -> None:
    one = _config(tmp_path, "one", train={"max_steps": 2}, output={"save_steps": 0})
    two = _config(tmp_path, "two", train={"max_steps": 2}, output={"save_steps": 0},
                  runtime={"ranks": 2})  # fmt: skip
    assert main(["train", str(one)]) == 0
    assert run_ranks(two, 2) == [0, 0]
    m1, m2 = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    # the two-rank run's weights differ from the one-rank run's by f32 rounding of the
    # gradient sums (tests/multirank/test_parity.py: 1e-5 relative on losses)
    for r1, r2 in zip(m1, m2, strict=True):
        assert r2["eval_tokens"] == r1["eval_tokens"]  # every label token, once
        assert r2["eval_loss"] == pytest.approx(r1["eval_loss"], rel=1e-5)
