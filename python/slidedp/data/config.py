"""The ``data:`` section of the training config (owned by the data package).

Example (YAML)::

    data:
      path: ./data/chat.jsonl    # .jsonl, .json (a list of records) or .parquet
      seq_len: 2048
      packing: true              # false: one sample per row, right-padded
      over_length: truncate      # truncate | drop | error (counts are reported)
      shuffle: true              # a seeded permutation per epoch (train.seed)
"""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.errors import require as _require

DATA_FORMATS = ("auto", "text", "messages", "prompt_completion", "input_ids")
OVER_LENGTH_POLICIES = ("truncate", "drop", "error")


@dataclass(kw_only=True)
class DataSection:
    path: str  # a local .jsonl, .json or .parquet file
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

    def __post_init__(self) -> None:
        _require(bool(self.path), "data.path is required")
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
