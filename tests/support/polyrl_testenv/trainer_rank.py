"""A trainer rank built in the test's process, as the driver builds one (world 1, on the `gloo`
group the trainer tests' fixture starts)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from polyrl_operator.api import Policy
from polyrl_runtime.experience.batches import SampleBatch
from polyrl_runtime.experience.state import Lease
from polyrl_runtime.experience.types import Sample
from polyrl_runtime.trainers.deepspeed_trainer import DeepSpeedTrainer


def in_process_rank(policy: Policy, total_steps: int = 4) -> DeepSpeedTrainer:
    rank = DeepSpeedTrainer(
        "agent-trainer-0",
        policy.model_dump_json(by_alias=True),
        0,
        rank=0,
        world=1,
        buffer=None,  # type: ignore[arg-type]  # these tests feed the rank directly, never through a buffer
        total_steps=total_steps,
    )
    rank.setup(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return rank


def fixed_batch(
    lengths: Sequence[int],
    rewards: Sequence[float],
    *,
    one_episode: bool = False,
    prompt: Sequence[int] = (1, 5, 9),
    token_period: int = 7,
    logprob: float = -2.0,
) -> SampleBatch:
    """A batch of policy `agent`'s samples with responses of `lengths` (ids 2.. cycling with
    `token_period`), each its own episode (or all turns of one, `one_episode`), behaviour logprob
    `logprob` at version 0."""
    samples = [
        Sample(
            sample_id=f"s{i}",
            episode_id="e0" if one_episode else f"e{i}",
            policy="agent",
            agent="agent",
            turn_index=i if one_episode else 0,
            reward=float(r),
            prompt_ids=np.array(prompt, dtype=np.int32),
            response_ids=(np.arange(n, dtype=np.int32) % token_period) + 2,
            logprobs=np.full(n, logprob, dtype=np.float32),
            versions=np.zeros(n, dtype=np.int32),
        )
        for i, (n, r) in enumerate(zip(lengths, rewards, strict=True))
    ]
    return SampleBatch.from_samples("agent", samples)


class OneLease:
    """A buffer stand-in whose one `pull` leases `batch` to the rank (later pulls get nothing)."""

    def __init__(self, batch: SampleBatch) -> None:
        self.lease: Lease | None = Lease(1, "agent", "agent-trainer-0", batch)

    def pull(self, policy: str, consumer: str, max_samples: int, timeout: float) -> Lease | None:
        lease, self.lease = self.lease, None
        return lease
