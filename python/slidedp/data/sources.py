"""Training records read from one local file, a chunk at a time, with where each one came from.

The file type comes from the extension: ``.jsonl`` (one JSON object per line; blank lines are
allowed), ``.json`` (a list of objects) or ``.parquet`` (pyarrow, imported only for it). The data
format comes from ``data.format`` or, when ``auto``, from the first record's keys (the columns
for Parquet): ``text``; ``messages``; ``prompt`` + ``completion``; ``input_ids``. Every record
must be of the file's format: a record of another one is an error naming its line. Other keys
are ignored, but for an ``input_ids`` record's ``labels`` (``OPTIONAL_KEYS``: the ids with -100
at the tokens not trained on, as transformers lays them out). A chunk holds only the format's
keys, as columns.

Example::

    source = Source(Path("train.jsonl"), "auto", key="data.path")
    for chunk in source.chunks():
        texts = chunk.columns["text"]  # chunk.format == "text"; chunk.numbers: 1-based lines
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from slidedp.errors import DataError

FORMAT_KEYS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "input_ids": ("input_ids",),
}
# read beside a format's keys where a record has them (a record without: every token trains)
OPTIONAL_KEYS: dict[str, tuple[str, ...]] = {"input_ids": ("labels",)}
RECORDS_PER_CHUNK = 4096  # records tokenized in one batched call
_FIX_PATH = "; point data.path (data.sources, data.eval_path) at a readable file"
_UNITS = {".jsonl": "line", ".json": "record", ".parquet": "row"}
# what to do instead of naming a directory, by the config key that names it
_DIRECTORY_FIXES = {
    "data.path": ", or list its files in data.sources (a mixture)",
    "data.eval_path": "",
}


def _json_problem(error: json.JSONDecodeError, line: int | None = None) -> str:
    """``line 3, column 17: Invalid control character`` (without ``line``: a JSONL record's,
    whose line the message names before); the decoder's message ends with " at" where it
    would append the position itself."""
    where = f"column {error.colno}" if line is None else f"line {line}, column {error.colno}"
    return f"{where}: {error.msg.removesuffix(' at')}"


@dataclass(frozen=True)
class TokenColumn:
    """Lists of token ids stored flat (Parquet's list column, without Python ints)."""

    values: npt.NDArray[np.int64]  # [T] every list's ids back to back
    offsets: npt.NDArray[np.int64]  # [n + 1] list i = values[offsets[i] : offsets[i + 1]]


@dataclass(frozen=True)
class Chunk:
    format: str  # a key of FORMAT_KEYS
    columns: dict[str, list[Any] | TokenColumn]  # the format's keys, one value per record
    numbers: npt.NDArray[np.int64]  # [n] 1-based line (.jsonl), record (.json) or row (.parquet)


class Source:
    """One data file; ``chunks()`` reads it (again) from the start. ``key``: the config key
    that names it (``data.path``, ``data.sources[1].path``, ``data.eval_path``), for errors."""

    def __init__(self, path: Path, data_format: str, *, key: str) -> None:
        if path.is_dir():
            fix = _DIRECTORY_FIXES.get(key, ", one source each")
            raise DataError(
                f"{key} {path} is a directory: give one .jsonl/.json/.parquet file{fix}"
            )
        if path.suffix not in _UNITS:
            raise DataError(
                f"{path}: unknown data file type '{path.suffix}' "
                "(expected .jsonl, .json or .parquet)"
            )
        self.path, self.configured = path, data_format
        self.unit = _UNITS[path.suffix]

    def where(self, number: int) -> str:
        """``train.jsonl:12``, ``train.json record 12`` or ``train.parquet row 12``."""
        if self.unit == "line":
            return f"{self.path}:{number}"
        return f"{self.path} {self.unit} {number}"

    def chunks(self) -> Iterator[Chunk]:
        if self.unit == "row":
            yield from self._parquet_chunks()
            return
        records = self._jsonl_records() if self.unit == "line" else self._json_records()
        first: tuple[str, int] | None = None  # the file's format, and where it was seen
        numbers: list[int] = []
        rows: list[dict[str, Any]] = []
        for number, record in records:
            fmt = self._record_format(number, record)
            if first is None:
                first = (fmt, number)
            elif fmt != first[0]:
                raise DataError(
                    f"{self.where(number)}: a '{fmt}' record in a '{first[0]}' file (the format "
                    f"of {self.where(first[1])}); one data format per file"
                )
            numbers.append(number)
            rows.append(record)
            if len(rows) == RECORDS_PER_CHUNK:
                yield self._chunk(first[0], rows, numbers)
                numbers, rows = [], []
        if rows:
            assert first is not None
            yield self._chunk(first[0], rows, numbers)

    def _chunk(self, fmt: str, rows: list[dict[str, Any]], numbers: list[int]) -> Chunk:
        columns: dict[str, list[Any] | TokenColumn] = {
            key: [r[key] for r in rows] for key in FORMAT_KEYS[fmt]
        }
        for key in OPTIONAL_KEYS.get(fmt, ()):
            if any(key in r for r in rows):
                columns[key] = [r.get(key) for r in rows]
        return Chunk(fmt, columns, np.asarray(numbers, dtype=np.int64))

    def _resolve_format(self, keys: list[str], where: str) -> str:
        """The data format of a record (or of the Parquet columns) with these keys."""
        if self.configured != "auto":
            missing = [k for k in FORMAT_KEYS[self.configured] if k not in keys]
            if missing:
                raise DataError(f"{where}: data.format={self.configured} needs '{missing[0]}'")
            return self.configured
        found = [f for f, ks in FORMAT_KEYS.items() if any(k in keys for k in ks)]
        if not found:
            raise DataError(
                f"{where}: expected a 'text', 'messages', 'prompt'+'completion' or 'input_ids' "
                f"key, found {sorted(keys)}"
            )
        if len(found) > 1:
            raise DataError(
                f"{where}: the keys {sorted(keys)} fit several data formats "
                f"({', '.join(found)}); set data.format to the one to use"
            )
        present = [k for k in FORMAT_KEYS[found[0]] if k in keys]
        missing = [k for k in FORMAT_KEYS[found[0]] if k not in keys]
        if missing:
            raise DataError(f"{where}: has {present[0]!r} but no {missing[0]!r}")
        return found[0]

    def _record_format(self, number: int, record: Any) -> str:
        if not isinstance(record, dict):
            raise DataError(
                f"{self.where(number)}: expected a JSON object, got {type(record).__name__}"
            )
        return self._resolve_format(list(record), self.where(number))

    def _jsonl_records(self) -> Iterator[tuple[int, Any]]:
        try:
            with self.path.open("rb") as f:
                for number, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        yield number, json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(
                            f"{self.where(number)}: not valid JSON ({_json_problem(e)})"
                        ) from None
                    except UnicodeDecodeError:
                        raise DataError(f"{self.where(number)}: not valid UTF-8") from None
        except OSError as e:
            raise DataError(f"cannot read data {self.path}: {e.strerror}{_FIX_PATH}") from None

    def _json_records(self) -> Iterator[tuple[int, Any]]:
        try:
            document = json.loads(self.path.read_bytes())
        except OSError as e:
            raise DataError(f"cannot read data {self.path}: {e.strerror}{_FIX_PATH}") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{self.path}: not valid JSON ({_json_problem(e, e.lineno)})") from None
        except UnicodeDecodeError:
            raise DataError(f"{self.path}: not valid UTF-8") from None
        if not isinstance(document, list):
            raise DataError(
                f"{self.path}: a .json data file must hold a list of records, got "
                f"{type(document).__name__} (use .jsonl for one object per line)"
            )
        yield from enumerate(document, start=1)

    def _parquet_chunks(self) -> Iterator[Chunk]:
        try:
            import pyarrow as pa  # noqa: PLC0415  optional: Parquet data only
            import pyarrow.parquet as pq  # noqa: PLC0415  optional: Parquet data only
        except ImportError:
            raise DataError(
                f"{self.path}: reading Parquet needs pyarrow: pip install 'slidedp[parquet]'"
            ) from None
        try:
            parquet = pq.ParquetFile(self.path)
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"cannot read data {self.path}: {e}{_FIX_PATH}") from None
        names = parquet.schema_arrow.names
        fmt = self._resolve_format(names, f"{self.path} (columns)")
        keys = FORMAT_KEYS[fmt] + tuple(k for k in OPTIONAL_KEYS.get(fmt, ()) if k in names)
        first_row = 1
        for batch in parquet.iter_batches(batch_size=RECORDS_PER_CHUNK, columns=list(keys)):
            numbers = np.arange(first_row, first_row + batch.num_rows, dtype=np.int64)
            first_row += batch.num_rows
            columns: dict[str, list[Any] | TokenColumn] = {}
            for key in keys:
                column = batch.column(key)
                if key in OPTIONAL_KEYS.get(fmt, ()) and column.null_count:
                    columns[key] = column.to_pylist()  # a null row: no labels, as in JSON
                elif fmt == "input_ids":
                    columns[key] = self._token_column(column, numbers, key)
                else:
                    columns[key] = column.to_pylist()
            yield Chunk(fmt, columns, numbers)

    def _token_column(self, column: Any, numbers: npt.NDArray[np.int64], key: str) -> TokenColumn:
        """A Parquet list-of-integers column as flat arrays (zero-copy where arrow allows)."""
        import pyarrow as pa  # noqa: PLC0415  optional: Parquet data only

        kind = column.type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not (
            pa.types.is_integer(kind.value_type)
        ):
            raise DataError(f"{self.path}: column {key} must be a list of integers, got {kind}")
        if column.null_count:
            row = int(numbers[np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0]])
            raise DataError(f"{self.where(row)}: {key} is null")
        offsets = column.offsets.to_numpy().astype(np.int64)
        values = column.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        if values.null_count:
            null_at = np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0]
            row = numbers[np.searchsorted(offsets - offsets[0], null_at, side="right") - 1]
            raise DataError(f"{self.where(int(row))}: {key} holds a null token id")
        return TokenColumn(values.to_numpy().astype(np.int64), offsets - offsets[0])
