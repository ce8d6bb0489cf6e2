"""Waits that say what they wait for and end: `wait_until`, `locked`, and the port registry's lock."""

from __future__ import annotations

import asyncio
import fcntl
import re
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from polyrl_runtime import netmap
from polyrl_runtime.waiting import Attempt, WaitTimeout, locked, wait_until


def _events(logs: Sequence[Mapping[str, Any]], event: str) -> list[Mapping[str, Any]]:
    return [e for e in logs if e["event"] == event]


def test_a_wait_logs_while_it_waits_and_returns_the_first_value() -> None:
    tries: list[float] = []

    async def attempt() -> Attempt[str]:
        tries.append(time.monotonic())
        return Attempt("up") if len(tries) == 6 else Attempt(None, f"try {len(tries)}: refused")

    with capture_logs() as logs:
        got = asyncio.run(
            wait_until(attempt, what="the thing", deadline_s=30, poll_s=0.05, every_s=0.1, key="k")
        )
    assert got == "up" and len(tries) == 6
    [start] = _events(logs, "wait.started")
    assert start["waiting_for"] == "the thing" and start["deadline_s"] == 30 and start["key"] == "k"
    waiting = _events(logs, "wait.waiting")
    assert waiting and all(w["last"].endswith(": refused") and w["deadline_s"] == 30 for w in waiting)
    assert [e["event"] for e in logs][-1] == "wait.done"


def test_a_wait_gives_up_at_its_deadline_naming_what_and_how_long() -> None:
    async def attempt() -> Attempt[str]:
        return Attempt(None, "connection refused")

    started = time.monotonic()
    with pytest.raises(WaitTimeout) as err:
        asyncio.run(wait_until(attempt, what="the head at h:1", deadline_s=0.6, poll_s=0.05))
    assert time.monotonic() - started < 5
    message = str(err.value)
    assert message.startswith("gave up waiting for the head at h:1 after 1 s (deadline 0.6 s)"), message
    assert message.endswith(": connection refused")


def test_a_stop_event_ends_a_wait_with_none() -> None:
    async def scenario() -> str | None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, stop.set)

        async def never() -> Attempt[str]:
            return Attempt(None, "no")

        return await wait_until(never, what="never", deadline_s=60, poll_s=10, stop=stop)

    started = time.monotonic()
    assert asyncio.run(scenario()) is None
    assert time.monotonic() - started < 5  # the stop ended the 10 s poll, not the poll's end


def test_a_free_lock_is_taken_silently_and_a_held_one_is_waited_for_with_logs(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    with capture_logs() as logs, open(path, "a+") as f, locked(f, path, what="test", deadline_s=5):
        pass
    assert logs == []
    # another open file description holds it (flock conflicts even within one process) for 0.5 s
    with open(path, "a+") as holder, open(path, "a+") as ours:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
        release = threading.Timer(0.5, fcntl.flock, (holder.fileno(), fcntl.LOCK_UN))
        release.start()
        with capture_logs() as logs, locked(ours, path, what="test", deadline_s=30, poll_s=0.05, every_s=0.1):
            pass
    release.join()
    assert logs[0]["event"] == "wait.started"
    assert logs[0]["waiting_for"] == f"lock {path} (test)" and logs[0]["lock"] == str(path)
    assert _events(logs, "wait.waiting") and logs[-1]["event"] == "wait.done"


def test_a_lock_held_past_the_deadline_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "y.lock"
    with open(path, "a+") as holder, open(path, "a+") as ours:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
        expected = re.escape(f"gave up waiting for lock {path} (build) after")
        with pytest.raises(WaitTimeout, match=expected), locked(ours, path, what="build", deadline_s=0.3):
            pass


def test_the_port_registry_says_when_it_waits_for_its_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = tmp_path / "ports.json"
    monkeypatch.setenv("POLYRL_PORT_REGISTRY", str(registry))
    got: list[int] = []
    with open(registry, "a+") as holder:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
        with capture_logs() as logs:
            picker = threading.Thread(target=lambda: got.append(netmap.free_port()))
            picker.start()
            deadline = time.monotonic() + 20
            while not _events(logs, "wait.started") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not got  # still waiting, and it said so
            fcntl.flock(holder.fileno(), fcntl.LOCK_UN)
            picker.join(20)
    [start] = _events(logs, "wait.started")
    assert start["lock"] == str(registry) and "port registry" in start["waiting_for"]
    assert len(got) == 1 and _events(logs, "wait.done")
