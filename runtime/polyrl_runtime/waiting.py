"""Waits that say what they wait for: the pods' entry points never wait silently or forever.

Every wait of a pod's process (a worker for the coordinator's Ray head, the coordinator for its own
head and for the workers' nodes, any process for a host-wide file lock) goes through `Wait`: it logs
`wait.started` at once, `wait.waiting` every `every_s` seconds with how long it has waited, its
deadline and the last attempt's outcome, `wait.done` when it ends, and gives up at the deadline with
`WaitTimeout`, whose message names what was awaited, the time waited and the last outcome.

`wait_until` retries an async attempt until it returns a value; each attempt starts from scratch
(a worker resolves the head's address again on every try, since a Service's endpoint may appear or
move between tries). `locked` takes an `flock`, first without blocking, so that only a lock that is
really held by someone else is waited for, and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Generic, TypeVar

import structlog

log = structlog.get_logger(__name__)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

LOG_EVERY_S = 10.0


def lock_deadline_s() -> float:
    """How long a process waits for a host-wide lock held by a live process (a build, a download):
    `POLYRL_LOCK_TIMEOUT_S`, default an hour."""
    return float(os.environ.get("POLYRL_LOCK_TIMEOUT_S", "3600"))


class WaitTimeout(TimeoutError):
    """A wait passed its deadline; the message names what was awaited and for how long."""


@dataclass
class Wait:
    """One wait's clock and its log lines. `fields` (e.g. the address) go on every line."""

    what: str
    deadline_s: float
    every_s: float = LOG_EVERY_S
    fields: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    _logged: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self._logged = self.started
        log.info("wait.started", waiting_for=self.what, deadline_s=self.deadline_s, **self.fields)

    def waited(self) -> float:
        return time.monotonic() - self.started

    def expired(self) -> bool:
        return self.waited() >= self.deadline_s

    def tick(self, detail: str = "") -> None:
        """Log that we still wait, at most once per `every_s`."""
        now = time.monotonic()
        if now - self._logged >= self.every_s:
            self._logged = now
            log.info(
                "wait.waiting",
                waiting_for=self.what,
                waited_s=round(now - self.started, 1),
                deadline_s=self.deadline_s,
                last=detail or None,
                **self.fields,
            )

    def done(self) -> None:
        log.info("wait.done", waiting_for=self.what, waited_s=round(self.waited(), 1), **self.fields)

    def timeout(self, detail: str = "") -> WaitTimeout:
        message = (
            f"gave up waiting for {self.what} after {self.waited():.0f} s (deadline {self.deadline_s:g} s)"
        )
        return WaitTimeout(message + (f": {detail}" if detail else ""))


@dataclass(frozen=True)
class Attempt(Generic[T_co]):
    """One try's outcome: the value when it succeeded, else why not (for the log and the error)."""

    value: T_co | None
    detail: str = ""


async def wait_until(
    attempt: Callable[[], Awaitable[Attempt[T]]],
    *,
    what: str,
    deadline_s: float,
    poll_s: float = 1.0,
    every_s: float = LOG_EVERY_S,
    stop: asyncio.Event | None = None,
    **fields: Any,
) -> T | None:
    """The first value `attempt` returns, trying every `poll_s` seconds; None if `stop` is set first.

    Raises WaitTimeout at the deadline (the last attempt's detail in its message)."""
    wait = Wait(what, deadline_s, every_s, fields)
    while True:
        outcome = await attempt()
        if outcome.value is not None:
            wait.done()
            return outcome.value
        if wait.expired():
            raise wait.timeout(outcome.detail)
        wait.tick(outcome.detail)
        if stop is None:
            await asyncio.sleep(poll_s)
            continue
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), poll_s)
        if stop.is_set():
            return None


@contextlib.contextmanager
def locked(
    file: IO[Any],
    path: Path | str,
    *,
    what: str,
    deadline_s: float,
    poll_s: float = 0.2,
    every_s: float = LOG_EVERY_S,
) -> Iterator[None]:
    """Hold an exclusive `flock` on the open `file` (at `path`, named in the log and the error).

    A free lock is taken without a word; a held one is waited for with `wait.*` lines, polling
    without blocking so that the deadline holds (the kernel releases a dead holder's lock)."""
    fd = file.fileno()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        wait = Wait(f"lock {path} ({what})", deadline_s, every_s, {"lock": str(path)})
        while True:
            time.sleep(poll_s)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if wait.expired():
                    raise wait.timeout("another process holds it") from None
                wait.tick("held by another process")
        wait.done()
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
