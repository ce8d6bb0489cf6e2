"""Where each step's record goes: the in-memory list the run's summary reports, the JSONL series
that outlives the process (files.py), the job's sinks (sinks.py) and the caller's
`on_record` (the local display).

Files and sinks do I/O, so they run in threads, off the driver's event loop; a failing sink is
disabled (sinks.py), and a failing metrics file only logs: training never stops for its metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import structlog

from polyrl_operator.api import RLJob
from polyrl_runtime import storage
from polyrl_runtime.coordinator.failures import JobFailedError
from polyrl_runtime.coordinator.metrics.files import MetricsFile
from polyrl_runtime.coordinator.metrics.records import SeriesEnds, StepRecord
from polyrl_runtime.coordinator.metrics.sinks import GuardedSink, SinkError, build_sink

log = structlog.get_logger(__name__)


class MetricsOptions(Protocol):
    """The driver's options the log reads (coordinator/job_state.py `DriverOptions`). A protocol, not
    that class: job_state uses this package's records, so the package must not import it back."""

    @property
    def out_dir(self) -> Path: ...

    @property
    def checkpoint_root(self) -> Path | str: ...

    @property
    def metrics_dir(self) -> Path | str | None: ...

    @property
    def on_record(self) -> Callable[[StepRecord], None] | None: ...


def metrics_dir(opts: MetricsOptions) -> str:
    """`opts.metrics_dir`, else `<checkpoint root>/metrics` (next to the checkpoints)."""
    if opts.metrics_dir is not None:
        return str(opts.metrics_dir)
    return storage.join(opts.checkpoint_root, "metrics")


class MetricsLog:
    """The per-step records of one run and everywhere they are written."""

    def __init__(self, job: RLJob, opts: MetricsOptions) -> None:
        self.job, self.opts = job, opts
        self.directory = metrics_dir(opts)
        self.records: list[StepRecord] = []
        self.ends = SeriesEnds()  # the whole series': the rows before this run, then its records
        self.file = MetricsFile(self.directory)
        self.sinks: list[GuardedSink] = []
        self._opened = False

    async def open(self, steps: dict[str, int]) -> None:
        """Continue the series after `steps` (the checkpoint's step per policy; {}: a fresh start)
        and start the job's sinks. A sink whose package is missing fails the job (a fix to the
        image or the spec); one whose server cannot be reached is left out, with a warning.

        The sinks start first: a job that fails here leaves the series as it was (a fresh start
        would empty it)."""
        cfg = self.job.spec.metrics
        resume_step = min(steps.values()) if steps else 0
        for i, sink_cfg in enumerate(cfg.sinks):
            try:
                sink = await asyncio.to_thread(
                    build_sink, sink_cfg, self.job, self.directory, Path(self.opts.out_dir), resume_step
                )
            except SinkError as e:
                raise JobFailedError(str(e), retryable=False) from e
            except Exception as e:
                error = (str(e).splitlines() or [repr(e)])[0][:300]
                log.warning("metrics.sink_unavailable", sink=sink_cfg.type, index=i, error=error)
                continue
            self.sinks.append(GuardedSink(sink, cfg.max_sink_failures))
            log.info("metrics.sink", sink=sink_cfg.type)
        kept = await asyncio.to_thread(self.file.open, steps)
        self._opened = True
        for row in self.file.kept:
            self.ends.add(row)
        log.info("metrics.series", directory=self.directory, rows_kept=kept)

    async def add(self, rec: StepRecord) -> None:
        self.records.append(rec)
        row = rec.row()
        self.ends.add(row)
        if self.opts.on_record is not None:
            self.opts.on_record(rec)
        if not self._opened:
            return
        try:
            if self.file.add(row):
                await asyncio.to_thread(self.file.flush)
        except Exception as e:
            log.warning("metrics.write_failed", directory=self.directory, step=rec.step, error=str(e))
        for sink in self.sinks:
            await asyncio.to_thread(sink.log, row)

    def flush(self) -> None:
        """Store what the series and the sinks hold (before each checkpoint; blocking: a thread)."""
        if not self._opened:
            return
        try:
            self.file.flush()
        except Exception as e:
            log.warning("metrics.write_failed", directory=self.directory, error=str(e))
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []  # started even when the series never opened (a failure)
        for sink in sinks:
            sink.close()
        if not self._opened:
            return
        self._opened = False
        try:
            self.file.close()
        except Exception as e:
            log.warning("metrics.write_failed", directory=self.directory, error=str(e))
