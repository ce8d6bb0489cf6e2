"""RLJobs as a workflow worker gets them (JSON), for tests that build a `WorkflowWorker` directly."""

from __future__ import annotations

from typing import Any

from polyrl_operator.api import RLJob


def worker_job(
    entrypoint: str, policies: list[dict[str, Any]], args: dict[str, Any] | None = None, **spec: Any
) -> str:
    """A one-step job of `entrypoint` (its `args`) over `policies`, with `spec` fields added."""
    doc = {
        "apiVersion": "polyrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "t"},
        "spec": {
            "training": {"totalSteps": 1},
            "workflow": {"entrypoint": entrypoint, "args": args or {}},
            "policies": policies,
            **spec,
        },
    }
    return RLJob.model_validate(doc).model_dump_json(by_alias=True)
