"""The demo's corpus preparation (``examples/demo/prepare.py``) on small synthetic plays, with a
character-level stand-in for the tokenizer (one token per character, so budgets are exact)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from demo.examples import load_demo_script
from slidedp.errors import DataError, ModelLoadError

prepare = load_demo_script("prepare")


def char_starts(text: str) -> npt.NDArray[np.int64]:
    return np.arange(len(text), dtype=np.int64)


def word_starts(text: str) -> npt.NDArray[np.int64]:
    """Tokens like a BPE's: a word with the whitespace before it (so no token starts a line)."""
    return np.array([m.start() for m in re.finditer(r"\s*\S+|\s+$", text)], dtype=np.int64)


def test_markdown_to_script() -> None:
    markdown = (
        "# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore.\n\n_Enter BERNARDO and\nFRANCISCO_\n\n"
        "**BERNARDO**  \nWho's there?  \nNay, \\[aside] answer me\\--stand &amp; unfold.\n\n\n"
        "__\\[Exit]_  \n"
    )
    assert prepare.markdown_to_script(markdown) == (
        "Hamlet\n\nACT I\n\nSCENE I. Elsinore.\n\nEnter BERNARDO and\nFRANCISCO\n\n"
        "BERNARDO:\nWho's there?\nNay, [aside] answer me--stand & unfold.\n\n[Exit]\n"
    )


def test_chunks_end_before_a_paragraph() -> None:
    text = "A:\naa\n\nB:\nbb\n\nC:\ncc\n"
    # "A:\naa\n\nB:\nbb\n\n" is 14 characters: the cut falls before C's speech.
    assert prepare.chunk_at_lines(text, char_starts(text), 14) == [
        "A:\naa\n\nB:\nbb\n\n",
        "C:\ncc\n",
    ]
    # One character less and B's speech no longer fits beside A's.
    assert prepare.chunk_at_lines(text, char_starts(text), 13) == [
        "A:\naa\n\n",
        "B:\nbb\n\nC:\ncc\n",
    ]
    # A cut before B's speech would leave the chunk less than half full: cut before a line.
    text = "A:\naa\n\nB:\nbbbbbbbbbb\nbb\n"
    assert prepare.chunk_at_lines(text, char_starts(text), 16) == [
        "A:\naa\n\nB:\n",
        "bbbbbbbbbb\nbb\n",
    ]


def test_long_paragraph_is_cut_at_lines_and_long_line_mid_line() -> None:
    text = "A:\n" + "xxxx\n" * 4
    assert prepare.chunk_at_lines(text, char_starts(text), 10) == [
        "A:\nxxxx\n",
        "xxxx\nxxxx\n",
        "xxxx\n",
    ]
    line = "y" * 25
    assert prepare.chunk_at_lines(line, char_starts(line), 10) == ["y" * 10, "y" * 10, "y" * 5]


def test_cuts_only_where_a_token_starts() -> None:
    text = "A:\naa bb\n\nB:\ncc dd ee ff\n"
    # Word tokens: "A:", "\naa", " bb", "\n\nB:", ... no token starts a line, so the chunks are
    # cut at the budget, between tokens.
    chunks = prepare.chunk_at_lines(text, word_starts(text), 3)
    assert chunks == ["A:\naa bb", "\n\nB:\ncc dd", " ee ff\n"]


def test_chunks_cover_the_text_within_the_budget() -> None:
    rng = np.random.default_rng(0)
    words = ["thou", "art", "my", "lord", "\n", "\n\n", "KING:\n"]
    text = "".join(rng.choice(words, size=2000)) + "end\n"
    chunks = prepare.chunk_at_lines(text, char_starts(text), 50)
    assert "".join(chunks) == text
    assert max(len(c) for c in chunks) <= 50
    assert min(len(c) for c in chunks[:-1]) >= 25  # at least half full


def test_bad_budget_is_an_error() -> None:
    with pytest.raises(DataError, match="max_tokens must be >= 1"):
        prepare.chunk_at_lines("text\n", char_starts("text\n"), 0)


def _plays() -> dict[str, str]:
    return {
        name: "".join(f"{name.upper()} {i}:\nline {i} of {name}\n\n" for i in range(20))
        for name in ("alpha", "beta", "gamma", "delta")
    }


def test_split_corpus_holds_out_one_play() -> None:
    plays = _plays()
    kwargs = {"max_tokens": 60, "train_chunks": 25, "eval_chunks": 4, "seed": 3}
    train, held_out = prepare.split_corpus(plays, char_starts, **kwargs)
    assert len(train) == 25
    assert len(held_out) == 4
    (eval_play,) = {n for n, text in plays.items() if held_out[0] in text}
    assert all(chunk in plays[eval_play] for chunk in held_out)
    others = "".join(text for n, text in plays.items() if n != eval_play)
    assert all(chunk in others and eval_play not in chunk for chunk in train)
    assert len(set(train)) == len(train)  # drawn without repeats (every chunk here is unique)
    assert len({chunk.split()[0] for chunk in train}) == 3  # a mix of the other three plays
    assert prepare.split_corpus(plays, char_starts, **kwargs) == (train, held_out)
    other = {**kwargs, "seed": 4}
    assert prepare.split_corpus(plays, char_starts, **other) != (train, held_out)


@pytest.mark.parametrize(
    ("train_chunks", "eval_chunks", "what"), [(10_000, 2, "train"), (2, 99, "eval")]
)
def test_split_corpus_too_small_is_an_error(train_chunks: int, eval_chunks: int, what: str) -> None:
    with pytest.raises(DataError, match=f"lower --{what}-chunks"):
        prepare.split_corpus(
            _plays(),
            char_starts,
            max_tokens=60,
            train_chunks=train_chunks,
            eval_chunks=eval_chunks,
            seed=0,
        )


def test_write_jsonl_and_read_plays(tmp_path: Path) -> None:
    texts = ['KING:\n"Speak."\n\n', "QUEEN:\nNo.\n"]
    prepare.write_jsonl(tmp_path / "sub" / "train.jsonl", texts)
    lines = (tmp_path / "sub" / "train.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"text": t} for t in texts]

    (tmp_path / "plays" / "tragedies").mkdir(parents=True)
    (tmp_path / "plays" / "tragedies" / "lear.md").write_text("# Lear\n\n**LEAR**  \nNothing.\n")
    assert prepare.read_plays(tmp_path / "plays") == {"lear": "Lear\n\nLEAR:\nNothing.\n"}
    with pytest.raises(DataError, match="no plays"):
        prepare.read_plays(tmp_path / "sub")


def test_missing_package_names_the_fix() -> None:
    with pytest.raises(
        ModelLoadError, match="'no-such-demo-package' package, which `make demo` installs"
    ):
        prepare.package_path("no-such-demo-package", "x/y.gguf")
    with pytest.raises(ModelLoadError, match=re.escape("numpy/missing.txt not found")):
        prepare.package_path("numpy", "numpy/missing.txt")
