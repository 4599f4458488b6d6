"""``build_data``: the ``data:`` section and the model → every step's batch (and the held-out
batches), checked up front.

Invariant: everything that can be wrong with the data is found here, before any GPU work:
``seq_len`` above the model's positions, a token id outside its vocabulary, a missing chat
template, eos or pad token, a bad record (named by file:line), an empty data set, over-length
samples under ``over_length: error``.

Every file is read once: ``data.eval_fraction`` splits the samples read, so the training and
the held-out batches come from one call.

Example::

    train, held = build_data(
        cfg.data, model_dir=Path(cfg.model.path),
        model=ModelFacts.from_config(adapter.config, adapter.vocab_size),
        batch_size=cfg.train.global_batch_size, seed=cfg.train.seed,
    )  # held: None without data.eval_path / data.eval_fraction
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
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


def run_data(
    cfg: TrainConfig, model_config: Any, vocab_size: int
) -> tuple[Batches, Batches | None]:
    """The training batches of the run ``cfg`` describes and its held-out ones (None: no
    ``data.eval_path`` / ``data.eval_fraction``): ``slidedp train`` trains on them and
    ``slidedp validate`` checks them, so both read the data the same way, each file once."""
    return build_data(
        cfg.data,
        model_dir=Path(cfg.model.path),
        model=ModelFacts.from_config(model_config, vocab_size),
        batch_size=cfg.train.global_batch_size,
        seed=cfg.train.seed,
    )


def build_data(
    section: DataSection, *, model_dir: Path, model: ModelFacts, batch_size: int, seed: int
) -> tuple[Batches, Batches | None]:
    """Read, tokenize, check and lay out the training data (see the module docstring) and the
    held-out data (in file order, never mixed; None when none is configured)."""
    check_model_fit(section, model)
    train, held = _read_training_files(section, model_dir, model, seed)
    lay_out = partial(_lay_out, model=model, batch_size=batch_size, seed=seed)
    batches = lay_out(train, section, part="train")
    if held is not None:  # data.eval_fraction: split off the samples just read
        return batches, lay_out(held, section, part="eval")
    if section.eval_path:
        eval_section, held = _read_eval_file(section, model_dir, model)
        return batches, lay_out(held, eval_section, part="eval")
    return batches, None


def check_model_fit(section: DataSection, model: ModelFacts) -> None:
    """``data.seq_len`` and ``data.pad_id`` against the model (before any file is read)."""
    if model.max_positions is not None and section.seq_len > model.max_positions:
        raise ConfigError(
            f"data.seq_len={section.seq_len} exceeds the model's max_position_embeddings="
            f"{model.max_positions}; lower data.seq_len, or raise model.max_position_embeddings "
            "with model.rope_scaling (e.g. YaRN: docs/long-context.md)"
        )
    if section.pad_id >= model.vocab_size:
        raise ConfigError(
            f"data.pad_id={section.pad_id} is outside the vocabulary of {model.vocab_size}"
        )


@dataclass(frozen=True)
class _Read:
    """One data file read, tokenized and cut to ``seq_len``."""

    spec: SourceSpec
    format: str
    records: int
    samples: Samples
    counts: OverLengthCounts
    encoder: Encoder

    @property
    def path(self) -> Path:
        return Path(self.spec.path)


def _read_training_files(
    section: DataSection, model_dir: Path, model: ModelFacts, seed: int
) -> tuple[list[_Read], list[_Read] | None]:
    """Every source read; with ``data.eval_fraction``, (the training share of each, the
    held-out share of each), drawn by the seed, else (all of them, None)."""
    read = [_read_source(spec, section, model_dir, model) for spec in section.source_specs()]
    if not section.eval_fraction:
        return read, None
    splits = [held_out(r.samples, section.eval_fraction, seed, str(r.path)) for r in read]
    return (
        [replace(r, samples=train) for r, (train, _) in zip(read, splits, strict=True)],
        [replace(r, samples=held) for r, (_, held) in zip(read, splits, strict=True)],
    )


def _read_eval_file(
    section: DataSection, model_dir: Path, model: ModelFacts
) -> tuple[DataSection, list[_Read]]:
    """``data.eval_path`` read as the one source of a section of its own (nothing split off)."""
    eval_section = replace(
        section, path=section.eval_path, sources=[], eval_path="", eval_fraction=0.0
    )
    spec = SourceSpec(section.eval_path, section.format, key="data.eval_path")
    return eval_section, [_read_source(spec, eval_section, model_dir, model)]


def _lay_out(
    read: list[_Read],
    section: DataSection,
    model: ModelFacts,
    batch_size: int,
    seed: int,
    part: Part,
) -> Batches:
    """The samples read into rows and batches: a mixture's sources mixed by weight (training
    only), padded or packed, with the data report."""
    shares: list[SourceShare] = []
    if len(read) == 1 or part == "eval":
        samples = Samples.concat([r.samples for r in read])
    else:
        samples, shares = mix([r.samples for r in read], [r.spec.weight for r in read],
                              [r.spec.path for r in read], seed=seed)  # fmt: skip
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


def _read_source(
    spec: SourceSpec, section: DataSection, model_dir: Path, model: ModelFacts
) -> _Read:
    source = Source(Path(spec.path), spec.format, key=spec.key)
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
        raise DataError(
            f"{source.path} has no records (it is empty, blank or an empty list): add records "
            "to it, or "
            f"point {spec.key} at the data file"
        )
    samples, counts = apply_over_length(read, section.seq_len, section.over_length, source.where)
    if not len(samples):
        raise DataError(
            f"{source.path}: no sample is left of {len(read)} by data.over_length="
            f"{section.over_length} at data.seq_len={section.seq_len} ({counts.dropped} dropped, "
            f"{counts.unlabeled} truncated to nothing to train on); raise data.seq_len"
        )
    return _Read(spec, data_format, len(read), samples, counts, encoder)


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
