"""A trainer rank built in the test's process, as the driver builds one (world 1, on the `gloo`
group the trainer tests' fixture starts)."""

from __future__ import annotations

import os

from polyrl_operator.api import Policy
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
