"""``build_batches``: the ``data:`` section and the model → every step's batch, checked up front.

Invariant: everything that can be wrong with the data is found here, before any GPU work:
``seq_len`` above the model's positions, a token id outside its vocabulary, a missing chat
template, eos or pad token, a bad record (named by file:line), an empty data set, over-length
samples under ``over_length: error``.

Example::

    batches = build_batches(
        cfg.data, model_dir=Path(cfg.model.path),
        model=ModelFacts.from_config(adapter.config, adapter.vocab_size),
        batch_size=cfg.train.global_batch_size, seed=cfg.train.seed,
    )
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from slidedp.data.batches import Batches, DataReport
from slidedp.data.config import DataSection, SourceSpec
from slidedp.data.encode import Encoder
from slidedp.data.layout import Rows, pack_rows, pad_rows
from slidedp.data.mixture import SourceShare, held_out, mix
from slidedp.data.samples import OverLengthCounts, Samples, apply_over_length
from slidedp.data.sources import Source
from slidedp.errors import ConfigError, DataError

if TYPE_CHECKING:
    from slidedp.config import TrainConfig

Part = Literal["train", "eval"]


def _first_id(value: Any) -> int | None:
    """A config token id: an int, a list of them (eos in several models: the first), or None."""
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else int(value)


@dataclass(frozen=True)
class ModelFacts:
    """What the data must agree with in the model."""

    vocab_size: int
    max_positions: int | None = None  # config.max_position_embeddings
    pad_id: int | None = None  # config.pad_token_id
    eos_id: int | None = None  # config.eos_token_id (the first one of a list)

    @classmethod
    def from_config(cls, config: Any, vocab_size: int) -> ModelFacts:
        max_positions = getattr(config, "max_position_embeddings", None)
        return cls(
            vocab_size=vocab_size,
            max_positions=None if max_positions is None else int(max_positions),
            pad_id=_first_id(getattr(config, "pad_token_id", None)),
            eos_id=_first_id(getattr(config, "eos_token_id", None)),
        )


def run_batches(
    cfg: TrainConfig, model_config: Any, vocab_size: int, part: Part = "train"
) -> Batches:
    """The batches of the run ``cfg`` describes: ``slidedp train`` trains on them and
    ``slidedp validate`` checks them, so both read the data the same way. ``part="eval"``:
    the held-out set (``data.eval_path``, or the ``data.eval_fraction`` split off)."""
    return build_batches(
        cfg.data,
        model_dir=Path(cfg.model.path),
        model=ModelFacts.from_config(model_config, vocab_size),
        batch_size=cfg.train.global_batch_size,
        seed=cfg.train.seed,
        part=part,
    )


def build_batches(
    section: DataSection,
    *,
    model_dir: Path,
    model: ModelFacts,
    batch_size: int,
    seed: int,
    part: Part = "train",
) -> Batches:
    """Read, tokenize, check and lay out the whole data file (see the module docstring);
    ``part``: the training samples, or the held-out ones (in file order, never mixed)."""
    if model.max_positions is not None and section.seq_len > model.max_positions:
        raise ConfigError(
            f"data.seq_len={section.seq_len} exceeds the model's max_position_embeddings="
            f"{model.max_positions}; lower data.seq_len"
        )
    if section.pad_id >= model.vocab_size:
        raise ConfigError(
            f"data.pad_id={section.pad_id} is outside the vocabulary of {model.vocab_size}"
        )
    if part == "eval" and section.eval_path:
        held = section.eval_path  # the file read as the one source, nothing split off it
        section = replace(section, path=held, sources=[], eval_path="", eval_fraction=0.0)
    read = [_read_source(spec, section, model_dir, model) for spec in section.source_specs()]
    if section.eval_fraction:  # each source's held-out share, drawn by the seed
        read = [
            replace(r, samples=held_out(r.samples, section.eval_fraction, seed, str(r.path))[
                part == "eval"])
            for r in read
        ]  # fmt: skip
    shares: list[SourceShare] = []
    if len(read) == 1 or part == "eval":
        samples = Samples.concat([r.samples for r in read])
    else:
        specs = section.source_specs()
        samples, shares = mix([r.samples for r in read], [s.weight for s in specs],
                              [s.path for s in specs], seed=seed)  # fmt: skip
    lengths = samples.lengths
    rows = pack_rows(lengths, section.seq_len) if section.packing else pad_rows(lengths)
    report = DataReport(
        path=" + ".join(str(r.path) for r in read),
        format="/".join(sorted({r.format for r in read})),
        records=sum(r.records for r in read),
        sequences=len(samples),
        rows=len(rows),
        tokens=int(lengths.sum()),
        label_tokens=int(samples.label_counts().sum()),
        seq_len=section.seq_len,
        packing=section.packing,
        over_length=section.over_length,
        truncated=sum(r.counts.truncated for r in read),
        truncated_tokens=sum(r.counts.truncated_tokens for r in read),
        dropped=sum(r.counts.dropped for r in read),
        unlabeled=sum(r.counts.unlabeled for r in read),
        sources=tuple(shares),
    )
    encoder = next((r.encoder for r in read if r.encoder.loaded_tokenizer), read[0].encoder)
    return Batches(
        samples,
        rows,
        batch_size=batch_size,
        pad_id=_pad_id(section, model, encoder, rows, batch_size),
        packed=section.packing,
        shuffle=section.shuffle and part == "train",
        seed=seed,
        report=report,
    )


@dataclass(frozen=True)
class _Read:
    """One data file read, tokenized and cut to ``seq_len``."""

    path: Path
    format: str
    records: int
    samples: Samples
    counts: OverLengthCounts
    encoder: Encoder


def _read_source(
    spec: SourceSpec, section: DataSection, model_dir: Path, model: ModelFacts
) -> _Read:
    source = Source(Path(spec.path), spec.format)
    encoder = Encoder(
        model_dir,
        vocab_size=model.vocab_size,
        eos_id=model.eos_id,
        packing=section.packing,
        train_on_prompt=section.train_on_prompt,
        where=source.where,
    )
    parts: list[Samples] = []
    data_format = "?"
    for chunk in source.chunks():
        data_format = chunk.format
        parts.append(encoder.encode(chunk))
    read = Samples.concat(parts)
    if not len(read):
        raise DataError(f"{source.path} has no records")
    samples, counts = apply_over_length(read, section.seq_len, section.over_length, source.where)
    if not len(samples):
        raise DataError(
            f"{source.path}: no sample is left of {len(read)} by data.over_length="
            f"{section.over_length} at data.seq_len={section.seq_len} ({counts.dropped} dropped, "
            f"{counts.unlabeled} truncated to nothing to train on); raise data.seq_len"
        )
    return _Read(source.path, data_format, len(read), samples, counts, encoder)


def _pad_id(
    section: DataSection, model: ModelFacts, encoder: Encoder, rows: Rows, batch_size: int
) -> int:
    """data.pad_id, else the tokenizer's pad, the config's pad, the tokenizer's eos, the
    config's eos. Rows of different lengths in a batch need one; equal rows need none (0).
    ``input_ids`` data loads no tokenizer unless the config defines neither pad nor eos."""
    tokenizer = encoder.loaded_tokenizer
    candidates = [
        section.pad_id if section.pad_id >= 0 else None,
        None if tokenizer is None else tokenizer.pad_token_id,
        model.pad_id,
        None if tokenizer is None else tokenizer.eos_token_id,
        model.eos_id,
    ]
    pad = next((int(c) for c in candidates if c is not None), None)
    padding_needed = batch_size > 1 and int(rows.lengths.min()) != int(rows.lengths.max())
    if pad is None and padding_needed and tokenizer is None:
        tokenizer = encoder.optional_tokenizer()
        if tokenizer is not None:
            found = [tokenizer.pad_token_id, tokenizer.eos_token_id]
            pad = next((int(c) for c in found if c is not None), None)
    if pad is None and padding_needed:
        raise DataError(
            f"rows of {section.path or 'data.sources'} differ in length and need padding, but "
            f"no pad or eos token is defined (tokenizer, {encoder.model_dir}/config.json); "
            "set data.pad_id"
        )
    if pad is not None and not 0 <= pad < model.vocab_size:
        raise DataError(f"the pad token id {pad} is outside the vocabulary of {model.vocab_size}")
    return 0 if pad is None else pad  # 0: never written (no padding) — any valid id would do
