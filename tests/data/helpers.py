"""A tiny word-level fast tokenizer with a chat template, data files, and ``build``.

Token ids: ``w0``..``w19`` are 0..19, then ``[UNK]`` 20, ``<s>`` 21 (added before every
tokenized text, as Llama's tokenizer does), ``</s>`` 22 (eos), ``<pad>`` 23, ``<|user|>`` 24,
``<|assistant|>`` 25, ``<|end|>`` 26, ``<|system|>`` 27.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from slidedp.data.batches import Batches
from slidedp.data.build import ModelFacts, build_data
from slidedp.data.config import DataSection

BOS, EOS, PAD, USER, ASSISTANT, END, SYSTEM = 21, 22, 23, 24, 25, 26, 27
VOCAB = 28
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
SPECIALS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|end|>", "<|system|>"]


def make_tokenizer(
    directory: Path, *, chat_template: bool = True, eos: bool = True, pad: bool = True
) -> Path:
    vocab = {f"w{i}": i for i in range(20)} | {"[UNK]": 20}
    vocab |= {token: 21 + i for i, token in enumerate(SPECIALS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)]
    )
    kwargs: dict[str, Any] = {"unk_token": "[UNK]", "bos_token": "<s>"}
    if eos:
        kwargs["eos_token"] = "</s>"
    if pad:
        kwargs["pad_token"] = "<pad>"
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, additional_special_tokens=SPECIALS, **kwargs
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return directory


def set_chat_template(directory: Path, template: str) -> None:
    """Replace the chat template of the tokenizer saved in ``directory``."""
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(template)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def build(
    data: Path,
    model_dir: Path,
    *,
    batch_size: int = 2,
    seed: int = 0,
    model: ModelFacts | None = None,
    **keys: Any,
) -> Batches:
    """Batches of ``data`` with ``data:`` keys ``keys`` (seq_len 16 unless given)."""
    section = DataSection(path=str(data), **({"seq_len": 16} | keys))
    return build_data(
        section,
        model_dir=model_dir,
        model=model or ModelFacts(vocab_size=VOCAB, max_positions=64),
        batch_size=batch_size,
        seed=seed,
    )[0]
