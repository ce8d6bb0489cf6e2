"""A LangGraph program trained by the driver with real actors: its planner and solver, two policies,
call the OpenAI endpoint of their episode in the workflow worker actor (workflows/openai_server.py),
and each step trains both on the sequences those calls left."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from driver_harness import make_job, policy, run

pytestmark = pytest.mark.slow
pytest.importorskip("langgraph")  # the `agents` extra, which the test tier installs


def test_a_langgraph_program_trains_two_policies_through_the_endpoint(ray_local: Any, tmp_path: Path) -> None:
    model = {"uri": "builtin://tiny-qwen2", "dtype": "float32"}
    agents = [policy(name, model=model) for name in ("planner", "solver")]
    for p in agents:
        p["algorithm"] = {"name": "grpo", "groupSize": 2}
        p["rollout"] = {**p.get("rollout", {}), "engine": "torch", "sampling": {"maxNewTokens": 8}}
    job = make_job(
        mode="sync",
        maxStaleness=0,
        training={"totalSteps": 2, "episodesPerStep": 4, "seed": 3},
        workflow={
            "entrypoint": "polyrl_runtime.workflows.langgraph_planner:LangGraphPlannerSolver",
            "args": {"max_tokens": 8, "policies": {"planner": "planner", "solver": "solver"}},
        },
        policies=agents,
    )
    _, summary = run(job, tmp_path)
    assert summary.state == "done", summary.message
    records = [r for r in summary.records if r.step > 0]
    assert {r.policy for r in records} == {"planner", "solver"}
    assert all(r.samples == r.episodes for r in records), records  # one sequence per agent and episode
    assert not summary.failed, summary.failed
