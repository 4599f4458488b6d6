"""The demo's before/after evaluation (``examples/demo/sample.py``) on a tiny random Llama with
a word-level tokenizer built in memory: greedy sampling, the held-out loss with padding, the
closing report."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from demo.examples import load_demo_script
from slidedp.errors import DataError

sample = load_demo_script("sample")

WORDS = ["<pad>", "<unk>", "KING:", "MESSENGER:", "my", "lord", "the", "news", "speak", "thou"]


def tiny_tokenizer() -> Any:
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>"
    )


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def test_greedy_sample_is_the_argmax_continuation() -> None:
    model, tokenizer = tiny_model(), tiny_tokenizer()
    ids = tokenizer("KING: speak thou", return_tensors="pt")["input_ids"]
    for _ in range(5):  # the reference: argmax of the next-token logits, one token at a time
        with torch.no_grad():
            next_id = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    expected = tokenizer.decode(ids[0, 3:], skip_special_tokens=True)
    assert sample.greedy_sample(model, tokenizer, "KING: speak thou", 5) == expected


def test_held_out_loss_is_token_weighted_and_ignores_padding() -> None:
    model, tokenizer = tiny_model(), tiny_tokenizer()
    texts = ["KING: speak", "MESSENGER: my lord the news thou speak", "the news my lord"]
    per_text = []
    for text in texts:  # each alone (no padding) through the model's own loss
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            per_text.append((float(model(ids, labels=ids).loss), ids.shape[1] - 1))
    expected = sum(loss * n for loss, n in per_text) / sum(n for _, n in per_text)
    assert sample.held_out_loss(model, tokenizer, texts, batch_size=2) == pytest.approx(
        expected, rel=1e-5
    )


def test_evaluate_reads_a_saved_model(tmp_path: Path) -> None:
    model, tokenizer = tiny_model(), tiny_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    texts = ["KING: the news", "MESSENGER: my lord"]
    result = sample.evaluate(tmp_path, texts)
    assert result["model"] == str(tmp_path)
    assert result["held_out_loss"] == pytest.approx(sample.held_out_loss(model, tokenizer, texts))
    assert result["sample"] == sample.greedy_sample(
        model, tokenizer, sample.PROMPT, sample.NEW_TOKENS
    )


def test_training_losses_and_report(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in (1, 2, 3)))
    losses = sample.training_losses(metrics)
    assert losses == [4.0, 3.0, 2.0]
    before = {"model": "m", "sample": "Ay, my lord.", "held_out_loss": 4.0}
    after = {"model": "m/final", "sample": "The king is dead.", "held_out_loss": 3.0}
    text = sample.report(before, after, losses)
    assert "before (m): held-out loss 4.000" in text
    assert "after (m/final): held-out loss 3.000" in text
    assert "MESSENGER:\nAy, my lord." in text
    assert "MESSENGER:\nThe king is dead." in text
    assert "training loss over 3 steps: 4.000 -> 2.000" in text


def test_missing_inputs_name_the_step_to_run(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=re.escape("run examples/demo/prepare.py")):
        sample.read_texts(tmp_path / "eval.jsonl")
    with pytest.raises(DataError, match="did training run"):
        sample.training_losses(tmp_path / "metrics.jsonl")
    (tmp_path / "eval.jsonl").write_text(json.dumps({"text": "KING: speak"}) + "\n")
    with pytest.raises(DataError, match=r"sample.py before"):
        sample.main(["after", str(tmp_path)])
