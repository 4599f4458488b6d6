"""Records → token ids and trained-token mask, per format, one chunk (one tokenizer call) at a time.

- ``text``: the tokenizer's special tokens; with packing, eos appended unless last. Loss on all.
- ``prompt`` + ``completion``: prompt (with special tokens), completion, eos unless last; loss
  on the completion and its eos.
- ``messages``: the tokenizer's chat template; loss on the characters the template adds for each
  assistant turn past the generation prompt (content and end-of-turn, not the role header). A
  template that renders a prefix differently from the whole conversation is an error.
- ``input_ids``: as given; loss on all. ``data.train_on_prompt`` trains every token.

Example::

    encoder = Encoder(model_dir, vocab_size=32000, eos_id=2, packing=True,
                      train_on_prompt=False, where=source.where)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from jinja2 import TemplateError
from transformers import AutoTokenizer

from slidedp.data.samples import (
    I64,
    Samples,
    flatten_lists,
    flatten_pairs,
    offsets_of,
    positions_within,
)
from slidedp.data.sources import Chunk, TokenColumn
from slidedp.errors import DataError

_VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_IGNORED = -100  # a label that is no target (transformers' ignore_index)
# put in place of a message's content to see whether the chat template renders the message at all
_PROBE = "slidedp-probe-4f1c9a"
_EMPTY_FIX = "remove the record or fill it"
_RENDERED_FIELDS = ("tool_calls", "reasoning_content")  # what templates render beside content


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _encode(tokenizer: Any, texts: list[str], *, special: bool, offsets: bool = False) -> Any:
    """One batched call of the fast tokenizer: ids (and character offsets) of every text."""
    return tokenizer(
        texts,
        add_special_tokens=special,
        return_attention_mask=False,
        return_token_type_ids=False,
        return_offsets_mapping=offsets,
    )


def load_tokenizer(model_dir: Path, why: str) -> Any:
    """The model directory's fast tokenizer (``why``: what needs it, for the error line)."""

    # without these files transformers may build an empty tokenizer: every text would be 0 tokens
    if not any((model_dir / name).is_file() for name in _VOCABULARY_FILES):
        raise DataError(
            f"{why} needs the model's tokenizer, but {model_dir} has no tokenizer files (none of "
            f"{', '.join(_VOCABULARY_FILES)}): copy them from the original model, or give "
            "pre-tokenized input_ids data"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"{why} needs the model's tokenizer, but none loads from {model_dir}: {_first_line(e)}"
        ) from None
    except Exception as e:
        if type(e) is not Exception:  # the Rust tokenizers library raises plain Exceptions
            raise
        raise DataError(
            f"{why} needs the model's tokenizer, but the tokenizers library rejects "
            f"{model_dir / 'tokenizer.json'}: {_first_line(e)}; copy the tokenizer files again "
            "from the original model"
        ) from None
    if len(tokenizer) < 2:
        raise DataError(
            f"the tokenizer in {model_dir} has {len(tokenizer)} token(s): its files are empty or "
            "broken; copy them again from the original model"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"the tokenizer in {model_dir} is not a fast one (no tokenizer.json); slidedp needs "
            "the fast tokenizer for batched tokenization and exact loss masks"
        )
    return tokenizer


class Encoder:
    """Encodes chunks of one data file; loads the tokenizer on the first chunk that needs it."""

    def __init__(
        self,
        model_dir: Path,
        *,
        vocab_size: int,
        eos_id: int | None,
        packing: bool,
        train_on_prompt: bool,
        where: Callable[[int], str],
    ) -> None:
        self.model_dir, self.vocab_size, self.model_eos_id = model_dir, vocab_size, eos_id
        self.packing, self.train_on_prompt, self.where = packing, train_on_prompt, where
        self._tokenizer: Any = None

    @property
    def loaded_tokenizer(self) -> Any:
        """The tokenizer if one was loaded (``input_ids`` data needs none), else None."""
        return self._tokenizer

    def optional_tokenizer(self) -> Any:
        """The model's tokenizer if one loads, else None (only its pad/eos are wanted)."""
        if self._tokenizer is None:
            try:
                self._tokenizer = load_tokenizer(self.model_dir, "a pad token")
            except DataError:
                return None
        return self._tokenizer

    def tokenizer(self, fmt: str) -> Any:
        """The tokenizer, checked for what ``fmt`` needs (chat template, eos)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_dir, f"data in the '{fmt}' format")
            if fmt == "messages" and not self._tokenizer.chat_template:
                raise DataError(
                    f"data has 'messages' but the tokenizer in {self.model_dir} has no "
                    "chat_template; add one to tokenizer_config.json (or use the text or "
                    "prompt/completion format)"
                )
        return self._tokenizer

    def eos_id(self, fmt: str, why: str) -> int:
        eos = self.tokenizer(fmt).eos_token_id
        eos = self.model_eos_id if eos is None else int(eos)
        if eos is None:
            raise DataError(
                f"{why} needs an end-of-sequence token, but neither the tokenizer in "
                f"{self.model_dir} nor config.json there defines one; set eos_token in "
                "tokenizer_config.json"
            )
        return eos

    def encode(self, chunk: Chunk) -> Samples:
        encoders = {
            "text": self._text,
            "prompt_completion": self._prompt_completion,
            "messages": self._messages,
            "input_ids": self._input_ids,
        }
        ids, lengths, trained = encoders[chunk.format](chunk)
        self._check(chunk, ids, lengths)
        samples = Samples(ids.astype(np.int32), trained, offsets_of(lengths), chunk.numbers)
        no_target = samples.label_counts() == 0
        if no_target.any():
            number = int(chunk.numbers[np.argmax(no_target)])
            raise DataError(f"{self.where(number)}: the sample has no token to train on")
        return samples

    def _check(self, chunk: Chunk, ids: I64, lengths: I64) -> None:
        """Token ids inside the vocabulary, at least 2 tokens per sample (one target)."""
        outside = (ids < 0) | (ids >= self.vocab_size)
        if outside.any():
            at = int(np.argmax(outside))
            sample = int(np.searchsorted(np.cumsum(lengths), at, side="right"))
            hint = "" if chunk.format == "input_ids" else " (is it model.path's tokenizer?)"
            raise DataError(
                f"{self.where(int(chunk.numbers[sample]))}: token id {int(ids[at])} is outside "
                f"the model's vocabulary [0, {self.vocab_size}){hint}"
            )
        short = lengths < 2
        if short.any():
            sample = int(np.argmax(short))
            raise DataError(
                f"{self.where(int(chunk.numbers[sample]))}: a sample needs at least 2 tokens, "
                f"got {int(lengths[sample])}"
            )

    def _strings(self, chunk: Chunk, key: str) -> list[str]:
        values = chunk.columns[key]
        assert isinstance(values, list)
        for number, value in zip(chunk.numbers.tolist(), values, strict=True):
            if not isinstance(value, str):
                raise DataError(f"{self.where(number)}: '{key}' must be a string")
        return values

    def _encoded(
        self,
        tokenizer: Any,
        chunk: Chunk,
        texts: list[str],
        *,
        special: bool,
        offsets: bool = False,
    ) -> Any:
        """``_encode`` of the chunk's texts (one per sample); a text that is not Unicode (a lone
        surrogate: "\\ud800" is valid JSON) is named by its file and line."""
        try:
            return _encode(tokenizer, texts, special=special, offsets=offsets)
        except TypeError:  # the fast tokenizer's refusal names no text: find it (errors only)
            for number, text in zip(chunk.numbers.tolist(), texts, strict=True):
                try:
                    text.encode()
                except UnicodeEncodeError as e:
                    raise DataError(
                        f"{self.where(number)}: the text is not valid Unicode ({e.reason} at "
                        f"character {e.start}, as the JSON escape \\u{ord(text[e.start]):04x}); "
                        "mend or remove the record"
                    ) from None
            raise

    def _append_eos(self, ids: I64, lengths: I64, eos: int) -> tuple[I64, I64]:
        """eos after each segment that does not already end with it."""
        ends = np.cumsum(lengths)
        add = np.ones(len(lengths), dtype=np.bool_)
        nonempty = lengths > 0
        add[nonempty] = ids[ends[nonempty] - 1] != eos
        return np.insert(ids, ends[add], eos), lengths + add

    def _text(self, chunk: Chunk) -> tuple[I64, I64, npt.NDArray[np.bool_]]:
        texts = self._strings(chunk, "text")
        tokenizer = self.tokenizer("text")
        encoded = self._encoded(tokenizer, chunk, texts, special=True)
        ids, lengths = flatten_lists(encoded["input_ids"])
        if self.packing:
            ids, lengths = self._append_eos(ids, lengths, self.eos_id("text", "packing text"))
        return ids, lengths, np.ones(len(ids), dtype=np.bool_)

    def _prompt_completion(self, chunk: Chunk) -> tuple[I64, I64, npt.NDArray[np.bool_]]:
        prompts = self._strings(chunk, "prompt")
        completions = self._strings(chunk, "completion")
        for number, completion in zip(chunk.numbers.tolist(), completions, strict=True):
            if not completion.strip() and not self.train_on_prompt:
                raise DataError(
                    f"{self.where(number)}: completion is empty: the sample would train only on "
                    f"its end token; {_EMPTY_FIX}"
                )
        tokenizer = self.tokenizer("prompt_completion")
        eos = self.eos_id("prompt_completion", "prompt/completion data")
        p, p_len = flatten_lists(
            self._encoded(tokenizer, chunk, prompts, special=True)["input_ids"]
        )
        c, c_len = flatten_lists(
            self._encoded(tokenizer, chunk, completions, special=False)["input_ids"]
        )
        c, c_len = self._append_eos(c, c_len, eos)
        lengths = p_len + c_len
        starts = np.cumsum(lengths) - lengths
        p_at = np.repeat(starts, p_len) + positions_within(p_len)
        c_at = np.repeat(starts + p_len, c_len) + positions_within(c_len)
        ids = np.empty(int(lengths.sum()), dtype=np.int64)
        trained = np.ones(len(ids), dtype=np.bool_)
        ids[p_at], ids[c_at] = p, c
        trained[p_at] = self.train_on_prompt
        return ids, lengths, trained

    def _messages(self, chunk: Chunk) -> tuple[I64, I64, npt.NDArray[np.bool_]]:
        conversations = chunk.columns["messages"]
        assert isinstance(conversations, list)
        tokenizer = self.tokenizer("messages")
        texts: list[str] = []
        spans: list[tuple[int, int]] = []  # assistant spans, characters of all texts end to end
        base = 0
        for number, conversation in zip(chunk.numbers.tolist(), conversations, strict=True):
            text, own = self._render(tokenizer, conversation, self.where(number))
            spans.extend((base + a, base + b) for a, b in own)
            texts.append(text)
            base += len(text)
        encoded = self._encoded(
            tokenizer, chunk, texts, special=False, offsets=not self.train_on_prompt
        )
        ids, lengths = flatten_lists(encoded["input_ids"])
        if self.train_on_prompt:
            return ids, lengths, np.ones(len(ids), dtype=np.bool_)
        chars = flatten_pairs(encoded["offset_mapping"], len(ids))  # [T, 2] (first, end) char
        text_lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        first = chars[:, 0] + np.repeat(np.cumsum(text_lengths) - text_lengths, lengths)
        bounds = np.array(spans, dtype=np.int64).reshape(-1, 2)  # sorted, disjoint
        k = np.searchsorted(bounds[:, 0], first, side="right") - 1
        inside = (k >= 0) & (first < bounds[np.maximum(k, 0), 1])
        trained = inside & (chars[:, 1] > chars[:, 0])  # zero-width tokens are never targets
        return ids, lengths, trained

    def _render(
        self, tokenizer: Any, conversation: Any, where: str
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns."""
        _check_messages(conversation, where, self.train_on_prompt)
        full = _apply_template(tokenizer, conversation, False, where)
        _check_every_message_rendered(tokenizer, conversation, full, where)
        if self.train_on_prompt:
            return full, []
        spans = []
        for i, message in enumerate(conversation):
            if message["role"] != "assistant":
                continue
            before = _apply_template(tokenizer, conversation[:i], True, where)
            through = (
                full
                if i + 1 == len(conversation)
                else _apply_template(tokenizer, conversation[: i + 1], False, where)
            )
            if not (full.startswith(through) and through.startswith(before)):
                raise DataError(
                    f"{where}: the chat template renders the conversation up to message {i + 1} "
                    "differently from the start of the whole conversation, so its assistant "
                    "tokens cannot be found exactly; set data.train_on_prompt=true"
                )
            spans.append((len(before), len(through)))
        if not spans:
            raise DataError(
                f"{where}: no assistant message to train on (set data.train_on_prompt=true to "
                "train on every token)"
            )
        return full, spans

    def _input_ids(self, chunk: Chunk) -> tuple[I64, I64, npt.NDArray[np.bool_]]:
        ids, lengths = self._token_lists(chunk, "input_ids")
        if "labels" not in chunk.columns:
            return ids, lengths, np.ones(len(ids), dtype=np.bool_)
        return ids, lengths, self._trained_by_labels(chunk, ids, lengths)

    def _token_lists(self, chunk: Chunk, key: str) -> tuple[I64, I64]:
        """Column ``key`` as flat ids and lengths (a record without it: length -1, no ids)."""
        column = chunk.columns[key]
        if isinstance(column, TokenColumn):
            return column.values, np.diff(column.offsets)
        arrays = []
        lengths = np.full(len(column), -1, dtype=np.int64)
        for i, (number, value) in enumerate(zip(chunk.numbers.tolist(), column, strict=True)):
            if value is None and key != "input_ids":
                continue
            try:  # a bool among integers would be read as 0 or 1
                listed = isinstance(value, list) and bool not in set(map(type, value))
                array = np.asarray(value) if listed else None
            except ValueError:  # ragged nesting
                array = None
            if array is None or array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
                raise DataError(f"{self.where(number)}: {key} must be a list of integers")
            arrays.append(array.astype(np.int64))
            lengths[i] = len(array)
        ids = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
        return ids, lengths

    def _trained_by_labels(self, chunk: Chunk, ids: I64, lengths: I64) -> npt.NDArray[np.bool_]:
        """The tokens the records' ``labels`` train on: transformers' layout, the ids with -100
        where a token is no target (the model shifts them); a record without labels: every one."""
        labels, label_lengths = self._token_lists(chunk, "labels")
        given = label_lengths >= 0
        wrong = given & (label_lengths != lengths)
        if wrong.any():
            i = int(np.argmax(wrong))
            raise DataError(
                f"{self.where(int(chunk.numbers[i]))}: labels has {int(label_lengths[i])} "
                f"entries, input_ids {int(lengths[i])}: one label per token (-100: not trained)"
            )
        flat = ids.copy()
        flat[np.repeat(given, lengths)] = labels
        target: npt.NDArray[np.bool_] = np.not_equal(flat, _IGNORED)
        differs = target & (flat != ids)
        if differs.any():
            at = int(np.argmax(differs))
            i = int(np.searchsorted(np.cumsum(lengths), at, side="right"))
            k = at - int(np.cumsum(lengths)[i] - lengths[i])
            raise DataError(
                f"{self.where(int(chunk.numbers[i]))}: labels[{k}]={int(flat[at])} is neither "
                f"-100 nor input_ids[{k}]={int(ids[at])}: labels are the ids with -100 at the "
                "tokens not trained on (the model shifts them)"
            )
        return target


def _check_messages(conversation: Any, where: str, train_on_prompt: bool) -> None:
    """A non-empty list of messages, each a string role and string content (an assistant
    turn with ``tool_calls`` may have null content, as OpenAI's format writes it); unless every
    token trains, no assistant turn without text or a rendered field (it would train only on
    its end-of-turn marker)."""
    if not isinstance(conversation, list) or not conversation:
        raise DataError(f"{where}: 'messages' must be a non-empty list of messages")
    for j, message in enumerate(conversation, start=1):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            raise DataError(f"{where}: message {j} needs a string 'role' and 'content'")
        content = message.get("content")
        rendered = any(message.get(field) for field in _RENDERED_FIELDS)
        if isinstance(content, list):
            raise DataError(
                f"{where}: message {j}'s content is a list of parts (multimodal): give its "
                "text as a string"
            )
        if not (isinstance(content, str) or (content is None and rendered)):
            raise DataError(f"{where}: message {j} needs a string 'role' and 'content'")
        empty = message["role"] == "assistant" and not (content or "").strip() and not rendered
        if empty and not train_on_prompt:
            raise DataError(
                f"{where}: message {j} (role 'assistant') is empty: the sample would train only "
                f"on its end-of-turn marker; {_EMPTY_FIX}"
            )


def _apply_template(
    tokenizer: Any, messages: list[Any], generation_prompt: bool, where: str
) -> str:
    try:
        return str(
            tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        )
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        raise DataError(f"{where}: the chat template failed: {_first_line(e)}") from None


def _probe(j: int) -> str:
    return f"{_PROBE}-{j}-"  # closed: message 1's is no prefix of message 12's


def _check_every_message_rendered(
    tokenizer: Any, conversation: list[Any], full: str, where: str
) -> None:
    """Every message's text is in the rendered conversation: many templates silently skip a
    role they do not know (Qwen's: 'human'), and some a system prompt where the conversation
    does not end on a user turn (Mistral's), which would train without that text. Searched in
    order: a skipped message whose text an earlier one holds is found missing. Messages not
    there verbatim (a template may rewrite the text: some drop the reasoning of earlier turns),
    and those whose text a later message holds (the search may have found that one's), are
    rendered again with a probe each, in one render."""
    contents = [(m.get("content") or "").strip() for m in conversation]  # templates often trim
    start, unseen = 0, []
    for j, content in enumerate(contents, start=1):
        if not content:
            continue
        found = full.find(content, start)
        if found >= 0:
            start = found + len(content)
        if found < 0 or any(content in later for later in contents[j:]):
            unseen.append(j)
    if not unseen:
        return
    probes = [
        {**m, "content": _probe(j)} if j in unseen else m
        for j, m in enumerate(conversation, start=1)
    ]
    rendered = _apply_template(tokenizer, probes, False, where)
    for j in unseen:
        if _probe(j) not in rendered:
            raise DataError(
                f"{where}: the chat template renders no text of message {j} (role "
                f"{conversation[j - 1]['role']!r}) in this conversation: merge it into another "
                "message or remove it, or use the roles the template renders"
            )
