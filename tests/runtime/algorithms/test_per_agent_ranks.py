"""Per-agent advantage statistics over two real trainer ranks (gloo, one pod on CPU): ranks that hold
different agents' samples agree on every agent's statistics, the same as one rank holding them all."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from polyrl_runtime.algorithms.advantages import agent_stats
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.trainers.deepspeed_trainer import DeepSpeedTrainer

sys.path.insert(0, str(Path(__file__).parent.parent / "coordinator"))
from driver_harness import make_job, policy

# Rank 0 holds the small-scale agent and one big sample; rank 1 the rest of the big agent.
SHARES = [
    ([0.5, -0.5, 1.0, 60.0], ("small", "small", "small", "big")),
    ([-50.0, 100.0, -100.0], ("big", "big", "big")),
]


@pytest.fixture
def ray_here(ray_session: Any) -> Iterator[Any]:
    pickler: Any = ray.cloudpickle  # the helper below runs inside the rank actors
    pickler.register_pickle_by_value(sys.modules[__name__])
    yield ray_session
    pickler.unregister_pickle_by_value(sys.modules[__name__])


def _stats(trainer: DeepSpeedTrainer) -> dict[str, tuple[float, float]]:
    values, agents = SHARES[trainer.rank]
    merged = trainer._agent_stats(torch.tensor(values), agents)
    return {a: (s.mean, s.std) for a, s in merged.items()}


@pytest.mark.slow
def test_ranks_agree_on_each_agents_statistics(ray_here: Any, tiny_qwen2_dir: Path) -> None:
    p = policy(
        model={"uri": f"file://{tiny_qwen2_dir}", "dtype": "float32"},
        trainer={"gpus": 0, "ranksPerPod": 2, "zeroStage": 1, "microBatchSize": 2},
        algorithm={"name": "grpo", "groupSize": 4, "advantageNorm": "per-agent"},
    )
    job = make_job(policies=[p])
    fleet = Fleet(job, "objectstore", place_by_resource=False)
    clients = fleet.new_trainers(job.spec.policies[0], buffer=None)  # these ranks pull nothing
    ranks: list[Any] = [c.handle for c in clients]  # `__ray_call__` runs `_stats` in them
    try:
        addr, port = ray.get(clients[0].address())
        ray.get([c.setup(addr, port, local_rank) for local_rank, c in enumerate(clients)])  # one node
        got = ray.get([r.__ray_call__.remote(_stats) for r in ranks])
    finally:
        fleet.close()
    values = torch.tensor([v for share, _ in SHARES for v in share])
    whole = agent_stats(values, [a for _, agents in SHARES for a in agents])
    for per_rank in got:
        assert per_rank.keys() == {"small", "big"}
        for name, (mean, std) in per_rank.items():
            assert mean == pytest.approx(whole[name].mean) and std == pytest.approx(whole[name].std)
