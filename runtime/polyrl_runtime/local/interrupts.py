"""Ctrl-C (SIGINT) and SIGTERM under `polyrl run`.

The first stops the run after the steps in progress; the run then writes a checkpoint and its result
files and exits 130. The second exits at once, with 130 as well, saying what it skips: the checkpoint
while the run is still stopping, the result files once the run has ended. Before the run starts
(while Ray starts) there is nothing to stop gracefully: the first interrupt exits at once.

The handler covers the whole command: through the driver's event loop while it runs (asyncio's own
signal handling, so the loop wakes at once), through `signal.signal` before and after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells and other CLIs report for Ctrl-C
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _kill_started_processes() -> None:
    """Kill every process this one started: Ray's, with the job's actors. Ray's raylet and workers
    share the driver's fate, but its dashboard and runtime-env agents outlive it by about a minute."""
    import psutil  # type: ignore[import-untyped]

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()


def _exit_now(message: str) -> None:
    # os.write and os._exit: nothing else (Ray's shutdown, the result files) runs once the user asked
    # to stop at once.
    os.write(2, (message + "\n").encode())
    _kill_started_processes()
    os._exit(EXIT_INTERRUPTED)


class Interrupts:
    """Counts interrupts and acts on each (see the module docstring)."""

    def __init__(self, notify: Callable[[str], None]) -> None:
        self.notify = notify  # tells the user what the first interrupt does
        self.presses = 0
        self._stop: Callable[[], None] | None = None  # the run's graceful stop, while it runs
        self._ended = False

    def press(self) -> None:
        self.presses += 1
        if self.presses == 1 and self._stop is not None:
            self.notify(
                "interrupt: stopping after the steps in progress, then checkpointing "
                "(press Ctrl-C again to stop now without a checkpoint)"
            )
            self._stop()
            return
        which = "second interrupt" if self.presses > 1 else "interrupt"
        if self._ended:
            _exit_now(f"{which}: stopping now, without writing the result files")
        elif self.presses > 1:
            _exit_now(f"{which}: stopping now without a checkpoint")
        _exit_now(f"{which}: stopping before the run started")

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.press()

    def _install(self) -> None:
        for s in SIGNALS:
            signal.signal(s, self._handler)

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Handle SIGINT and SIGTERM inside the block; the previous handlers come back after it."""
        previous = {s: signal.getsignal(s) for s in SIGNALS}
        self._install()
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def running(self, loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> None:
        """The run is under way in `loop`: the first interrupt calls `stop`."""
        self._stop = stop
        for s in SIGNALS:
            loop.add_signal_handler(s, self.press)

    def ended(self) -> None:
        """The run's loop has ended (asyncio put the default handlers back as it closed)."""
        self._stop = None
        self._ended = True
        self._install()
