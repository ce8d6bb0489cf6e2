"""Prompt data: the rows of a job's `spec.data` sources (sources.py) and the read-only view of one
row that a workflow gets as `ctx.sample` (row.py)."""

from polyrl_runtime.data.row import Row, RowRef
from polyrl_runtime.data.sources import DataError, load_rows

__all__ = ["DataError", "Row", "RowRef", "load_rows"]
