"""The per-step metrics series of a job, kept where it outlives the process that writes it.

One writer for every place a job runs: `polyrl run` writes `<out>/metrics.jsonl`; a coordinator pod
writes `<checkpoint root>/metrics/` (next to the checkpoints, so the series survives the pod).

- A local directory (a path, `file://`, a mounted `pvc://`) can append: one `metrics.jsonl`, each
  row appended and flushed as it comes, so a killed process loses nothing it reported.
- An object store (`s3://`) cannot append: rows go to rolling part files `part-NNNNN.jsonl`. The
  current part is rewritten whole at each flush (every `flush_s`, before each checkpoint commits, and
  at the end) and a new part starts after `part_rows` rows, so a flush costs at most one small PUT
  however long the job runs. Rows since the last flush are lost with the pod; they belong to steps
  after the last checkpoint, which the resumed job trains (and reports) again.

A resumed job continues the same series: `open` keeps the rows of the steps the checkpoint holds
(step <= that policy's step there), one row per (policy, step), the last one written winning, and
drops the rest, so no step appears twice. Readers (`read_metrics`) apply the same rule, so a crash in
the middle of that rewrite leaves nothing a reader would see twice.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import IO, Any

import structlog

from polyrl_runtime import storage

log = structlog.get_logger(__name__)

LOCAL_NAME = "metrics.jsonl"
_PART = re.compile(r"^part-(\d{5,})\.jsonl$")


def _parse(text: str, where: str) -> list[dict[str, Any]]:
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            # The last line of a local file cut short by a killed process: the rest is intact.
            log.warning("metrics.unreadable_line", file=where, line=i)
    return rows


def _parts(directory: str) -> list[tuple[int, str]]:
    found = []
    for name in storage.list_names(directory):
        m = _PART.match(name)
        if m is not None:
            found.append((int(m.group(1)), storage.join(directory, name)))
    return sorted(found)


def unique_rows(rows: list[dict[str, Any]], steps: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """One row per (policy, step), the last written winning, in step order per policy as written;
    with `steps`, only the rows of steps up to each policy's step there (a policy absent: none)."""
    last: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        key = (str(row["policy"]), int(row["step"]))
        if steps is None or key[1] <= steps.get(key[0], 0):
            last.pop(key, None)
            last[key] = row
    return sorted(last.values(), key=lambda r: (int(r["step"]), str(r["policy"])))


def read_metrics(directory: str | Path) -> list[dict[str, Any]]:
    """Every row of the series in `directory` (local file or part files), one per (policy, step)."""
    d = str(directory)
    if not storage.is_object_store(d):
        path = Path(d) / LOCAL_NAME
        return unique_rows(_parse(path.read_text(), str(path))) if path.is_file() else []
    rows: list[dict[str, Any]] = []
    for _, uri in _parts(d):
        rows += _parse(storage.read_bytes(uri).decode(), uri)
    return unique_rows(rows)


class MetricsFile:
    """Appends rows to the series in `directory`; see the module docstring for the layout."""

    def __init__(self, directory: str | Path, *, flush_s: float = 10.0, part_rows: int = 500) -> None:
        self.directory = str(directory)
        self.remote = storage.is_object_store(self.directory)
        self.flush_s, self.part_rows = flush_s, part_rows
        self._lock = threading.Lock()  # flushes run in threads; rows are added from the event loop
        self._file: IO[str] | None = None
        self._part = 0
        self._part_rows: list[str] = []  # the current part's rows (object store)
        self._dirty = False
        self._flushed = time.monotonic()
        self.kept: list[dict[str, Any]] = []  # the rows `open` kept: the series before this run

    def open(self, steps: dict[str, int]) -> int:
        """Start writing after the rows of `steps` (each policy's step in the checkpoint the job
        resumes from; {} for a fresh start): later rows are dropped. The number of rows kept."""
        if not self.remote:
            path = Path(self.directory) / LOCAL_NAME
            path.parent.mkdir(parents=True, exist_ok=True)
            old = _parse(path.read_text(), str(path)) if path.is_file() else []
            kept = self.kept = unique_rows(old, steps)
            if kept != old:
                tmp = path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
                os.replace(tmp, path)
            self._file = path.open("a")
            return len(kept)
        parts = _parts(self.directory)
        old = []
        for _, uri in parts:
            old += _parse(storage.read_bytes(uri).decode(), uri)
        kept = self.kept = unique_rows(old, steps)
        self._part_rows = [json.dumps(r) + "\n" for r in kept]
        if len(parts) == 1 and kept == old:
            self._part = parts[0][0]  # continue the one part there is
        elif parts:
            self._part = parts[-1][0] + 1
            # The kept rows as one new part first, then the old parts go: a crash in between
            # leaves duplicates that readers drop, never a gap.
            self._write_part()
            for _, uri in parts:
                storage.remove_file(uri)
        return len(kept)

    def add(self, row: dict[str, Any]) -> bool:
        """Add one row; True when a flush is due (the caller runs `flush`, off the event loop)."""
        line = json.dumps(row) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self._file.flush()
                return False
            self._part_rows.append(line)
            self._dirty = True
            return time.monotonic() - self._flushed >= self.flush_s

    def flush(self) -> None:
        """Store the rows added since the last flush (object store; a local file is always flushed)."""
        with self._lock:
            if self._file is not None or not self._dirty:
                return
            self._write_part()
            if len(self._part_rows) >= self.part_rows:
                self._part += 1
                self._part_rows = []

    def _write_part(self) -> None:
        uri = storage.join(self.directory, f"part-{self._part:05d}.jsonl")
        storage.write_bytes(uri, "".join(self._part_rows).encode())
        self._dirty = False
        self._flushed = time.monotonic()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
