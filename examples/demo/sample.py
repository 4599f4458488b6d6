"""Before and after ``make demo``'s fine-tuning: a greedy sample from a fixed prompt and the loss
on the held-out chunks (``OUT/eval.jsonl``, a play never trained on), with plain transformers.

``before`` reads the prepared model (``OUT/model``) and keeps its numbers in
``OUT/before.json``; ``after`` reads the engine's export (``OUT/run/final``) and prints both,
with the first and last training losses of ``OUT/run/metrics.jsonl``.

Run::

    python examples/demo/sample.py before out/demo
    python -m slidedp train examples/demo/train.yaml
    python examples/demo/sample.py after out/demo
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from slidedp.data.batch import IGNORE_INDEX
from slidedp.errors import DataError

PROMPT = "KING:\nWhat news, my lord? Speak, and speak plainly.\n\nMESSENGER:\n"
NEW_TOKENS = 40


def read_texts(path: Path) -> list[str]:
    """The ``{"text": ...}`` lines of a JSONL file."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}; run examples/demo/prepare.py") from None
    texts = [json.loads(line)["text"] for line in lines if line.strip()]
    if not texts:
        raise DataError(f"{path} has no text lines")
    return texts


def greedy_sample(model: Any, tokenizer: Any, prompt: str, new_tokens: int) -> str:
    """The model's greedy continuation of ``prompt`` (the continuation only)."""
    encoded = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **encoded,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return str(tokenizer.decode(out[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True))


def held_out_loss(model: Any, tokenizer: Any, texts: list[str], batch_size: int = 8) -> float:
    """Mean next-token cross-entropy over every predicted token of ``texts`` (padding
    excluded), as the engine computes the training loss."""
    total, count = 0.0, 0
    tokenizer.padding_side = "right"
    for first in range(0, len(texts), batch_size):  # one iteration per batch
        batch = tokenizer(texts[first : first + batch_size], return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        with torch.no_grad():
            logits = model(**batch).logits.float()
        total += float(
            torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1),
                labels[:, 1:].flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        )
        count += int((labels[:, 1:] != IGNORE_INDEX).sum())
    return total / count


def training_losses(metrics: Path) -> list[float]:
    """The loss of every step in ``metrics.jsonl``, in order."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError as e:
        raise DataError(f"cannot read {metrics}: {e.strerror}; did training run?") from None
    losses = [float(json.loads(line)["loss"]) for line in lines if line.strip()]
    if not losses:
        raise DataError(f"{metrics} has no steps")
    return losses


def evaluate(model_dir: Path, eval_texts: list[str]) -> dict[str, Any]:
    """``{"model", "sample", "held_out_loss"}`` of the HF model in ``model_dir``, on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # in eval mode
    return {
        "model": str(model_dir),
        "sample": greedy_sample(model, tokenizer, PROMPT, NEW_TOKENS),
        "held_out_loss": held_out_loss(model, tokenizer, eval_texts),
    }


def report(before: dict[str, Any], after: dict[str, Any], losses: list[float]) -> str:
    """The demo's closing summary: both samples, held-out losses, the training loss trend."""
    head = min(5, len(losses))
    lines = [f"== prompt:\n{PROMPT}"]
    for label, result in (("before", before), ("after", after)):
        lines += [
            f"== {label} ({result['model']}): held-out loss {result['held_out_loss']:.3f} "
            f"(perplexity {math.exp(result['held_out_loss']):.1f})",
            PROMPT.rsplit("\n\n", 1)[-1] + result["sample"],
        ]
    lines.append(
        f"== training loss over {len(losses)} steps: {losses[0]:.3f} -> {losses[-1]:.3f} "
        f"(mean of the first {head}: {sum(losses[:head]) / head:.3f}, "
        f"of the last {head}: {sum(losses[-head:]) / head:.3f})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("when", choices=("before", "after"))
    parser.add_argument("out", type=Path, help="the demo folder, e.g. out/demo")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # per-tensor bars
    out: Path = args.out
    eval_texts = read_texts(out / "eval.jsonl")
    if args.when == "before":
        result = evaluate(out / "model", eval_texts)
        (out / "before.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"== before: held-out loss {result['held_out_loss']:.3f}; sample:")
        print(PROMPT + result["sample"])
        return
    try:
        before = json.loads((out / "before.json").read_text())
    except OSError:
        raise DataError(f"no {out / 'before.json'}: run `sample.py before {out}` first") from None
    after = evaluate(out / "run" / "final", eval_texts)
    print(report(before, after, training_losses(out / "run" / "metrics.jsonl")))


if __name__ == "__main__":
    main()
