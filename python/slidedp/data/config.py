"""The ``data:`` section of the training config (owned by the data package).

Example (YAML)::

    data:
      path: ./data/chat.jsonl    # .jsonl, .json (a list of records) or .parquet
      seq_len: 2048
      packing: true              # false: one sample per row, right-padded
      over_length: truncate      # truncate | drop | error (counts are reported)
      shuffle: true              # a seeded permutation per epoch (train.seed)

A mixture instead of one file: ``sources: [{path: ..., weight: 3}, {path: ..., format: text,
weight: 1}]`` (docs/configuration.md, key ``data.sources``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slidedp.errors import require as _require

DATA_FORMATS = ("auto", "text", "messages", "prompt_completion", "input_ids")
OVER_LENGTH_POLICIES = ("truncate", "drop", "error")


SOURCE_KEYS = ("path", "format", "weight")
# the data keys besides the files' formats and weights that decide the samples of each step
_ORDER_KEYS = (
    "seq_len",
    "packing",
    "over_length",
    "shuffle",
    "train_on_prompt",
    "pad_id",
    "eval_fraction",
)


@dataclass(frozen=True)
class SourceSpec:
    """One data file of the run: its path, format and mixture weight."""

    path: str
    format: str = "auto"
    weight: float = 1.0
    key: str = "data.path"  # the config key that names it (data.sources[1].path), for errors


@dataclass(kw_only=True)
class DataSection:
    path: str = ""  # a local .jsonl, .json or .parquet file (or `sources`, not both)
    # a mixture (data.mixture): a list of {path, format (default: data.format), weight
    # (default 1)}; each source's share of an epoch's samples is its weight over their sum
    sources: list[dict[str, Any]] = field(default_factory=list)
    # auto: from the record keys (text | messages | prompt+completion | input_ids); set it when a
    # record carries the keys of several formats
    format: str = "auto"
    seq_len: int = 1024  # tokens per row at most
    packing: bool = False  # pack several samples per row (attention kept inside each sample)
    # a sample longer than seq_len: truncate (keep the first seq_len tokens; the default, as
    # transformers' and TRL's max_length truncation), drop, or error
    over_length: str = "truncate"
    shuffle: bool = False  # False: file order (packing: rows in order of their first sample)
    train_on_prompt: bool = False  # messages / prompt+completion: loss on every token
    pad_id: int = -1  # -1: the tokenizer's pad, else the model config's, else eos
    # held-out data for train.eval_steps (runtime.evaluate): a file of its own, or the share
    # of the training samples split off it (of each source's), drawn by train.seed
    eval_path: str = ""
    eval_fraction: float = 0.0

    def __post_init__(self) -> None:
        _require(
            not (self.path and self.sources),
            "data.path and data.sources are both given: use data.path for one file or "
            "data.sources for a mixture of files, not both",
        )
        _require(
            bool(self.path or self.sources),
            "data.path is required (one file), or data.sources (a list of {path, format, weight})",
        )
        _require(
            0.0 <= self.eval_fraction < 1.0,
            f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}",
        )
        _require(
            not (self.eval_path and self.eval_fraction),
            "data.eval_path and data.eval_fraction are both given: evaluate on a file of its "
            "own or on a share split off the training data, not both",
        )
        for i, source in enumerate(self.sources):
            _check_source(i, source, self.format)
        # as a shell would: ~/data/x.jsonl
        self.path, self.eval_path = (
            os.path.expanduser(self.path),
            os.path.expanduser(self.eval_path),
        )
        self.sources = [
            s | {"path": os.path.expanduser(s["path"])} if _has_path(s) else s for s in self.sources
        ]
        _check_no_source_twice(self.sources)
        trained = {Path(spec.path).resolve() for spec in self.source_specs()}
        _require(
            not self.eval_path or Path(self.eval_path).resolve() not in trained,
            f"data.eval_path {self.eval_path} is a file the run trains on: the evaluation "
            "would measure training data; give a file of its own, or data.eval_fraction",
        )
        _require(self.seq_len >= 2, f"data.seq_len must be >= 2, got {self.seq_len}")
        _require(
            self.format in DATA_FORMATS,
            f"data.format must be one of {', '.join(DATA_FORMATS)}, got {self.format!r}",
        )
        _require(
            self.over_length in OVER_LENGTH_POLICIES,
            f"data.over_length must be one of {', '.join(OVER_LENGTH_POLICIES)}, "
            f"got {self.over_length!r}",
        )
        _require(self.pad_id >= -1, f"data.pad_id must be >= 0 (or -1: auto), got {self.pad_id}")

    def order_keys(self) -> dict[str, Any]:
        """What decides which samples of the files train, in which order, and which are held
        out: a checkpoint keeps it, and a resume refuses a change. Not the paths: a dataset
        moved resumes (and a file replaced resumes on what the file then holds)."""
        return {
            "sources": [{"format": s.format, "weight": s.weight} for s in self.source_specs()],
            **{key: getattr(self, key) for key in _ORDER_KEYS},
        }

    def checkpoint_record(self, next_step: int) -> dict[str, Any]:
        """What a checkpoint keeps of the data: the files, ``order_keys`` and the next step."""
        return {
            "path": self.path,
            "sources": self.sources,
            "order": self.order_keys(),
            "next_step": next_step,
        }

    @property
    def has_eval(self) -> bool:
        """Whether held-out data is configured (``eval_path`` or ``eval_fraction``)."""
        return bool(self.eval_path or self.eval_fraction)

    def source_specs(self) -> list[SourceSpec]:
        """The data files of the run: ``path`` alone, or every entry of ``sources``."""
        if self.path:
            return [SourceSpec(self.path, self.format)]
        return [
            SourceSpec(
                s["path"],
                s.get("format", self.format),
                float(s.get("weight", 1.0)),
                key=f"data.sources[{i}].path",
            )
            for i, s in enumerate(self.sources)
        ]


def _has_path(source: Any) -> bool:
    """A source entry with a path (a problem with another is collected by ``_check_source``)."""
    return isinstance(source, dict) and isinstance(source.get("path"), str)


def _check_source(i: int, source: Any, default_format: str) -> None:
    """``data.sources[i]``: a mapping of path (required), format and weight (> 0)."""
    where = f"data.sources[{i}]"
    if not isinstance(source, dict):
        _require(False, f"{where} must be a mapping {{path, format, weight}}, got {source!r}")
        return
    unknown = sorted(set(source) - set(SOURCE_KEYS))
    _require(not unknown, f"{where} has unknown key(s) {unknown}: use {', '.join(SOURCE_KEYS)}")
    path = source.get("path")
    _require(isinstance(path, str) and bool(path), f"{where}.path is required (a data file)")
    fmt = source.get("format", default_format)
    _require(
        fmt in DATA_FORMATS,
        f"{where}.format must be one of {', '.join(DATA_FORMATS)}, got {fmt!r}",
    )
    weight = source.get("weight", 1.0)
    _require(
        _finite_number(weight) and weight > 0,
        f"{where}.weight must be a finite number > 0, got {weight!r}",
    )


def _check_no_source_twice(sources: list[dict[str, Any]]) -> None:
    """Each file once: a file listed twice would be sampled as two sources."""
    first_index: dict[Path, int] = {}
    for i, source in enumerate(sources):
        if not _has_path(source):  # reported by _check_source
            continue
        resolved = Path(source["path"]).resolve()
        first = first_index.setdefault(resolved, i)
        _require(
            first == i,
            f"data.sources lists {resolved} twice (data.sources[{first}] and [{i}]): give it "
            "once with a larger weight",
        )


def _finite_number(value: Any) -> bool:
    """A finite int or float (not a bool; not an integer beyond a float's range)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
