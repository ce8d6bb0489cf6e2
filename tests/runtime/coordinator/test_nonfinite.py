"""Training steps that skipped an optimizer step for a non-finite gradient (coordinator/nonfinite.py):
`algorithm.maxNonFiniteSteps` of them in a row fail the policy's trainer through the path of any
trainer failure (policy_restart.verdict), a step that skipped none starts the count again, and the
step's metrics row stays strict JSON."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator
from dataclasses import replace
from types import SimpleNamespace
from typing import ClassVar
from unittest.mock import AsyncMock, MagicMock

import pytest

from polyrl_operator.api import Algorithm
from polyrl_runtime.coordinator.job_state import PolicyRun
from polyrl_runtime.coordinator.metrics.records import StepRecord
from polyrl_runtime.coordinator.metrics.sinks import scalars
from polyrl_runtime.coordinator.nonfinite import NonFiniteGradientError, NonFiniteStreak, gradient_metrics
from polyrl_runtime.coordinator.policy_restart import verdict
from polyrl_runtime.coordinator.training import PolicyTrainer, StepLimits, TrainingParts
from polyrl_runtime.trainers.api import StepResult

from .driver_harness import make_job, policy


def _results(skipped: int, norm: float, world: int = 2) -> list[StepResult]:
    return [
        StepResult(
            rank=r, lease_id=None, samples=4, tokens=20, loss=0.1, grad_norm=norm, skipped_nonfinite=skipped
        )
        for r in range(world)
    ]


SKIPPED = _results(1, math.nan)
FINE = _results(0, 0.7)


def test_the_limit_in_a_row_fails_with_the_step_and_the_norm() -> None:
    streak = NonFiniteStreak("speaker", 3)
    streak.check(4, SKIPPED)
    streak.check(5, SKIPPED)
    with pytest.raises(NonFiniteGradientError) as failed:
        streak.check(6, SKIPPED)
    message = str(failed.value)
    assert message.startswith(
        "the gradient norm was not finite for 3 training steps in a row (last: step 6, norm nan"
    )
    assert "check the rewards, the learning rate and the model's dtype" in message
    assert streak.count == 0  # the failure restarts or stops the trainer: counting starts again


def test_a_step_that_skipped_nothing_starts_the_count_again() -> None:
    streak = NonFiniteStreak("speaker", 3)
    for step, results in enumerate([SKIPPED, SKIPPED, FINE, SKIPPED, SKIPPED, FINE, SKIPPED], start=1):
        streak.check(step, results)  # never 3 in a row
    assert streak.count == 1
    streak.check(8, SKIPPED)
    with pytest.raises(NonFiniteGradientError, match="last: step 9, norm inf"):
        streak.check(9, _results(2, math.inf))


def test_a_limit_of_one_fails_at_the_first_and_a_finite_last_norm_is_not_named() -> None:
    # ppo: the step skipped one optimizer step, its last one was finite
    with pytest.raises(NonFiniteGradientError, match=r"for 1 training step in a row \(last: step 2; "):
        NonFiniteStreak("speaker", 1).check(2, _results(1, 0.4))


def test_the_failure_takes_the_path_of_any_trainer_failure() -> None:
    class _Fleet:
        colocated: frozenset[str] = frozenset()
        shared_trainers: ClassVar[dict[str, tuple[str, ...]]] = {}

    spec = make_job(policies=[policy("speaker"), policy("listener")]).spec
    streak = NonFiniteStreak("speaker", 1)
    with pytest.raises(NonFiniteGradientError) as failed:
        streak.check(5, SKIPPED)
    v = verdict(spec, _Fleet(), PolicyRun("speaker", [], step=4), failed.value)  # type: ignore[arg-type]
    assert v.action == "restart"  # the job's default failurePolicy: restart from the latest checkpoint
    assert v.message.startswith(
        "policy speaker: trainer failed at step 5: NonFiniteGradientError: the gradient norm was not "
        "finite for 1 training step in a row (last: step 5, norm nan"
    )


def test_the_default_limit_and_its_bounds() -> None:
    assert Algorithm().max_non_finite_steps == 3
    assert Algorithm.model_validate({"maxNonFiniteSteps": 10}).max_non_finite_steps == 10
    for bad in (0, 1001):
        with pytest.raises(ValueError, match="maxNonFiniteSteps"):
            Algorithm.model_validate({"maxNonFiniteSteps": bad})


def test_a_skipped_steps_row_is_strict_json_without_its_norm() -> None:
    fields = gradient_metrics(_results(1, math.nan))
    assert fields == {"grad_norm": None, "nonfinite_grad_steps": 1}
    assert gradient_metrics(FINE) == {"grad_norm": 0.7, "nonfinite_grad_steps": 0}
    rec = StepRecord.before_training("speaker", 0, 1.0, None, None)
    assert rec.row()["nonfinite_grad_steps"] == 0
    row = replace(rec, **fields).row()
    json.dumps(row, allow_nan=False)  # no NaN token in metrics.jsonl
    values = scalars(row)
    assert "grad_norm" not in values and values["nonfinite_grad_steps"] == 1.0


async def test_a_policys_training_step_fails_its_trainer_at_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wiring in coordinator/training.py: the step that completes the streak raises from
    `train_step` (before its samples are acked or its weights published), and `_step` hands it to
    `_failed` as any trainer failure: here a restart, the job's default."""
    job = make_job(policies=[policy("speaker", algorithm={"maxNonFiniteSteps": 2}), policy("listener")])
    run = PolicyRun("speaker", [], step=4)
    control = MagicMock()
    parts = TrainingParts(
        control=control,
        buffer=AsyncMock(),
        fleet=SimpleNamespace(colocated=frozenset(), shared_trainers={}),  # type: ignore[arg-type]
        producer=MagicMock(),
        checkpointer=MagicMock(),
        registry=MagicMock(),
        record=AsyncMock(),
        evaluator=None,
        pools=SimpleNamespace(training=lambda name: _no_turn()),  # type: ignore[arg-type]
        skew=MagicMock(),
        leagues=MagicMock(),
    )
    trainer = PolicyTrainer(job, run, parts, StepLimits(group_size=2, stall_timeout_s=60.0))
    assert trainer.nonfinite.limit == 2
    monkeypatch.setattr(trainer, "_train_ranks", AsyncMock(return_value=SKIPPED))
    trainer.nonfinite.count = 1  # the previous step skipped too
    assert await trainer._step(8) == "restart"
    parts.buffer.ack.assert_not_called()  # its samples go back to the buffer with the old ranks
    kind, data = control.emit.call_args.args[0], control.emit.call_args.kwargs
    assert kind == "policy_restarting" and data["policy"] == "speaker"
    assert (
        "trainer failed at step 5: NonFiniteGradientError: the gradient norm was not finite for 2"
        in data["error"]
    )
    assert run.trainer_state == "restarting" and run.step == 4


@contextlib.asynccontextmanager
async def _no_turn() -> AsyncIterator[None]:
    yield None
