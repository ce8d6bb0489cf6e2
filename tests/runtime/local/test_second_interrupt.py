"""A second Ctrl-C stops `polyrl run` at once: it says so, exits 130 as after one Ctrl-C, writes
no result files, and leaves none of the Ray processes it started behind."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil  # type: ignore[import-untyped]
import pytest
import yaml

from polyrl_testenv.localrun import Background

DATA = Path(__file__).parent.parent / "data"


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_saying_so(tmp_path: Path) -> None:
    doc = yaml.safe_load((DATA / "selfplay-tiny.yaml").read_text())
    doc["spec"]["training"]["totalSteps"] = 500
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    # --separate: the trainer and the engine in processes of their own; every one is stopped.
    run = Background(tmp_path / "logs", str(job), "--out", str(out), "--plain", "--separate")
    try:
        run.wait_for_rows(out, 2)
        started = psutil.Process(run.proc.pid).children(recursive=True)
        names = {p.cmdline()[0].split()[0].split(".")[0] for p in started if p.cmdline()[:1]}
        assert {"ray::DeepSpeedTrainer", "ray::TorchEngine"} <= names and "ray::ColocatedRank" not in names
        run.proc.send_signal(signal.SIGINT)
        # Signals do not queue: the second is sent once the first was handled.
        run.wait_until(lambda: "interrupt: stopping after the steps in progress" in run.stdout, "first")
        run.proc.send_signal(signal.SIGINT)
        code = run.finish()
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    assert code == 130, run.stdout + run.stderr
    # Stopping (no checkpoint yet) or, if the run had just ended, writing its result files.
    assert "second interrupt: stopping now" in run.stderr, run.stderr
    assert not (out / "summary.json").exists()
    # Killed as it exits: a grace for the kills to land, well short of the minute Ray's agents
    # outlive a driver that only exits.
    deadline = time.monotonic() + 15
    while (alive := [p for p in started if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, [p.pid for p in alive]


def _running(p: psutil.Process) -> bool:
    """Still running: not gone and not a zombie (one nobody reaped has ended all the same)."""
    try:
        return bool(p.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
