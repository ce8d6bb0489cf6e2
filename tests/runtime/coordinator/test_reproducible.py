"""A seeded sync job reproduces its own per-step metrics on CPU, and the same on a device pool.

The job is made as sensitive to scheduling as a small job can be: two rollout engines and two
workflow workers, and replies of varying length (tests/runtime/data/free_replies.py), so which
engine serves a request, which requests share a forward pass and the order episodes reach the
buffer all vary from run to run. Sampling must depend only on (job seed,
episode, agent, turn), and the trainer's update only on which samples it trains on.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from driver_harness import cpu_pools_take_turns, make_job, policy, run

# Wall-clock figures differ between runs by nature; everything else must not.
TIMING = {"train_s", "sync_s", "elapsed_s", "samples_per_s"}
# Floats computed from behaviour logprobs: an engine's forward pass over 1-3 rows uses other CPU
# kernels than over more rows (the last bits of a logit differ, 2.7e-7 for the tiny Qwen2), and which
# requests share a pass is timing. The sampled tokens, rewards and counts are compared exactly.
NEAR = {"loss", "is_weight_mean", "grad_norm", "clip_frac", "kl", "entropy"}


def guessing_job(model_dir: Path, seed: int) -> Any:
    return make_job(
        mode="sync",
        maxStaleness=0,
        training={"totalSteps": 3, "episodesPerStep": 32, "seed": seed},
        workflow={
            "entrypoint": "free_replies:FreeReplies",
            "args": {"max_new_tokens": 12, "turns": 2},
            "replicas": {"min": 2, "max": 2},
        },
        policies=[
            policy(
                model={"uri": f"file://{model_dir}", "dtype": "float32"},
                algorithm={"name": "grpo", "groupSize": 8, "lr": 3e-3},
                rollout={"replicas": {"min": 2, "max": 2}},
                trainer={"zeroStage": 1, "gpus": 0, "microBatchSize": 16},
            )
        ],
        checkpoint={"everySteps": 10_000},
    )


def step_metrics(tmp: Path, job: Any, **opts: Any) -> list[dict[str, Any]]:
    driver, summary = run(job, tmp, **opts)
    assert summary.state == "done", summary.message
    return [{k: v for k, v in asdict(r).items() if k not in TIMING} for r in driver.records]


def assert_same_metrics(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> None:
    for a, b in zip(first, second, strict=True):
        assert {k: v for k, v in a.items() if k not in NEAR} == {k: v for k, v in b.items() if k not in NEAR}
        for k in NEAR:
            assert abs(a[k] - b[k]) <= 1e-6 * max(1.0, abs(a[k])), (a["step"], k, a[k], b[k])


@pytest.mark.slow
def test_seeded_sync_job_reproduces_its_metrics_in_one_process_or_two(
    ray_local: Any, tiny_qwen2_dir: Path, tmp_path: Path
) -> None:
    """Run twice: with a process per role, then as `polyrl run` does, the trainer rank and the first
    engine in one process (trainers/colocated.py; the second engine has its own). Where each part
    runs is not in the maths, so the second run reproduces the first."""
    job = guessing_job(tiny_qwen2_dir, seed=5)
    separate = step_metrics(tmp_path / "separate", job, colocate=False)
    driver, summary = run(job, tmp_path / "colocated", colocate=True)
    assert summary.state == "done", summary.message
    assert driver.fleet.colocated == {"agent"}
    colocated = [{k: v for k, v in asdict(r).items() if k not in TIMING} for r in driver.records]
    assert len(separate) == len(colocated) == 3
    assert_same_metrics(separate, colocated)


POOL_FIELDS = ("pool", "pool_resident_s", "pool_switch_s", "pool_switches_total", "pool_busy_fraction")
POOL_SETS = {"replicas", "gpus", "gpuType", "image", "resources", "env", "podTemplate"}


def placed(job: Any, pooled: bool) -> Any:
    """`job` with one engine and one trainer rank, on pods of their own or on one pool of one pod."""
    doc = job.model_dump(by_alias=True, exclude_none=True)
    p = doc["spec"]["policies"][0]
    if pooled:
        doc["spec"]["pools"] = [{"name": "shared", "gpus": 0, "replicas": {"min": 1, "max": 1}}]
        for role in ("rollout", "trainer"):  # the pool sets these
            p[role] = {k: v for k, v in p[role].items() if k not in POOL_SETS} | {"pool": "shared"}
    else:
        p["rollout"]["replicas"] = {"min": 1, "max": 1}
    return type(job).model_validate(doc)


@pytest.mark.slow
def test_a_policy_on_a_pool_trains_exactly_as_on_pods_of_its_own(
    ray_local: Any, tiny_qwen2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Placement is not in the maths: same seed, pooled and dedicated, the same step metrics. On the
    pool each step is a turn, here switching memory as a GPU pool does (engine asleep, trainer
    restored, offloaded again, through the actors' Ray calls): the round trips of the trainer's
    state through host memory change no bit of what it computes."""

    cpu_pools_take_turns(monkeypatch)
    job = guessing_job(tiny_qwen2_dir, seed=5)
    dedicated = step_metrics(tmp_path / "dedicated", placed(job, pooled=False))
    pooled = step_metrics(tmp_path / "pooled", placed(job, pooled=True))
    assert len(dedicated) == len(pooled) == 3
    turns = [{k: row.pop(k) for k in POOL_FIELDS} for row in pooled]
    assert all(row.pop(k) is None for row in dedicated for k in POOL_FIELDS)
    assert_same_metrics(dedicated, pooled)
    assert [t["pool"] for t in turns] == ["shared"] * 3
    # Each turn: engines -> trainer -> engines; switching took some of the time the turn held the pool.
    assert [t["pool_switches_total"] for t in turns] == [2, 4, 6]
    assert all(0 < t["pool_switch_s"] < t["pool_resident_s"] for t in turns)
    assert all(0 < t["pool_busy_fraction"] <= 1 for t in turns)
