"""Reading a prompt dataset: a JSONL or Parquet file by URI (`file://`, a mounted `pvc://`, or an
object store through storage.py), into a list of rows (dicts of JSON-like values).

Parquet is read with pyarrow. JSONL is read line by line with the standard library rather than
pyarrow's reader: its rows need not share one schema (an `answer` that is a number in one row and a
string in the next is common in prompt data), and a bad line is reported with its line number. The
whole dataset is held in the coordinator's memory; prompt sets are small next to model weights.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow.parquet as pq

from polyrl_runtime import storage
from polyrl_runtime.data import reasoning_gym

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


class DataError(ValueError):
    """A data source that cannot be read or has no usable rows; the message names the URI."""


def data_format(uri: str) -> str:
    """'jsonl' or 'parquet', by the file's suffix."""
    for suffix, fmt in FORMATS.items():
        if uri.endswith(suffix):
            return fmt
    raise DataError(f"{uri}: unknown data format (expected a file ending in {', '.join(FORMATS)})")


def _read(uri: str) -> bytes:
    try:
        if storage.is_object_store(uri):
            return storage.read_bytes(uri)
        return storage.local_path(uri).read_bytes()
    except (OSError, ValueError, storage.StorageError) as e:
        raise DataError(f"{uri}: cannot read the data file: {e}") from e


def parse_jsonl(uri: str, data: bytes) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{uri} line {n}: not valid JSON: {e}") from e
        if not isinstance(row, dict):
            raise DataError(f"{uri} line {n}: a row must be a JSON object, not {type(row).__name__}")
        rows.append(row)
    return rows


def parse_parquet(uri: str, data: bytes) -> list[dict[str, Any]]:
    try:
        table = pq.read_table(io.BytesIO(data))
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a corrupt file
        raise DataError(f"{uri}: not a readable Parquet file: {e}") from e
    return [dict(r) for r in table.to_pylist()]


def load_rows(uri: str) -> list[dict[str, Any]]:
    """Every row of the JSONL or Parquet file at `uri`, or of the reasoning-gym dataset a
    `reasoning-gym://` URI names; DataError names the URI (and line) on any problem, including a
    file with no rows."""
    if reasoning_gym.is_reasoning_gym(uri):
        return reasoning_gym.rows(uri, DataError)
    fmt = data_format(uri)
    data = _read(uri)
    rows = parse_jsonl(uri, data) if fmt == "jsonl" else parse_parquet(uri, data)
    if not rows:
        raise DataError(f"{uri}: the data file has no rows")
    return rows
