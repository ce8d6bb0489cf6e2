"""One row of a prompt dataset as a workflow sees it: a read-only mapping that knows where it came
from, so that a missing field is reported with the file and the row index."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RowRef:
    """What the coordinator sends a workflow worker with a group: the source URI, the row's index in
    it and its fields (JSON-like values)."""

    source: str
    index: int
    fields: Mapping[str, Any]

    @property
    def row_id(self) -> str:
        return f"{self.source}#{self.index}"


class Row(Mapping[str, Any]):
    """`ctx.sample`: the row's fields, read-only; `row[missing]` raises a KeyError naming the source
    file, the row index and the fields the row has."""

    __slots__ = ("_fields", "index", "source")

    def __init__(self, ref: RowRef) -> None:
        self.source = ref.source
        self.index = ref.index
        self._fields = dict(ref.fields)

    def __getitem__(self, key: str) -> Any:
        try:
            return self._fields[key]
        except KeyError:
            raise KeyError(
                f"{self.source} row {self.index}: no field {key!r} (the row has {sorted(self._fields)})"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        return f"Row({self.source}#{self.index}, {self._fields!r})"
