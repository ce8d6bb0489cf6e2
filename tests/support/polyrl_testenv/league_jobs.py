"""The job of the workflow worker's league tests: `league_workflows:HigherDigit` (tests/runtime/data)
with its player and rival both agents of one LoRA policy with a league."""

from __future__ import annotations

from typing import Any

from polyrl_operator.api import RLJob


def higher_digit_job(*extra_policies: dict[str, Any], **spec: Any) -> str:
    """The job as the worker gets it (JSON), with `extra_policies` and `spec` fields added."""
    doc = {
        "apiVersion": "polyrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "t"},
        "spec": {
            "training": {"totalSteps": 1},
            "workflow": {
                "entrypoint": "league_workflows:HigherDigit",
                "args": {"policies": {"player": "agent", "rival": "agent"}},
            },
            "policies": [
                {
                    "name": "agent",
                    "model": {"uri": "builtin://tiny-qwen2"},
                    "algorithm": {"groupSize": 2, "lora": {"rank": 4}},
                    "rollout": {"engine": "torch", "gpus": 0},
                    "league": {"keep": 2},
                },
                *extra_policies,
            ],
            **spec,
        },
    }
    return RLJob.model_validate(doc).model_dump_json(by_alias=True)
