"""A job whose two policies share one pool, scheduled as a GPU pool is (`cpu_pools_take_turns`),
through the driver and real actors, in async mode: both policies train to the end taking turns
while the other's episodes wait for the engines to wake, each step's row reports its turn, the
counts stay within the starvation bound, and checkpoints take turns of their own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from driver_harness import cpu_pools_take_turns, make_job, policy, run

POOLED = {"rollout": {"engine": "torch", "pool": "shared"}, "trainer": {"zeroStage": 1, "pool": "shared"}}


def two_policies_on_a_pool(mode: str, steps: int) -> Any:
    speaker, listener = (policy(n) for n in ("speaker", "listener"))
    for p in (speaker, listener):
        p["rollout"] = dict(POOLED["rollout"])
        p["trainer"] = POOLED["trainer"] | {"microBatchSize": 16}
    return make_job(
        mode=mode,
        maxStaleness=1 if mode == "async" else 0,
        training={"totalSteps": steps, "episodesPerStep": 16, "seed": 3},
        workflow={
            "entrypoint": "polyrl_runtime.workflows.signal:SignalGame",
            "args": {"vocab": 4, "symbols": 3, "policies": {"speaker": "speaker", "listener": "listener"}},
        },
        policies=[speaker, listener],
        pools=[{"name": "shared", "gpus": 0}],
        checkpoint={"everySteps": 2, "keep": 2},
    )


@pytest.mark.slow
def test_two_policies_take_turns_on_one_pool_in_async_mode(
    ray_local: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Async: a policy asks for a turn when it has a step's samples, while the engines generate the
    other's; sync mode's rounds run in benchmarks/sharing.py's smoke test (two policies)."""
    cpu_pools_take_turns(monkeypatch)
    driver, summary = run(two_policies_on_a_pool("async", steps=4), tmp_path)
    assert summary.state == "done", summary.message
    rows = driver.records
    assert sorted((r.policy, r.step) for r in rows) == sorted(
        (p, s) for p in ("speaker", "listener") for s in range(1, 5)
    )
    assert all(r.pool == "shared" and r.pool_switch_s is not None and r.pool_switch_s > 0 for r in rows)
    # Turns are first come, first served: as the rows arrive neither policy is two steps ahead.
    done = {"speaker": 0, "listener": 0}
    for r in rows:
        done[r.policy] = r.step
        assert abs(done["speaker"] - done["listener"]) <= 2, done
    usage = driver.pools.usage()["shared"]
    assert usage.turns == {"speaker": 4, "listener": 4}
    assert usage.switches >= 8 and usage.switch_s > 0
    progress = driver.progress()
    assert [p.name for p in progress.pools] == ["shared"] and progress.pools[0].turns == usage.turns
    # The checkpoints at steps 2 and 4 took turns of their own.
    assert driver.last_ckpt is not None and driver.last_ckpt.step == 4
