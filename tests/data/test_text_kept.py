"""No record trains without its text: a message the chat template skips, an empty completion
or assistant turn is an error naming the line; the loss mask of batched chunks is exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from data.helpers import (
    ASSISTANT,
    CHAT_TEMPLATE,
    END,
    build,
    make_tokenizer,
    set_chat_template,
    write_jsonl,
)
from slidedp.data import sources
from slidedp.data.samples import flatten_pairs
from slidedp.errors import DataError

# renders only the roles it knows, as Qwen's template does: a 'human' message vanishes
KNOWN_ROLES_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% for m in messages %}",
    "{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}",
).replace("{% endfor %}", "{% endif %}{% endfor %}")


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str, **fields: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text, **fields}


@pytest.fixture
def tok(tmp_path: Path) -> Path:
    return make_tokenizer(tmp_path / "tok")


@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_a_message_the_template_skips_is_an_error(
    tmp_path: Path, tok: Path, train_on_prompt: bool
) -> None:
    set_chat_template(tok, KNOWN_ROLES_TEMPLATE)
    fine = [_user("w1"), _assistant("w2")]
    human = [{"role": "human", "content": "w1"}, _assistant("w2")]
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": fine}, {"messages": human}])
    with pytest.raises(
        DataError,
        match=r"m\.jsonl:2: the chat template renders no text of message 1 \(role 'human'\) in "
        r"this conversation: merge it into another message or remove it, or use the roles the "
        r"template renders$",
    ):
        build(data, tok, train_on_prompt=train_on_prompt)


def test_a_skipped_message_is_not_found_in_an_earlier_one(tmp_path: Path, tok: Path) -> None:
    set_chat_template(tok, KNOWN_ROLES_TEMPLATE)
    same_text = [{"role": "system", "content": "w1"}, {"role": "human", "content": "w1"}]
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": [*same_text, _assistant("w2")]}])
    with pytest.raises(DataError, match=r"m\.jsonl:1: .* no text of message 2 \(role 'human'\)"):
        build(data, tok)


def test_a_skipped_message_is_not_found_in_a_later_one(tmp_path: Path, tok: Path) -> None:
    set_chat_template(tok, KNOWN_ROLES_TEMPLATE)
    conversation = [{"role": "human", "content": "w1"}, _user("w1 w3"), _assistant("w2")]
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": conversation}])
    with pytest.raises(DataError, match=r"m\.jsonl:1: .* no text of message 1 \(role 'human'\)"):
        build(data, tok)
    rendered = [_user("w1"), _user("w1 w3"), _assistant("w2")]  # the same texts, all rendered
    build(write_jsonl(tmp_path / "r.jsonl", [{"messages": rendered}]), tok)


@pytest.mark.parametrize(
    ("rewrite", "content"),
    [
        ("{{ m['content'] | trim }}", " w2 "),  # Llama's: trimmed
        ("{{ m['content'].split('w9 ')[-1] }}", "w9 w2"),  # Qwen3's: drops the reasoning
    ],
)
def test_a_template_that_rewrites_a_message_renders_it(
    tmp_path: Path, tok: Path, rewrite: str, content: str
) -> None:
    set_chat_template(tok, CHAT_TEMPLATE.replace("{{ m['content'] }}", rewrite))
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": [_user("w1"), _assistant(content)]}])
    assert build(data, tok).batch(0).labels.tolist()[0] == [-100] * 5 + [2, END]


@pytest.mark.parametrize("completion", ["", " \n"])
def test_an_empty_completion_is_an_error(tmp_path: Path, tok: Path, completion: str) -> None:
    records = [{"prompt": "w1", "completion": "w2"}, {"prompt": "w1", "completion": completion}]
    data = write_jsonl(tmp_path / "pc.jsonl", records)
    with pytest.raises(
        DataError,
        match=r"pc\.jsonl:2: completion is empty: the sample would train only on its end token; "
        "remove the record or fill it$",
    ):
        build(data, tok)
    build(data, tok, train_on_prompt=True)  # every token trains: no error


def test_several_messages_the_template_rewrites_cost_one_render_and_are_told_apart(
    tmp_path: Path, tok: Path
) -> None:
    """Messages not rendered verbatim (a template that rewrites every text) are probed in one
    render, each with its own probe: message 1's (skipped) is no prefix of message 10's."""
    rewrite = KNOWN_ROLES_TEMPLATE.replace(
        "{{ m['content'] }}", "{{ m['content'] | replace('w', 'v') }}"
    )
    set_chat_template(tok, rewrite)
    turns = [message for k in range(1, 7) for message in (_user(f"w{k}"), _assistant(f"w{k}"))]
    data = write_jsonl(
        tmp_path / "m.jsonl", [{"messages": [{"role": "human", "content": "w9"}, *turns]}]
    )
    with pytest.raises(DataError, match=r"no text of message 1 \(role 'human'\)"):
        build(data, tok)


@pytest.mark.parametrize(
    ("conversation", "message"),
    [
        ([_user("w1"), _assistant("")], 2),
        ([_user("w1"), _assistant("w2"), _user("w3"), _assistant("  ")], 4),  # one of several
    ],
)
def test_an_empty_assistant_turn_is_an_error(
    tmp_path: Path, tok: Path, conversation: list[dict[str, str]], message: int
) -> None:
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": conversation}])
    with pytest.raises(
        DataError,
        match=rf"m\.jsonl:1: message {message} \(role 'assistant'\) is empty: the sample would "
        "train only on its end-of-turn marker; remove the record or fill it$",
    ):
        build(data, tok, seq_len=32)


@pytest.mark.parametrize("content", ["", None])  # None: OpenAI's format for a tool call
def test_an_assistant_turn_of_tool_calls_alone_is_no_error(
    tmp_path: Path, tok: Path, content: str | None
) -> None:
    set_chat_template(tok, CHAT_TEMPLATE.replace(
        "{{ m['content'] }}",
        "{{ m['content'] or '' }}{% if m['tool_calls'] is defined %}w7{% endif %}",
    ))  # fmt: skip
    call = {**_assistant(""), "content": content,
            "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}  # fmt: skip
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": [_user("w1"), call]}])
    batch = build(data, tok).batch(0)
    assert batch.input_ids.tolist()[0][-3:] == [ASSISTANT, 7, END]
    assert batch.labels.tolist()[0][-3:] == [-100, 7, END]
    # any other field does not stand for text; a list of parts is refused plainly
    for message, needle in (
        (_assistant("", name="bot"), "message 2 \\(role 'assistant'\\) is empty"),
        (_assistant(None), "message 2 needs a string 'role' and 'content'"),  # type: ignore[arg-type]
        (_assistant([{"type": "text", "text": "w2"}]), "message 2's content is a list of parts"),  # type: ignore[arg-type]
    ):
        bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [_user("w1"), message]}])
        with pytest.raises(DataError, match=needle):
            build(bad, tok)
    # every token trains: an empty assistant turn is no error
    empty = write_jsonl(tmp_path / "e.jsonl", [{"messages": [_user("w1"), _assistant("")]}])
    assert build(empty, tok, train_on_prompt=True).batch(0).labels.tolist()[0][-1] == END


def test_the_loss_mask_of_a_chunk_is_the_mask_of_each_record_alone(
    tmp_path: Path, tok: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The character offsets of a chunk's texts, flattened together, still mark each record's
    assistant tokens (records of several lengths, chunks of 3)."""
    conversations = [
        [_user(" ".join(f"w{(i + k) % 20}" for k in range(i % 4 + 1))),
         _assistant(" ".join(f"w{(i * k) % 20}" for k in range(1, i % 3 + 2))),
         _user("w3"), _assistant("w4 " * (i % 2) + "w5")]
        for i in range(8)
    ]  # fmt: skip
    monkeypatch.setattr(sources, "RECORDS_PER_CHUNK", 3)
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in conversations])
    together = build(data, tok, seq_len=32).samples
    for i, conversation in enumerate(conversations):
        alone = build(write_jsonl(tmp_path / f"{i}.jsonl", [{"messages": conversation}]), tok,
                      seq_len=32).samples  # fmt: skip
        part = slice(together.offsets[i], together.offsets[i + 1])
        assert together.tokens[part].tolist() == alone.tokens.tolist()
        assert together.trained[part].tolist() == alone.trained.tolist()


def test_flatten_pairs_keeps_every_pair_in_order() -> None:
    offsets = [[(0, 2), (2, 5)], [], [(0, 1)], [(1, 1), (3, 4), (4, 9)]]
    expected = np.array([pair for text in offsets for pair in text], dtype=np.int64)
    assert np.array_equal(flatten_pairs(offsets, 6), expected)
    assert flatten_pairs([[], []], 0).shape == (0, 2)
