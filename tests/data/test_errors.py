"""Every check made before any GPU work: one clear line each, naming the file:line and the fix."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.helpers import CHAT_TEMPLATE, build, make_tokenizer, set_chat_template, write_jsonl
from slidedp.data.build import ModelFacts, build_data
from slidedp.data.config import DataSection
from slidedp.errors import ConfigError, DataError, SlidedpError

CHAT = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]

# (file name, its text, data: keys, the error's pattern)
BAD_FILES: list[tuple[str, str, dict[str, Any], str]] = [
    (
        "d.jsonl",
        '{"input_ids": [1, 2]}\n\n{"input_ids": [1, 2}\n',
        {},
        r"d\.jsonl:3: not valid JSON",
    ),
    (
        "d.jsonl",
        '{"input_ids": [1, 2]}\n[1, 2]\n',
        {},
        r"d\.jsonl:2: expected a JSON object, got list",
    ),
    ("d.jsonl", b"\xff\xfe\n".decode("latin-1"), {}, r"d\.jsonl:1: not valid"),
    (
        "d.jsonl",
        "",
        {},
        r"d\.jsonl has no records \(it is empty, blank or an empty list\): add records to "
        r"it, or point data\.path at the data file$",
    ),
    ("d.jsonl", "\n  \n", {}, r"d\.jsonl has no records .* point data\.path at the data file$"),
    ("d.json", "[]", {}, r"d\.json has no records"),
    # the decoder's message without its dangling " at", after the line and column
    (
        "d.jsonl",
        '{"text": "w1"}\n{"text": "w1\tw2"}\n',
        {},
        r"d\.jsonl:2: not valid JSON \(column 13: Invalid control character\)$",
    ),
    (
        "d.json",
        '[{"text": "w1"},\n {"text": "w1"\n]',
        {},
        r"d\.json: not valid JSON \(line 3, column 1: Expecting ',' delimiter\)$",
    ),
    ("d.json", '{"text": "w1"}', {}, r"d\.json: a \.json data file must hold a list of records"),
    ("d.json", "[{]", {}, r"d\.json: not valid JSON"),
    ("d.csv", "text\nw1\n", {}, r"unknown data file type '\.csv' \(expected \.jsonl, \.json or"),
    (
        "d.jsonl",
        '{"input_ids": [1, 2]}\n{"text": "w1 w2"}\n',
        {},
        r"d\.jsonl:2: a 'text' record in a 'input_ids' file \(the format of .*d\.jsonl:1\)",
    ),
    (
        "d.jsonl",
        '{"text": "w1", "input_ids": [1, 2]}\n',
        {},
        r"d\.jsonl:1: the keys \['input_ids', 'text'\] fit several data formats .* data\.format",
    ),
    ("d.jsonl", '{"txt": "w1"}\n', {}, r"d\.jsonl:1: expected a 'text', 'messages', 'prompt'\+"),
    ("d.jsonl", '{"prompt": "w1"}\n', {}, r"d\.jsonl:1: has 'prompt' but no 'completion'"),
    ("d.jsonl", '{"completion": "w1"}\n', {}, r"d\.jsonl:1: has 'completion' but no 'prompt'"),
    ("d.jsonl", '{"input_ids": [1, 2]}\n', {"format": "text"}, r"data\.format=text needs 'text'"),
    (
        "d.json",
        '[{"input_ids": [1, 2]}, {"input_ids": [1.5, 2]}]',
        {},
        r"d\.json record 2: input_ids must be a list of integers",
    ),
    ("d.jsonl", '{"input_ids": ["a", "b"]}\n', {}, r"d\.jsonl:1: input_ids must be a list of int"),
    (
        "d.jsonl",
        '{"input_ids": [[1], [2, 3]]}\n',
        {},
        r"d\.jsonl:1: input_ids must be a list of int",
    ),
    (
        "d.jsonl",
        '{"input_ids": [true, false]}\n',
        {},
        r"d\.jsonl:1: input_ids must be a list of int",
    ),
    ("d.jsonl", '{"input_ids": "1 2"}\n', {}, r"d\.jsonl:1: input_ids must be a list of integers"),
    (
        "d.jsonl",
        '{"input_ids": [1, 2]}\n{"input_ids": [3]}\n',
        {},
        r"d\.jsonl:2: a sample needs at least 2 tokens, got 1",
    ),
    (
        "d.jsonl",
        '{"input_ids": [1, 2]}\n{"input_ids": [3, 28]}\n',
        {},
        r"d\.jsonl:2: token id 28 is outside the model's vocabulary \[0, 28\)$",
    ),
    ("d.jsonl", '{"input_ids": [-1, 2]}\n', {}, r"d\.jsonl:1: token id -1 is outside"),
    (
        "d.jsonl",
        '{"input_ids": [1, 2]}\n{"input_ids": [1, 2, 3], "labels": [-100, 2]}\n',
        {},
        r"d\.jsonl:2: labels has 2 entries, input_ids 3: one label per token",
    ),
    (
        "d.jsonl",
        '{"input_ids": [1, 2]}\n{"input_ids": [1, 2, 3], "labels": [-100, 2, 4]}\n',
        {},
        r"d\.jsonl:2: labels\[2\]=4 is neither -100 nor input_ids\[2\]=3: labels are the ids",
    ),
    ("d.jsonl", '{"input_ids": [1, 2], "labels": "2"}\n', {}, r"1: labels must be a list of int"),
    ("d.jsonl", '{"input_ids": [1, 1], "labels": [-100, true]}\n', {}, r"1: labels must be a l"),
    ("d.jsonl", '{"input_ids": [1, true, 3]}\n', {}, r"d\.jsonl:1: input_ids must be a list of"),
    ("d.jsonl", '{"text": ""}\n', {}, r"d\.jsonl:1: a sample needs at least 2 tokens, got 1"),
    ("d.jsonl", '{"text": 3}\n', {}, r"d\.jsonl:1: 'text' must be a string"),
    # a lone surrogate is valid JSON but no Unicode text: the tokenizer's refusal names no line
    (
        "d.jsonl",
        '{"text": "w1"}\n{"text": "w1 \\ud800 w2"}\n',
        {},
        r"d\.jsonl:2: the text is not valid Unicode \(surrogates not allowed at character 3, as "
        r"the JSON escape \\ud800\)",
    ),
    (
        "d.jsonl",
        '{"prompt": "w1", "completion": "\\udfff"}\n',
        {},
        r"d\.jsonl:1: the text is not valid Unicode",
    ),
    (
        "d.jsonl",
        json.dumps({"messages": [CHAT[0], {"role": "assistant", "content": "w1 \ud800"}]}) + "\n",
        {},
        r"d\.jsonl:1: the text is not valid Unicode",
    ),
    ("d.jsonl", '{"prompt": "w1", "completion": null}\n', {}, r"d\.jsonl:1: 'completion' must be"),
    (
        "d.jsonl",
        json.dumps({"messages": [{"role": "user", "content": "w1"}]}) + "\n",
        {},
        r"d\.jsonl:1: no assistant message to train on \(set data\.train_on_prompt=true",
    ),
    ("d.jsonl", '{"messages": []}\n', {}, r"d\.jsonl:1: 'messages' must be a non-empty list"),
    (
        "d.jsonl",
        json.dumps({"messages": [CHAT[0], {"role": "assistant"}]}) + "\n",
        {},
        r"d\.jsonl:1: message 2 needs a string 'role' and 'content'",
    ),
]


@pytest.mark.parametrize(("name", "text", "keys", "pattern"), BAD_FILES)
def test_bad_data_is_one_clear_line(
    tmp_path: Path, name: str, text: str, keys: dict[str, Any], pattern: str
) -> None:
    tok = make_tokenizer(tmp_path / "tok")
    path = tmp_path / name
    path.write_text(text, encoding="latin-1" if "\xff" in text else "utf-8")
    with pytest.raises(DataError, match=pattern) as info:
        build(path, tok, **keys)
    assert "\n" not in str(info.value)


DIRECTORY_ERRORS = {
    "data.path": r"^data\.path \S*/dir is a directory: give one \.jsonl/\.json/\.parquet file, "
    r"or list its files in data\.sources \(a mixture\)$",
    "data.sources": r"^data\.sources\[1\]\.path \S*/dir is a directory: give one \.jsonl/\.json/"
    r"\.parquet file, one source each$",
    "data.eval_path": r"^data\.eval_path \S*/dir is a directory: give one \.jsonl/\.json/"
    r"\.parquet file$",
}


@pytest.mark.parametrize("key", DIRECTORY_ERRORS)
def test_a_directory_is_named_by_its_key(tmp_path: Path, key: str) -> None:
    directory = tmp_path / "dir"
    directory.mkdir()
    data = str(write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2]}]))
    keys: dict[str, dict[str, Any]] = {
        "data.path": {"path": str(directory)},
        "data.sources": {"sources": [{"path": data}, {"path": str(directory)}]},
        "data.eval_path": {"path": data, "eval_path": str(directory)},
    }
    section = DataSection(seq_len=16, **keys[key])
    with pytest.raises(DataError, match=DIRECTORY_ERRORS[key]):
        build_data(section, model_dir=tmp_path, model=ModelFacts(28), batch_size=1, seed=0)
    (tmp_path / "dir.jsonl").mkdir()  # an extension does not make it a file
    with pytest.raises(DataError, match=r"^data\.path \S*/dir\.jsonl is a directory"):
        build(tmp_path / "dir.jsonl", tmp_path)


def test_a_tokenizer_id_outside_the_model_vocabulary(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "tok")
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": "w1 w2"}])
    with pytest.raises(DataError, match=r"t\.jsonl:1: token id 21 .* \[0, 20\) \(is it model"):
        build(data, tok, model=ModelFacts(vocab_size=20))


def test_seq_len_above_the_model_positions_and_a_bad_pad_id(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2]}])
    with pytest.raises(ConfigError, match=r"data\.seq_len=128 exceeds the model's max_position"):
        build(data, tmp_path, seq_len=128, model=ModelFacts(vocab_size=28, max_positions=64))
    with pytest.raises(ConfigError, match=r"data\.pad_id=28 is outside the vocabulary of 28"):
        build(data, tmp_path, pad_id=28)


def test_messages_need_a_chat_template(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "tok", chat_template=False)
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match=r"has 'messages' but the tokenizer in .* no chat_template"):
        build(data, tok)


def test_a_template_that_rewrites_earlier_turns_cannot_split_them(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "tok")
    # the last message gets an extra word: a prefix renders differently inside the whole
    set_chat_template(tok, CHAT_TEMPLATE.replace(
        "{{ m['content'] }}", "{{ m['content'] }}{% if loop.last %} w9{% endif %}"
    ))  # fmt: skip
    conversation = [
        *CHAT,
        {"role": "user", "content": "w3"},
        {"role": "assistant", "content": "w4"},
    ]
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": conversation}])
    with pytest.raises(
        DataError,
        match=r"m\.jsonl:1: the chat template renders the conversation up to message 2 differently",
    ):
        build(data, tok, seq_len=32)
    assert build(data, tok, seq_len=32, train_on_prompt=True).report.sequences == 1


def test_a_tokenizer_is_needed_for_text(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": "w1 w2"}])
    with pytest.raises(DataError, match="data in the 'text' format needs the model's tokenizer"):
        build(data, tmp_path)


def test_padding_needs_a_pad_or_eos_id(tmp_path: Path) -> None:
    uneven = write_jsonl(tmp_path / "u.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [1, 2, 3]}])
    with pytest.raises(
        DataError, match=r"need padding, but no pad or eos token .* set data\.pad_id"
    ):
        build(uneven, tmp_path)  # no tokenizer there, and the model defines neither
    assert build(uneven, tmp_path, model=ModelFacts(vocab_size=28, eos_id=7)).pad_id == 7
    assert build(uneven, tmp_path, pad_id=3).pad_id == 3
    assert build(uneven, tmp_path, batch_size=1).pad_id == 0  # one row per batch: no padding
    even = write_jsonl(tmp_path / "e.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [3, 4]}])
    assert build(even, tmp_path).batch(0).input_ids.tolist() == [[1, 2], [3, 4]]


def test_packing_text_and_completions_need_eos(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "tok", eos=False)
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "w1 w2"}])
    with pytest.raises(DataError, match="packing text needs an end-of-sequence token"):
        build(text, tok, packing=True)
    assert build(text, tok, batch_size=1).report.tokens == 3  # padded text needs no eos
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "w1", "completion": "w2"}])
    with pytest.raises(DataError, match="prompt/completion data needs an end-of-sequence"):
        build(pc, tok)
    assert build(pc, tok, model=ModelFacts(vocab_size=28, eos_id=5)).batch(0).input_ids[0, -1] == 5


def test_unreadable_file(tmp_path: Path) -> None:
    fix = r"No such file or directory; point data\.path"
    with pytest.raises(DataError, match=rf"cannot read data .*missing\.jsonl: {fix}"):
        build(tmp_path / "missing.jsonl", tmp_path)


def test_parquet_null_ids_name_the_row(tmp_path: Path) -> None:
    table = pa.table({"input_ids": pa.array([[1, 2], None, [3, 4]], type=pa.list_(pa.int64()))})
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet row 2: input_ids is null"):
        build(tmp_path / "d.parquet", tmp_path)
    table = pa.table({"input_ids": pa.array([[1, 2], [3, None]], type=pa.list_(pa.int64()))})
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet row 2: input_ids holds a null token id"):
        build(tmp_path / "d.parquet", tmp_path)
    pq.write_table(pa.table({"input_ids": ["1 2"]}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match="column input_ids must be a list of integers, got string"):
        build(tmp_path / "d.parquet", tmp_path)


def test_parquet_without_pyarrow_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "d.parquet").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(
        DataError, match=r"reading Parquet needs pyarrow: pip install 'slidedp\[parquet\]'"
    ):
        build(tmp_path / "d.parquet", tmp_path)


@pytest.mark.parametrize(
    ("keys", "pattern"),
    [
        ({"format": "csv"}, r"data\.format must be one of auto, text, messages"),
        ({"over_length": "cut"}, r"data\.over_length must be one of truncate, drop, error"),
        ({"pad_id": -2}, r"data\.pad_id must be >= 0 \(or -1: auto\)"),
        ({"seq_len": 1}, r"data\.seq_len must be >= 2"),
        ({"path": ""}, r"data\.path is required"),
    ],
)
def test_data_section_validation(keys: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        DataSection(**({"path": "d.jsonl"} | keys))
    assert issubclass(DataError, SlidedpError)
