"""A function called in a child process of its own, so that a call that does not return in time is
ended: a thread cannot be stopped, and a timeout built on SIGALRM (math-verify's) works only on a
process's main thread, never on the event loop of a Ray async actor. The caller waits at most the
timeout; then the child is killed, the call raises TimeoutError, and the next call starts a new
child. One child per IsolatedCall, used by one call at a time."""

from __future__ import annotations

import importlib
import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

# A new child imports `preload` before it answers: a heavy import (sympy, about a second) is not
# counted against the first call's timeout.
START_TIMEOUT_S = 120.0


def _serve(conn: Connection, fn: Callable[..., Any], preload: str | None) -> None:
    if preload:
        importlib.import_module(preload)
    conn.send(("ready", None))
    while True:
        try:
            args = conn.recv()
        except EOFError:  # the parent is gone
            return
        try:
            conn.send(("ok", fn(*args)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class IsolatedCall:
    def __init__(self, fn: Callable[..., Any], timeout_s: float, *, preload: str | None = None) -> None:
        self.fn, self.timeout_s, self.preload = fn, timeout_s, preload
        self._lock = threading.Lock()
        self._child: tuple[Any, Connection] | None = None

    def _start(self) -> tuple[Any, Connection]:
        ctx = multiprocessing.get_context("spawn")  # no copy of the parent's threads or engines
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self.fn, self.preload), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(START_TIMEOUT_S):
            proc.kill()
            raise TimeoutError(
                f"the child process for {self.fn.__name__} did not start in {START_TIMEOUT_S:.0f} s"
            )
        parent.recv()
        return proc, parent

    def _stop(self) -> None:
        if self._child is not None:
            proc, conn = self._child
            self._child = None
            proc.kill()
            proc.join(5)
            conn.close()

    def __call__(self, *args: Any) -> Any:
        with self._lock:
            if self._child is None or not self._child[0].is_alive():
                self._stop()
                self._child = self._start()
            _proc, conn = self._child
            try:
                conn.send(args)
                ready = conn.poll(self.timeout_s)
            except (BrokenPipeError, EOFError, OSError):
                ready = False
            if not ready:
                self._stop()
                raise TimeoutError(
                    f"{self.fn.__name__} did not return in {self.timeout_s:g} s (its process was ended)"
                )
            try:
                status, value = conn.recv()
            except EOFError:  # the child died mid-call
                self._stop()
                raise RuntimeError(f"the child process of {self.fn.__name__} died during the call") from None
        if status == "error":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        with self._lock:
            self._stop()
