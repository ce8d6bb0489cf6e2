"""The coordinator's Ray head is started again when it dies or its GCS never opens, and gives up
after its last start naming the head's log. Real child processes stand in for `ray start`: a
process that exits at once (a GCS that aborted as it started), one that never listens, and one that
listens on the GCS port."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from polyrl_runtime.netmap import free_port
from polyrl_runtime.pods.ray_node import RayHead, accepts_connections
from polyrl_runtime.waiting import WaitTimeout

EXITS = "import sys; sys.exit(3)"
NEVER_LISTENS = "import time; time.sleep(600)"


def listens(port: int) -> str:
    return (
        "import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        f"s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(600)"
    )


def launcher(
    programs: list[str], started: list[subprocess.Popen[bytes]]
) -> Callable[[], subprocess.Popen[bytes]]:
    """Starts the next of `programs` on each call (the last one again once they run out)."""

    def launch() -> subprocess.Popen[bytes]:
        code = programs[min(len(started), len(programs) - 1)]
        started.append(subprocess.Popen([sys.executable, "-c", code]))
        return started[-1]

    return launch


def test_a_head_that_exits_is_started_again_until_its_gcs_answers(tmp_path: Path) -> None:
    port, started = free_port(), []
    head = RayHead(launcher([EXITS, listens(port)], started), port, tmp_path / "head.log", start_s=60)
    try:
        with capture_logs() as logs:
            asyncio.run(head.up(poll_s=0.1))
        assert head.starts == 2 and accepts_connections(port)
        [restart] = [e for e in logs if e["event"] == "ray.head_restart"]
        assert restart["reason"] == "exited with code 3" and restart["start"] == 2
        assert restart["ray_log"] == str(tmp_path / "head.log")
    finally:
        head.stop()
    assert all(p.poll() is not None for p in started)  # the head's processes are gone


def test_a_head_whose_gcs_never_opens_fails_after_its_last_start(tmp_path: Path) -> None:
    port, started = free_port(), []
    head = RayHead(launcher([NEVER_LISTENS], started), port, tmp_path / "head.log", starts=2, start_s=1)
    try:
        with pytest.raises(WaitTimeout) as failed:
            asyncio.run(head.up(poll_s=0.1))
    finally:
        head.stop()
    assert str(failed.value) == (
        f"the Ray head failed 2 starts, the last one its GCS accepted no connection within 1 s; "
        f"see {tmp_path / 'head.log'}"
    )
    assert len(started) == 2 and all(p.poll() is not None for p in started)  # the first was stopped
