"""A model that cannot be loaded fails the job with the policy and the URI named, and is not retried
(the same spec would fail the same way); no stack trace is what the user reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from driver_harness import make_job, policy, run

from polyrl_runtime.coordinator.failures import root_cause
from polyrl_runtime.models import ModelLoadError


def test_a_missing_model_directory_fails_the_job_naming_the_policy_and_uri(
    ray_local: Any, tmp_path: Path
) -> None:
    job = make_job(policies=[policy("agent", model={"uri": "file:///nowhere/model"})])
    driver, summary = run(job, tmp_path)
    assert summary.state == "failed" and not driver.retryable
    assert summary.message.startswith("policy agent: file:///nowhere/model: model directory")
    assert "Traceback" not in summary.message
    assert driver.progress().retryable is False


class _ActorInitFailed(Exception):
    """The shape of Ray's error for an actor whose constructor raised: only the traceback text."""

    actor_init_failed = True

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.error_msg = text


class _Wrapped(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__("wrapped")
        self.cause = cause


def test_root_cause_unwraps_method_errors_and_failed_constructors() -> None:
    original = ModelLoadError("file:///m: model directory /m does not exist (model.uri)")
    assert root_cause(_Wrapped(_Wrapped(original))) is original
    text = "Traceback ...\n  File x\npolyrl_runtime.models.hf.ModelLoadError: file:///m: no config.json\n"
    found = root_cause(_ActorInitFailed(text))
    assert isinstance(found, ModelLoadError) and str(found) == "file:///m: no config.json"
    other = _ActorInitFailed("Traceback ...\nRuntimeError: out of memory")
    assert root_cause(other) is other
