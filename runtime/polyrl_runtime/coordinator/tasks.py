"""Background tasks of the coordinator whose errors must fail the job, not vanish with the task."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger(__name__)


def fail_on_error(task: asyncio.Task[Any], what: str, fail: Callable[[str], None]) -> asyncio.Task[Any]:
    """When `task` ends with an exception, log it and call `fail` with a message naming `what`.

    An asyncio task's exception is only seen by whoever awaits it. The driver's loops are awaited
    late or not at all: an error in a training loop ended the run as if interrupted (no error
    logged), and one in the producer's accounting of a worker's results was never seen."""

    def done(t: asyncio.Task[Any]) -> None:
        if t.cancelled() or t.exception() is None:
            return
        e = t.exception()
        log.error("coordinator.task_failed", task=what, error=repr(e), exc_info=e)
        fail(f"{what} failed: {type(e).__name__}: {e}")

    task.add_done_callback(done)
    return task
