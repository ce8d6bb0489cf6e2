"""How the coordinator fails a job: its failure type, background tasks whose errors must fail the job
(not vanish with the task), and the root cause of an actor's error."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import structlog

from polyrl_runtime.models.hf import ModelLoadError

log = structlog.get_logger(__name__)


class JobFailedError(RuntimeError):
    """The job cannot go on; `retryable` False when running it again cannot succeed."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


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


_MODEL_LOAD_ERROR = re.compile(r"ModelLoadError: (.+)")


def root_cause(error: BaseException) -> BaseException:
    """The exception an actor raised, out of Ray's wrappers: a method's error (`RayTaskError.cause`),
    or for an actor whose constructor failed (Ray keeps only its traceback text) the model-loading
    error named in that text, so the driver can report it as the user's mistake it is."""
    for _ in range(8):
        cause = getattr(error, "cause", None)
        if not isinstance(cause, BaseException) or cause is error:
            break
        error = cause
    if getattr(error, "actor_init_failed", False):
        found = _MODEL_LOAD_ERROR.findall(str(getattr(error, "error_msg", "") or error))
        if found:
            return ModelLoadError(found[-1].strip())
    return error
