"""klIn reward over two real trainer ranks (gloo, one pod on CPU): each rank's per-token advantages
are whitened with the statistics of both ranks' trained tokens (per-policy), and per agent with each
agent's over both (per-agent), the same as one rank holding every row."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from polyrl_runtime.algorithms.advantages import agent_stats
from polyrl_runtime.algorithms.kl_reward import token_advantages
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.trainers.deepspeed_trainer import DeepSpeedTrainer

sys.path.insert(0, str(Path(__file__).parent.parent / "coordinator"))
from driver_harness import make_job, policy

# Per rank: one micro-batch of returns, its mask and its rows' agents; rank 1's are on another scale.
SHARES = [
    (
        torch.tensor([[1.0, 0.5, 0.2], [0.0, -0.1, 0.0]]),
        torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
        ["small", "big"],
    ),
    (torch.tensor([[40.0, 60.0, -20.0, 0.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]]), ["big"]),
]


@pytest.fixture
def ray_here(ray_session: Any) -> Iterator[Any]:
    pickler: Any = ray.cloudpickle  # the helper below runs inside the rank actors
    pickler.register_pickle_by_value(sys.modules[__name__])
    yield ray_session
    pickler.unregister_pickle_by_value(sys.modules[__name__])


def _advantages(trainer: DeepSpeedTrainer, mode: str) -> torch.Tensor:
    returns, mask, agents = SHARES[trainer.rank]
    [adv] = token_advantages(
        [returns],
        [mask],
        [agents],
        mode,
        algorithm="reinforce_pp",
        allreduce=trainer._allreduce,
        agent_stats=trainer._agent_stats,
    )
    return adv


def _one_rank(mode: str) -> list[torch.Tensor]:
    def alone(values: torch.Tensor, agents: tuple[str, ...]) -> dict[str, Any]:
        return agent_stats(values, agents, "reinforce_pp")

    width = max(r.shape[1] for r, _, _ in SHARES)
    pad = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for r, m, _ in SHARES for t in (r, m)]
    returns, masks = torch.cat(pad[0::2]), torch.cat(pad[1::2])
    agents = [a for _, _, share in SHARES for a in share]
    [adv] = token_advantages(
        [returns], [masks], [agents], mode, algorithm="reinforce_pp", allreduce=lambda v: v, agent_stats=alone
    )
    return [adv[:2, :3], adv[2:, :4]]


@pytest.mark.slow
def test_ranks_whiten_with_every_ranks_tokens(ray_here: Any, tiny_qwen2_dir: Path) -> None:
    p = policy(
        model={"uri": f"file://{tiny_qwen2_dir}", "dtype": "float32"},
        trainer={"gpus": 0, "ranksPerPod": 2, "zeroStage": 1, "microBatchSize": 2},
        algorithm={"name": "reinforce_pp", "groupSize": 1, "klCoef": 0.1, "klIn": "reward"},
    )
    job = make_job(policies=[p])
    fleet = Fleet(job, "objectstore", place_by_resource=False)
    clients = fleet.new_trainers(job.spec.policies[0], buffer=None)  # these ranks pull nothing
    ranks: list[Any] = [c.handle for c in clients]  # `__ray_call__` runs `_advantages` in them
    try:
        addr, port = ray.get(clients[0].address())
        ray.get([c.setup(addr, port, local_rank) for local_rank, c in enumerate(clients)])  # one node
        got = {
            mode: ray.get([r.__ray_call__.remote(_advantages, mode) for r in ranks])
            for mode in ("per-policy", "per-agent")
        }
    finally:
        fleet.close()
    for mode, per_rank in got.items():
        for rank, (adv, want) in enumerate(zip(per_rank, _one_rank(mode), strict=True)):
            assert torch.allclose(adv, want, atol=1e-6), (mode, rank, adv, want)
    # per-agent differs from per-policy: rank 1's large returns do not set the small agent's scale
    assert not torch.allclose(got["per-agent"][0], got["per-policy"][0], atol=1e-3)
