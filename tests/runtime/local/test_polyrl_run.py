"""`polyrl run` as a user runs it (a subprocess with its own local Ray): result files, --resume,
Ctrl-C, and clear messages for bad job files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil  # type: ignore[import-untyped]
import pytest
import yaml

from polyrl_testenv.localrun import POLYRL, metrics_rows, polyrl_run, run_env

DATA = Path(__file__).parent.parent / "data"


def _job(tmp: Path, name: str = "job.yaml", **training: int) -> Path:
    doc = yaml.safe_load((DATA / "selfplay-tiny.yaml").read_text())
    doc["spec"]["training"].update(training)
    path = tmp / name
    path.write_text(yaml.safe_dump(doc))
    return path


def test_bad_job_files_give_a_clear_message(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "broken.yaml"
    bad_yaml.write_text("spec: [unclosed\n")
    r = polyrl_run(str(bad_yaml))
    assert r.returncode == 2 and "broken.yaml" in r.stderr and "not valid YAML" in r.stderr
    doc = yaml.safe_load((DATA / "selfplay-tiny.yaml").read_text())
    doc["spec"]["training"]["totalSteps"] = 0
    invalid = tmp_path / "invalid.yaml"
    invalid.write_text(yaml.safe_dump(doc))
    r = polyrl_run(str(invalid))
    assert r.returncode == 2 and "spec.training.totalSteps" in r.stderr
    r = polyrl_run(str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "cannot read" in r.stderr
    r = polyrl_run(str(_job(tmp_path)), "--cpus", "gpu=0")
    assert r.returncode == 2 and "--cpus gpu=0: unknown role 'gpu'" in r.stderr
    r = polyrl_run(str(_job(tmp_path)), "--cpus", "pool:shared=0")
    assert r.returncode == 2 and "--cpus pool:shared=0: the job has no pool 'shared'" in r.stderr
    # GPUs this machine lacks: Ray would keep the actors pending and the job would wait forever
    del doc["spec"]["policies"][0]["trainer"]["gpus"]  # 1 unless set
    doc["spec"]["training"]["totalSteps"] = 2
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(yaml.safe_dump(doc))
    r = polyrl_run(str(gpus))
    assert r.returncode == 2, r.stderr
    assert "gpus.yaml: the job needs 1 GPU and this machine has no GPU" in r.stderr
    assert "policy agent: trainer.gpus 1 (1 rank)" in r.stderr


@pytest.mark.slow
def test_run_writes_results_and_resume_continues(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = polyrl_run(str(_job(tmp_path, totalSteps=3)), "--out", str(out), "--plain")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "== done" in r.stdout and "agent: 3 steps" in r.stdout
    assert "starting actors (1 engine (1 in its trainer's process), 1 trainer rank" in r.stdout
    rows = metrics_rows(out)
    assert [x["step"] for x in rows] == [1, 2, 3]
    # The summary also gives the mean of the last (up to 10) steps, a steadier reading than one step.
    tail = json.loads((out / "summary.json").read_text())["last_steps_mean"]["agent"]
    assert tail["steps"] == 3
    assert tail["reward_mean"] == pytest.approx(sum(x["reward_mean"] for x in rows) / 3)
    assert f"(mean of the last 3 steps: {tail['reward_mean']:.3f})" in r.stdout
    assert (out / "metrics.csv").read_text().count("\n") == 4
    assert (out / "reward_agent.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "summary.json").read_text())["state"] == "done"
    assert (out / "checkpoints" / "step-000003" / "state.json").is_file()

    # The resumed run also takes --cpus (each role pinned; test_fleet checks the actors' masks).
    cpu = max(os.sched_getaffinity(0))
    pins = [a for role in ("rollout", "workflow", "trainer") for a in ("--cpus", f"{role}={cpu}")]
    r = polyrl_run(
        str(_job(tmp_path, "longer.yaml", totalSteps=5)), "--out", str(out), "--plain", "--resume", *pins
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"rollout on CPU {cpu}, workflow on CPU {cpu}, trainer on CPU {cpu}" in r.stdout
    assert "starting actors (1 engine, 1 trainer rank" in r.stdout  # pinned roles: a process each
    rows = metrics_rows(out)
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5]
    assert json.loads((out / "summary.json").read_text())["last_steps_mean"]["agent"]["steps"] == 5
    assert (out / "checkpoints" / "step-000005").is_dir()


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_exits_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [POLYRL, "run", str(_job(tmp_path, totalSteps=500)), "--out", str(out), "--plain"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=run_env(),
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            metrics = out / "metrics.jsonl"
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        # The job's actors run at the driver's priority, not Ray's default nice 15 for its workers. The
        # policy's trainer rank and its engine share one process (trainers/colocated.py).
        roles = ("ray::ColocatedRank", "ray::DeepSpeedTrainer", "ray::TorchEngine")
        actors = {
            (c.pid, c.cmdline()[0].split()[0].split(".")[0]): c.nice()
            for c in psutil.Process(proc.pid).children(recursive=True)
            if c.cmdline()[:1] and c.cmdline()[0].startswith(roles)
        }
        assert [name for _, name in actors] == ["ray::ColocatedRank"], actors
        assert set(actors.values()) == {os.nice(0)}, actors
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stdout + stderr
    summary = json.loads((out / "summary.json").read_text())
    assert "interrupted" in summary["message"]
    steps = summary["steps"]["agent"]
    assert 2 <= steps < 500
    assert (out / "checkpoints" / f"step-{steps:06d}" / "state.json").is_file()


def test_tail_means_cover_the_last_steps_of_each_policy() -> None:
    from polyrl_runtime.local.results import tail_means

    rows = [{"policy": p, "reward_mean": float(i), "success_mean": None} for i in range(15) for p in "ab"]
    rows.append({"policy": "a", "reward_mean": None, "success_mean": 1.0})
    assert tail_means(rows, "a") == {"steps": 10, "reward_mean": sum(range(6, 15)) / 9, "success_mean": 1.0}
    assert tail_means(rows, "b", n=2) == {"steps": 2, "reward_mean": 13.5, "success_mean": None}
    assert tail_means(rows, "c") == {"steps": 0, "reward_mean": None, "success_mean": None}
