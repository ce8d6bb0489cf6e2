"""Reading prompt data: JSONL and Parquet, from a file or an object store, and the errors."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polyrl_runtime import storage
from polyrl_runtime.data import DataError, Row, RowRef, load_rows

ROWS = [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+3=", "answer": "5"}, {"prompt": "x", "answer": 0.5}]


def jsonl_bytes(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def parquet_bytes(rows: list[dict[str, Any]]) -> bytes:
    out = io.BytesIO()
    pq.write_table(
        pa.Table.from_pylist([{"prompt": r["prompt"], "answer": str(r["answer"])} for r in rows]), out
    )
    return out.getvalue()


@pytest.mark.parametrize(
    ("name", "data", "expected"),
    [
        ("d.jsonl", jsonl_bytes(ROWS), ROWS),  # mixed answer types in one file are fine
        ("d.json", b'{"a": 1}\n\n{"a": 2}\n', [{"a": 1}, {"a": 2}]),  # blank lines skipped
        (
            "d.parquet",
            parquet_bytes(ROWS),
            [{"prompt": r["prompt"], "answer": str(r["answer"])} for r in ROWS],
        ),
    ],
)
def test_load_local(tmp_path: Path, name: str, data: bytes, expected: list[dict[str, Any]]) -> None:
    (tmp_path / name).write_bytes(data)
    assert load_rows(f"file://{tmp_path / name}") == expected


@pytest.mark.parametrize("name", ["d.jsonl", "d.parquet"])
def test_load_from_s3(bucket: str, name: str) -> None:
    data = jsonl_bytes(ROWS) if name.endswith("jsonl") else parquet_bytes(ROWS)
    uri = f"s3://{bucket}/prompts/{name}"
    storage.write_bytes(uri, data)
    assert [r["prompt"] for r in load_rows(uri)] == [r["prompt"] for r in ROWS]


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("d.jsonl", b'{"a": 1}\n{"a": \n', r"d.jsonl line 2: not valid JSON"),
        ("d.jsonl", b'{"a": 1}\n[1, 2]\n', r"d.jsonl line 2: a row must be a JSON object, not list"),
        ("d.jsonl", b"\n\n", r"d.jsonl: the data file has no rows"),
        ("d.parquet", b"not parquet", r"d.parquet: not a readable Parquet file"),
        ("d.csv", b"a,b\n", r"d.csv: unknown data format"),
    ],
)
def test_bad_files_name_the_uri(tmp_path: Path, name: str, data: bytes, message: str) -> None:
    (tmp_path / name).write_bytes(data)
    with pytest.raises(DataError, match=message):
        load_rows(f"file://{tmp_path / name}")


def test_missing_file_names_the_uri(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=rf"file://{tmp_path}/absent.jsonl: cannot read the data file"):
        load_rows(f"file://{tmp_path}/absent.jsonl")


def test_missing_object_names_the_uri(bucket: str) -> None:
    with pytest.raises(DataError, match=rf"s3://{bucket}/absent.jsonl: cannot read"):
        load_rows(f"s3://{bucket}/absent.jsonl")


def test_row_is_read_only_and_names_file_and_index_for_a_missing_field() -> None:
    row = Row(RowRef("file:///data/train.jsonl", 7, {"question": "q"}))
    assert dict(row) == {"question": "q"} and len(row) == 1
    with pytest.raises(
        KeyError, match=r"file:///data/train.jsonl row 7: no field 'prompt' \(the row has \['question'\]\)"
    ):
        row["prompt"]
    with pytest.raises(TypeError):
        row["x"] = 1  # type: ignore[index]
