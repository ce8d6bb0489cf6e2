"""The job of the workflow worker's league tests: `league_workflows:HigherDigit` (tests/runtime/data)
with its player and rival both agents of one LoRA policy with a league."""

from __future__ import annotations

from typing import Any

from polyrl_testenv.worker_jobs import worker_job


def higher_digit_job(*extra_policies: dict[str, Any], **spec: Any) -> str:
    """The job as the worker gets it (JSON), with `extra_policies` and `spec` fields added."""
    agent = {
        "name": "agent",
        "model": {"uri": "builtin://tiny-qwen2"},
        "algorithm": {"groupSize": 2, "lora": {"rank": 4}},
        "rollout": {"engine": "torch", "gpus": 0},
        "league": {"keep": 2},
    }
    args = {"policies": {"player": "agent", "rival": "agent"}}
    return worker_job("league_workflows:HigherDigit", [agent, *extra_policies], args, **spec)
