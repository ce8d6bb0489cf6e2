"""The benchmark scripts still run end to end (tiny sizes; the figures themselves are not checked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, timeout: float = 300) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _rows(out: str, first: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.split()[:1] == [first]]


@pytest.mark.slow
def test_weight_sync_benchmark_runs() -> None:
    out = _run("weight_sync.py", "--quick")
    # The real layout (290 tensors) against 10 tensors: transport, tensors, GB/s, 10-tensor GB/s, ratio.
    layout = [r[1:] for r in _rows(out, "layout")]
    assert {r[0] for r in layout} == {"shm", "collective", "objectstore"}
    assert all(r[1] == "290" and float(r[4]) > 0 for r in layout)
    rows = [r for r in _rows(out, "1") if len(r) == 7]  # MiB bound GB/s transport GB/s ratio pause
    assert {r[3] for r in rows} == {"shm", "collective", "objectstore"}
    assert all(float(r[5]) > 0 for r in rows)  # a ratio was computed for each transport
    (pieces,) = [r for r in _rows(out, "1") if len(r) == 4]  # N MiB, GB/s, whole GB/s, ratio
    assert float(pieces[1]) > 0 and float(pieces[3]) > 0
    # Control messages per sync do not depend on the number of tensors.
    for transport in ("shm", "collective", "objectstore"):
        counts = {r[2] for r in _rows(out, transport)}
        assert len(counts) == 1, (transport, counts)


@pytest.mark.slow
def test_weight_sync_deltas_benchmark_runs() -> None:
    out = _run("weight_sync.py", "--deltas", "--quick")
    layout = [r.split("|") for r in out.splitlines() if r.startswith("| ") and "%" in r.split("|")[1]]
    assert [r[1].strip() for r in layout[:3]] == ["1%", "10%", "100%"], out
    assert all(float(r[2]) > 0 and r[-2].strip() == "yes" for r in layout[:3])  # fetched, bit-exact
    # over collective: sent, a time ratio, bit-exact
    assert [r[1].strip() for r in layout[3:6]] == ["1%", "10%", "100%"], out
    assert all(float(r[2]) > 0 and float(r[5]) > 0 and r[-2].strip() == "yes" for r in layout[3:6])
    trained = [r.split("|") for r in out.splitlines() if r.startswith(("| float32", "| bfloat16"))]
    assert len(trained) == 2 and all(r[-2].strip() == "yes" for r in trained)
    assert "catch-up, deltas / whole: bytes" in out
    stored = [r.split("|") for r in out.split("\nstorage transport")[1].splitlines() if r.startswith("| ")]
    assert len(stored) == 6 and all(r[-2].strip() == "yes" for r in stored[1:]), out  # header, 5 rows
    assert "storage, a delta version / a whole one: bytes" in out
    assert "storage, joining through 3 deltas / a whole version: bytes" in out


@pytest.mark.slow
def test_experience_benchmark_runs() -> None:
    out = _run(
        "experience.py",
        "--episodes",
        "24",
        "--batch",
        "8",
        "--prompt",
        "8",
        "--response",
        "16",
        "--capacity",
        "16",
        "--in-flight",
        "1,2",
        "--pairs",
        "1",
        "--bound-episodes",
        "24",
    )
    # One table per mode: each call waited for, then two in flight; both paths in each.
    assert len(_rows(out, "buffer")) == 2 and len(_rows(out, "raw")) == 2
    assert "producer calls in flight: 1" in out and "producer calls in flight: 2" in out
    (bound,) = _rows(out, "16")  # capacity row of the memory-bound table
    assert int(bound[1]) <= 16


@pytest.mark.slow
def test_async_speedup_benchmark_runs() -> None:
    # Roles on their own cores: the placement with pinning (the shared one runs the same jobs unpinned).
    out = _run(
        "async_speedup.py",
        "--steps",
        "5",
        "--episodes",
        "8",
        "--tail",
        "4",
        "--rounds",
        "1",
        "--placement",
        "split",
    )
    table = [line for line in out.splitlines() if line.startswith("| ") and "x |" in line]
    assert [row.split("|")[1].strip() for row in table] == [
        "sync (maxStaleness 0)",
        "async (maxStaleness 1)",
        "async (maxStaleness 2)",
    ]
    assert "split cores (rollout=" in out and "shared cores" not in out


@pytest.mark.slow
def test_policy_scaling_benchmark_runs() -> None:
    # One policy: the row's two sides (one job, jobs one after another) are what every N repeats.
    out = _run("policy_scaling.py", "--steps", "2", "--episodes", "4", "--max-policies", "1")
    rows = [line.split("|") for line in out.splitlines() if line.endswith("|") and "x |" in line]
    assert [r[1].strip() for r in rows] == ["1"]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)


@pytest.mark.slow
def test_example_robustness_benchmark_runs() -> None:
    out = _run(
        "example_robustness.py",
        "--runs",
        "1",
        "--set",
        "training.totalSteps=3",
        "--set",
        "training.episodesPerStep=8",
        "--set",
        "policies.*.algorithm.lr=1.0e-4",
    )
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["1"]
    assert "of 1 runs at >= 0.9 for every policy" in out
    assert "policies.*.algorithm.lr=1.0e-4" in out


@pytest.mark.slow
def test_hf_engine_benchmark_runs() -> None:
    out = _run("hf_engine.py", "--quick")
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ") and "x |" in line]
    assert [r[1].strip() for r in rows] == ["equal (batch 16)", "long tail (batch 16)"]
    assert all(float(r[6].strip().removesuffix("x")) > 0 for r in rows)  # a ratio for each case


@pytest.mark.slow
def test_hf_trainer_benchmark_runs() -> None:
    out = _run("hf_trainer.py", "--quick")
    memory, throughput = _rows(out, "memory"), _rows(out, "throughput")
    assert throughput, out
    assert all(float(r[-2]) > 0 for r in memory)  # the naive loss's peak was measured
    assert all(float(r[-1]) > 0 for r in throughput)  # a ratio was computed for each round


@pytest.mark.slow
def test_vs_trl_benchmark_runs() -> None:
    # Its pooled layout: the same code path as the dedicated one but for the job's pools and goals.
    out = _run(
        "vs_trl.py", "--steps", "2", "--prompts", "2", "--group", "4", "--max-new-tokens", "4", "--tail", "1",
        "--mode", "sync", "--pool",
    )  # fmt: skip
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ") and "x |" in line]
    cases = ["one policy", "two policies, one after the other", "two policies, side by side"]
    # Throughput (one policy, then two against two TRL runs one after the other and side by side),
    # then what each side cost in CPU time per sample.
    throughput, cost = rows[:3], rows[3:]
    assert [r[1].strip() for r in throughput] == cases and [r[1].strip() for r in cost] == cases
    for r in throughput:
        ratio = float(r[4].strip().removesuffix("x"))
        assert ratio > 0, r  # both sides trained and were timed
        assert r[-2].strip() in ("met", "not met")
    assert "roles on one device pool" in out and "1.0x, CPU <= 1.1x TRL's, reward >= TRL" in out
    cores = len(os.sched_getaffinity(0)) + 0.5  # busy cores: CPU time over wall time, rounded
    for r in cost:
        assert float(r[2]) > 0 and float(r[3]) > 0, r  # both sides' processes were measured
        assert 0 < float(r[5]) <= cores and 0 < float(r[6]) <= cores, r
    assert "TRL alone, samples/s by torch threads: 1:" in out
    roles = {"engines", "trainers", "workflow workers", "experience buffer", "driver", "Ray"}
    for case in ("one policy", "two policies"):  # where polyrl's CPU time went, by process
        (line,) = [
            x for x in out.splitlines() if x.startswith(f"polyrl CPU-ms per sample by process, {case}:")
        ]
        # At these sizes a role may have used less than the clock's tick (10 ms) and is left out.
        parts = [x.rsplit(" ", 1) for x in line.split(": ", 1)[1].split(", ")]
        assert parts and all(name in roles and float(ms) > 0 for name, ms in parts), line


@pytest.mark.slow
def test_real_model_benchmark_runs() -> None:
    """The three sides on the tiny Qwen2 (the figures are SmolLM2's: docs/performance.md)."""
    out = _run(
        "real_model.py",
        *("--model", "builtin://tiny-qwen2", "--seeds", "1", "--steps", "2", "--prompts", "2"),
        *("--group", "2", "--eval-rows", "4", "--max-new-tokens", "4", "--no-two"),
    )
    rows = [r.split("|") for r in out.split("# all seeds")[1].splitlines() if r.startswith("| ")]
    sides = {r[1].strip(): r for r in rows if len(r) == 10 and r[2].strip() == "1"}
    assert set(sides) == {"polyrl", "trl", "plain"}, out
    assert all(float(r[6]) > 0 and float(r[7]) > 0 for r in sides.values())  # samples/s, CPU-s/sample
    assert "goal: one policy >= 1.0x TRL's samples/s" in out


@pytest.mark.slow
def test_algorithms_benchmark_runs() -> None:
    """Three variants (one-step grpo, clipped ppo, DAPO's dynamic sampling and length penalty) on the
    tiny Qwen2; every variant's job is checked in test_algorithms_benchmark.py, and the figures are
    SmolLM2's (docs/performance.md)."""
    variants = ["grpo", "ppo", "dapo"]
    out = _run(
        "algorithms.py",
        *("--model", "builtin://tiny-qwen2", "--seeds", "1", "--steps", "2", "--prompts", "2"),
        *("--group", "2", "--eval-rows", "4", "--max-new-tokens", "4", "--variants", ",".join(variants)),
        timeout=400,  # three jobs one after the other
    )
    runs = [line for line in out.splitlines() if " seed 1: pass@1 " in line]
    assert [line.split()[0] for line in runs] == variants, out
    assert all("; 8 samples trained, " in r for r in runs), runs  # 2 steps x 4: the same budget
    rows = [
        r.split("|") for r in out.splitlines() if r.startswith("| ") and r.split("|")[1].strip() in variants
    ]
    assert [r[1].strip() for r in rows] == variants, out
    assert all(r[3].strip() in ("0 of 1", "1 of 1") and float(r[5]) >= 1.0 for r in rows), rows
    assert "goal: Dr. GRPO or DAPO at least as good as today's GRPO on the mean" in out
    assert out.rstrip().splitlines()[-1].split(": ")[-1].startswith(("met (grpo ", "not met (grpo ")), out


@pytest.mark.slow
def test_stability_benchmark_runs() -> None:
    out = _run("stability.py", "--seeds", "1", "--steps", "2", "--episodes", "8", "--dtypes", "float32")
    runs = [line for line in out.splitlines() if line.startswith("float32 seed 1 ")]
    assert [line.split()[3] for line in runs] == ["plain:", "polyrl:"], out
    assert "float32: plain" in out and "polyrl" in out and "goal (polyrl >= plain)" in out


@pytest.mark.slow
def test_sharing_benchmark_runs() -> None:
    out = _run("sharing.py", "--rounds", "1", "--steps", "5", "--episodes", "16", "--policies", "2")
    rows = [
        line for line in out.splitlines() if line.startswith("| colocated") or line.startswith("| dedicated")
    ]
    assert len(rows) == 2, out
    assert "samples per core-second, colocated / dedicated:" in out and "colocated core busy:" in out
    many = [line for line in out.splitlines() if line.startswith(("| 2 | pooled", "| 2 | dedicated"))]
    assert len(many) == 2, out
    assert "2 policies: pooled / dedicated wall" in out and "pooled switch time" in out


@pytest.mark.slow
def test_lora_sharing_benchmark_runs() -> None:
    out = _run("lora_sharing.py", "--quick")
    # The memory table's rows: | N | MiB | ratio | MiB | ratio | (the tokens/s rows start with words).
    engines, trainers = out.split("\ntrainer memory:")
    memory = [r for r in _rows(engines, "|") if len(r) == 11 and r[1] in {"1", "2", "4", "8"} and r[2] == "|"]
    assert [r[1] for r in memory] == ["1", "2", "4", "8"]
    assert all(float(r[5].rstrip("x")) > 0 for r in memory)  # one engine of N adapters / one full engine
    assert "4 adapters mixed in one batch" in out and "mixed / one batch per adapter:" in out
    (adapter,) = [line for line in out.splitlines() if line.startswith("| one adapter |")]
    moved, own = adapter.split("|")[2:4]
    assert int(moved) >= int(own) > 0  # the bytes moved are at least the adapter's
    # one trainer of 4 policies: its ratio to 4 trainers of one
    (shared,) = [line for line in trainers.splitlines() if line.startswith("| 1 | 4 |")]
    assert float(shared.split("|")[5].strip().rstrip("x")) > 0


@pytest.mark.slow
def test_policy_restart_benchmark_runs() -> None:
    out = _run("policy_restart.py", "--quick")
    rows = {r.split("|")[1].strip(): r.split("|")[2].strip() for r in out.splitlines() if r.startswith("| ")}
    for measure in (
        "listener: longest gap / median step, around the restart",
        "speaker: restart time / its median step",
        "speaker: steps lost (since its checkpoint)",
    ):
        float(rows[measure])  # a figure came out


@pytest.mark.slow
def test_verifier_check_benchmark_runs() -> None:
    from polyrl_runtime.models.tiny_qwen2 import materialise

    out = _run("verifier_check.py", str(materialise("tiny-qwen2")), "--max-operand", "1")
    rows = [r.split("|") for r in out.splitlines() if r.startswith(("| right", "| wrong"))]
    assert [(r[1].strip(), int(r[2])) for r in rows] == [("right", 4), ("wrong", 8)]
    assert all(0.0 <= float(x) <= 1.0 for r in rows for x in r[3:7])
    balanced = float(out.split("balanced accuracy ")[1].split()[0])
    assert balanced == pytest.approx((float(rows[0][6]) + float(rows[1][6])) / 2, abs=1e-3)


@pytest.mark.slow
def test_league_benchmark_runs() -> None:
    out = _run("league.py", "--model", "builtin://tiny-qwen2", "--snapshots", "0,2", "--full", "0,2",
               "--copies", "1,2", "--batch", "4", "--tokens", "4", "--rounds", "1")  # fmt: skip
    lora, full = out.split("# full weights")
    rows = [r.split("|") for r in lora.splitlines() if r.startswith("| ") and "MiB" in r]
    assert [r[1].strip() for r in rows] == ["0", "2"], out
    assert float(rows[1][2].split()[0]) > 0 and rows[1][3].strip().endswith("ms")  # bytes, snapshot time
    assert all(float(r[5].strip().rstrip("x")) > 0 and float(r[7].strip().rstrip("x")) > 0 for r in rows)
    rows = [r.split("|") for r in full.splitlines() if r.startswith("| ") and "MiB" in r]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [("0", "-"), ("2", "1"), ("2", "2")], out
    assert float(rows[1][3].split()[0]) > 0 and rows[1][4].strip().endswith("ms")  # host bytes, snapshot
    assert rows[1][5].strip().endswith(")") and rows[0][5].strip() == "-"  # switches made, none without
    assert all(float(r[7].strip().rstrip("x")) > 0 and float(r[9].strip().rstrip("x")) > 0 for r in rows)


@pytest.mark.slow
def test_league_selfplay_benchmark_runs(tmp_path: Path) -> None:
    tiny = ["--set", "policies.*.model.uri=builtin://tiny-qwen2", "--set", "training.totalSteps=2"]
    small = ["--set", "evaluation.crossPlay.episodes=2", "--set", "evaluation.crossPlay.everySteps=1"]
    out = _run("league_selfplay.py", "--out", str(tmp_path), *tiny, *small, timeout=600)
    rows = [r.split("|") for r in out.splitlines() if r.startswith("| pfsp") or r.startswith("| latest")]
    assert [r[1].strip() for r in rows] == ["pfsp", "latest"], out
    assert all(r[2].strip().startswith("1: ") and "2: " in r[2] for r in rows), out  # a pass per step
    assert "final win rate, league minus latest-only" in out
    again = _run("league_selfplay.py", "--out", str(tmp_path), *tiny, *small, "--reuse")
    assert again.splitlines()[2:] == out.splitlines()[2:]  # the same runs, read again


@pytest.mark.slow
def test_openai_endpoint_benchmark_runs() -> None:
    out = _run("openai_endpoint.py", "--calls", "20", "--episodes", "2", "--turns", "2", "--tokens", "2",
               "--rounds", "1")  # fmt: skip
    rows = {r.split("|")[1].strip(): r.split("|")[2:] for r in out.splitlines() if r.startswith("| ")}
    assert float(rows["in-process"][0].split()[0]) > 0 and float(rows["HTTP endpoint"][0].split()[0]) > 0, out
    assert "goal (median added <= 5 ms): " in out and float(rows["ratio"][0].strip().rstrip("x")) > 0
