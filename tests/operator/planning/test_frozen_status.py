"""A frozen policy (`frozen: true`) in the operator's plan and status: no trainer slot or pods,
`trainerState: frozen` from the start (before any report), not a PolicyFrozen failure, and the job's
step is the trained policies' smallest."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from polyrl_operator.api import RLJob, RLJobStatus
from polyrl_operator.api.progress import PolicyProgress, Progress
from polyrl_operator.planning.pods import empty_pod_plan
from polyrl_operator.planning.status import frozen_condition, policy_events, policy_statuses, trained_steps
from polyrl_operator.roles import role_slots
from polyrl_testenv.bad_rljobs import EXAMPLES

JOB = RLJob.model_validate(yaml.safe_load((EXAMPLES / "signal-game-frozen-listener-cpu.yaml").read_text()))


def test_a_frozen_policy_has_no_trainer_slot() -> None:
    slots = [(s.role, s.policy) for s in role_slots(JOB)]
    assert ("trainer", "speaker") in slots and ("rollout", "listener") in slots
    assert ("trainer", "listener") not in slots


def test_it_is_frozen_from_the_start_and_no_failure() -> None:
    for progress in (None, Progress(state="running", policies=[PolicyProgress(name="speaker", step=4)])):
        speaker, listener = policy_statuses(JOB, RLJobStatus(), progress, empty_pod_plan(JOB))
        assert listener.trainer_state == "frozen" and listener.trainer.desired == 0
        assert speaker.trainer_state != "frozen"
        assert frozen_condition(JOB, [speaker, listener]) == (False, "NotFrozen", "")
        assert policy_events(JOB, RLJobStatus(), RLJobStatus(policies=[speaker, listener])) == ()
    assert trained_steps(JOB, [speaker, listener]) == [4]


@pytest.mark.parametrize(
    ("fields", "where", "says"),
    [
        ({"trainer": {"gpus": 0}}, "trainer", "leave trainer unset"),
        ({"algorithm": {"lora": {"rank": 8}}}, "algorithm.lora", "no LoRA adapter to train"),
        ({"failurePolicy": {"maxRestarts": 1}}, "failurePolicy", "no trainer to restart"),
        (
            {"algorithm": {"name": "ppo", "groupSize": 1, "critic": {}}},
            "algorithm.critic",
            "no value model to train",
        ),
    ],
)
def test_a_frozen_policy_refuses_what_only_training_uses(
    fields: dict[str, Any], where: str, says: str
) -> None:
    doc = JOB.to_k8s()
    doc["spec"]["policies"][1] = {
        "name": "listener",
        "model": {"uri": "builtin://tiny"},
        "frozen": True,
        **fields,
    }
    with pytest.raises(ValidationError) as e:
        RLJob.model_validate(doc)
    assert where in str(e.value) and says in str(e.value)


def test_the_defaults_the_server_fills_in_are_no_trainer() -> None:
    """The API server stores a frozen policy with the trainer's defaults filled in: that reads back."""
    again = RLJob.model_validate(JOB.to_k8s())
    assert again.spec.policies[1].frozen and again.spec.policies[1].trainer_pool is None
    every = JOB.to_k8s()
    every["spec"]["policies"][0]["frozen"] = True
    every["spec"]["policies"][0].pop("trainer")
    with pytest.raises(ValidationError, match="at least one policy must be trained"):
        RLJob.model_validate(every)
