"""What the RLJob status (``polyrl_operator.planning.status``) takes from the coordinator's report:
each policy's latest evaluation pass (spec.evaluation), a league policy's rating, and each scheduled
pool's busy fraction and
switches; taken from /progress when there, kept as last written when a report has none, unset on a
pool that hosts no trainer."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from polyrl_operator.api import RLJob, RLJobStatus
from polyrl_operator.api.progress import EvalProgress, PolicyProgress, PoolProgress, Progress
from polyrl_operator.api.status import EvalStatus, PolicyStatus, PoolStatus
from polyrl_operator.planning.pods import empty_pod_plan
from polyrl_operator.planning.status import policy_statuses, pool_statuses, rating_summary
from polyrl_testenv.bad_rljobs import REPO
from polyrl_testenv.operator_fixtures import pooled_cpu_job

JOB = RLJob.model_validate(
    yaml.safe_load((REPO / "tests" / "runtime" / "data" / "selfplay-tiny.yaml").read_text())
)


PASS = EvalProgress(step=6, reward_mean=0.25, pass_at_k=0.5, k=4, rows=10)


OLD = EvalStatus(step=3, reward_mean=0.1, pass_at_k=0.2, k=4)


@pytest.mark.parametrize(
    ("old_eval", "report", "expected"),
    [
        (None, PASS, {"step": 6, "rewardMean": 0.25, "passAtK": 0.5, "k": 4}),
        (OLD, PASS, {"step": 6, "rewardMean": 0.25, "passAtK": 0.5, "k": 4}),
        (OLD, None, {"step": 3, "rewardMean": 0.1, "passAtK": 0.2, "k": 4}),  # no new pass: kept
        (None, None, None),  # a job without evaluation shows none
    ],
)
def test_policy_status_carries_the_latest_eval_pass(
    old_eval: EvalStatus | None, report: EvalProgress | None, expected: dict[str, Any] | None
) -> None:
    old = RLJobStatus(policies=[PolicyStatus(name="agent", evaluation=old_eval)])
    progress = Progress(state="running", policies=[PolicyProgress(name="agent", step=6, evaluation=report)])
    [status] = policy_statuses(JOB, old, progress, empty_pod_plan(JOB))
    wire = status.model_dump(by_alias=True, exclude_none=True, mode="json").get("evaluation")
    assert wire == expected


@pytest.mark.parametrize(
    ("old", "report", "rating", "summary"),
    [
        (None, 1147.2, 1147.2, "agent:1147"),
        (1100.0, 1147.2, 1147.2, "agent:1147"),
        (1100.0, None, 1100.0, "agent:1100"),  # no new rating: kept
        (None, None, None, None),  # no league, or no game yet: no column value
    ],
)
def test_a_league_policys_rating_reaches_its_status_and_the_ratings_column(
    old: float | None, report: float | None, rating: float | None, summary: str | None
) -> None:
    before = RLJobStatus(policies=[PolicyStatus(name="agent", rating=old)])
    progress = Progress(state="running", policies=[PolicyProgress(name="agent", step=6, rating=report)])
    [status] = policy_statuses(JOB, before, progress, empty_pod_plan(JOB))
    assert status.rating == rating and rating_summary([status]) == summary


def _two_pools() -> RLJob:
    """The pooled CPU example (pool ``shared``: the speaker's trainer and rollout) with the
    listener's rollout on a second pool, ``engines``, which hosts no trainer."""
    body = pooled_cpu_job()
    spec = body["spec"]
    spec["pools"].append({**spec["pools"][0], "name": "engines"})
    spec["policies"][1]["rollout"]["pool"] = "engines"
    return RLJob.model_validate(body)


POOLED = _two_pools()
USED = PoolProgress(name="shared", busy_fraction=0.8, switches=12, switch_seconds=3.0, turns={"speaker": 6})


@pytest.mark.parametrize(
    ("old_usage", "report", "expected"),
    [
        (None, Progress(state="running", pools=[USED]), {"busyFraction": 0.8, "switches": 12}),
        ((0.5, 6), Progress(state="running", pools=[USED]), {"busyFraction": 0.8, "switches": 12}),
        ((0.5, 6), None, {"busyFraction": 0.5, "switches": 6}),  # no report: kept
        ((0.5, 6), Progress(state="running"), {"busyFraction": 0.5, "switches": 6}),  # an older coordinator
        (None, Progress(state="starting"), {}),  # nothing reported yet
        (None, None, {}),
    ],
    ids=["reported", "updated", "no-report", "report-without-pools", "none-yet", "nothing"],
)
def test_pool_status_carries_the_busy_fraction_and_switches(
    old_usage: tuple[float, int] | None, report: Progress | None, expected: dict[str, Any]
) -> None:
    old_shared = PoolStatus(name="shared")
    if old_usage is not None:
        old_shared = old_shared.model_copy(update={"busy_fraction": old_usage[0], "switches": old_usage[1]})
    old = RLJobStatus(pools=[old_shared, PoolStatus(name="engines")])
    pools = pool_statuses(POOLED, old, report, empty_pod_plan(POOLED))
    assert pools is not None
    wire = {q.name: q.model_dump(by_alias=True, exclude_none=True, mode="json") for q in pools}
    assert {k: v for k, v in wire["shared"].items() if k in ("busyFraction", "switches")} == expected
    assert wire["engines"] == {"name": "engines", "desired": 0, "ready": 0, "roles": ["listener/rollout"]}


def test_a_pool_whose_engines_share_a_base_names_its_policies_in_status_and_on_its_pods() -> None:
    from polyrl_operator import naming
    from polyrl_operator.planning.render import render
    from polyrl_operator.settings import OperatorSettings

    doc = yaml.safe_load((REPO / "tests" / "runtime" / "data" / "selfplay-tiny.yaml").read_text())
    speaker = doc["spec"]["policies"][0]
    speaker.update(name="speaker", model={"uri": "builtin://tiny-qwen2", "dtype": "float32"})
    speaker["algorithm"]["lora"] = {"rank": 4}
    speaker["rollout"] = {"engine": "torch", "pool": "shared"}
    listener = {**speaker, "name": "listener"}
    alone = {**speaker, "name": "alone", "algorithm": {"name": "grpo", "groupSize": 4}}  # no LoRA
    doc["spec"]["policies"] = [speaker, listener, alone]
    doc["spec"]["workflow"]["args"]["policies"] = {"speaker": "speaker", "listener": "listener"}
    doc["spec"]["pools"] = [{"name": "shared", "gpus": 0}]
    job = RLJob.model_validate(doc)
    pools = pool_statuses(job, RLJobStatus(), None, empty_pod_plan(job))
    assert pools is not None
    (shared,) = pools
    wire = shared.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert wire["sharedBases"] == [
        {"model": "builtin://tiny-qwen2", "dtype": "float32", "policies": ["speaker", "listener"]}
    ]
    pods = [
        m for m in render(doc, OperatorSettings()) if m["kind"] == "Pod" and "-pool-" in m["metadata"]["name"]
    ]
    assert pods and all(
        p["metadata"]["annotations"][naming.ANNOTATION_SHARED_BASES]
        == "speaker,listener on builtin://tiny-qwen2 (float32)"
        for p in pods
    )


def test_a_frozen_policy_of_a_shared_base_is_served_by_the_pools_engines_with_no_pods_of_its_own() -> None:
    """A LoRA speaker and a frozen listener of its base on one pool: the pool's one engine per pod
    serves both (status and pod annotation name the listener, as frozen in status); the listener has
    no pod and no role slot of its own."""
    from polyrl_operator import naming
    from polyrl_operator.planning.render import render
    from polyrl_operator.roles import role_slots
    from polyrl_operator.settings import OperatorSettings

    doc = yaml.safe_load((REPO / "tests" / "runtime" / "data" / "selfplay-tiny.yaml").read_text())
    speaker = doc["spec"]["policies"][0]
    speaker.update(name="speaker", model={"uri": "builtin://tiny-qwen2", "dtype": "float32"})
    speaker["algorithm"]["lora"] = {"rank": 4}
    speaker["rollout"] = {"engine": "torch", "pool": "shared"}
    listener = {k: v for k, v in speaker.items() if k not in ("trainer", "algorithm")}
    listener.update(name="listener", frozen=True)
    doc["spec"]["policies"] = [speaker, listener]
    doc["spec"]["workflow"]["args"]["policies"] = {"speaker": "speaker", "listener": "listener"}
    doc["spec"]["pools"] = [{"name": "shared", "gpus": 0}]
    job = RLJob.model_validate(doc)
    pools = pool_statuses(job, RLJobStatus(), None, empty_pod_plan(job))
    assert pools is not None
    (shared,) = pools
    wire = shared.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert wire["roles"] == ["speaker/rollout", "listener/rollout"]
    assert wire["sharedBases"] == [
        {
            "model": "builtin://tiny-qwen2",
            "dtype": "float32",
            "policies": ["speaker", "listener"],
            "frozen": ["listener"],
        }
    ]
    assert [s.role for s in role_slots(job) if s.policy == "listener"] == []  # its rollout is the pool's
    pods = [m for m in render(doc, OperatorSettings()) if m["kind"] == "Pod"]
    names = [p["metadata"]["name"] for p in pods]
    assert not [n for n in names if "listener" in n], names  # served on the pool's pods
    pool_pods = [p for p in pods if "-pool-" in p["metadata"]["name"]]
    assert pool_pods and all(
        p["metadata"]["annotations"][naming.ANNOTATION_SHARED_BASES]
        == "speaker,listener on builtin://tiny-qwen2 (float32)"
        for p in pool_pods
    )
