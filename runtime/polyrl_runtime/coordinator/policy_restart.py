"""One policy's trainer failing stays that policy's: what happens to it, and its replacement ranks.

When a training step of policy p fails (a rank raised, died or lost its pod), the job does not stop:

    restart  (restarts < maxRestarts): p's ranks are killed and started again (on a pod: the
             operator recreates the trainer pod, whose resource units the new ranks wait for); they
             load p's part of the latest complete checkpoint and publish its weights as a version
             past every one p's engines served. Meanwhile p's engines serve its last version and
             the other policies train on; p's episodes follow the staleness rules.
    freeze   (out of restarts, onPolicyFailure freeze): p trains no more. Its engines keep serving
             its last version, its samples are dropped as policy_finished, the others train on.
    fail     (out of restarts, onPolicyFailure failJob; or a trainer that cannot restart alone):
             the job fails.

The limits are spec.policy_failure(p): the policy's own failurePolicy over the job's. A trainer
that cannot restart alone: one that shares its process with an engine (`polyrl run` on CPU), one
trainer for several policies' adapters, or ranks on a device pool; the job restarts instead, as
the coordinator's failure does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Literal

import structlog

from polyrl_operator.api import RLJobSpec
from polyrl_runtime.config import resource_name
from polyrl_runtime.coordinator.failures import root_cause
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.coordinator.job_state import JobControl, PolicyRun
from polyrl_runtime.experience.client import BufferClient
from polyrl_runtime.trainers.client import TrainerRankClient

log = structlog.get_logger(__name__)

# How long replacement ranks may wait for their units (a trainer pod recreated and joined): the
# same bound as a worker pod's wait for the head.
RANKS_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Verdict:
    action: Literal["restart", "freeze", "fail"]
    message: str
    retryable: bool = True  # "fail": whether restarting the whole job may help


def why_not_alone(spec: RLJobSpec, fleet: Fleet, policy: str) -> str | None:
    """Why `policy`'s trainer cannot restart without the others, or None when it can."""
    if policy in fleet.colocated:
        return "its trainer shares a process with its first engine"
    if policy in fleet.shared_trainers:
        return "its trainer serves every adapter of its shared base"
    if spec.trainer_placement(spec.policy(policy)).pool is not None:
        return "its trainer ranks take turns on a device pool"
    return None


def verdict(spec: RLJobSpec, fleet: Fleet, run: PolicyRun, error: BaseException) -> Verdict:
    """What follows the failure `error` of `run`'s training step (see the module docstring)."""
    cause = root_cause(error)
    what = f"policy {run.name}: trainer failed at step {run.step + 1}: {type(cause).__name__}: {cause}"
    alone = why_not_alone(spec, fleet, run.name)
    if alone is not None:
        return Verdict("fail", f"{what} ({alone}: the job restarts)")
    limit, action = spec.policy_failure(run.name)
    if run.restarts < limit:
        return Verdict("restart", f"{what}; restarting its trainer ({run.restarts + 1}/{limit})")
    if action == "freeze":
        return Verdict("freeze", f"{what}; out of restarts ({limit}): frozen at step {run.step}")
    return Verdict("fail", f"{what}; out of restarts ({limit}, onPolicyFailure failJob)", retryable=False)


async def replace_ranks(
    run: PolicyRun,
    spec: RLJobSpec,
    fleet: Fleet,
    buffer: BufferClient,
    control: JobControl,
    *,
    deadline: float,
) -> list[TrainerRankClient] | None:
    """Kill `run`'s ranks, give back what they leased, start new ones and wait until they are up
    (until the monotonic `deadline`); None when the job stops first. The wait is logged with what
    it waits for.

    A new rank may land on the lost pod's Ray node, which Ray counts alive until its heartbeats
    time out, and die there before it runs: the caller starts over (`actor_gone`)."""
    for i, rank in enumerate(run.ranks):
        rank.kill()
        await buffer.consumer_failed(f"{run.name}-trainer-{i}")
    ranks = fleet.new_trainers(spec.policy(run.name), buffer)
    unit = resource_name(run.name, "trainer")
    log.info(
        "policy.trainer_waits_for_ranks",
        policy=run.name,
        ranks=len(ranks),
        resource=unit,
        timeout_s=round(deadline - time.monotonic()),
        why="its new ranks start once a unit of the resource is free (a trainer pod is replaced)",
    )
    ready: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*(r.ready() for r in ranks)))
    stopping: asyncio.Future[Any] = asyncio.ensure_future(control.stop.wait())
    try:
        done, _ = await asyncio.wait(
            {ready, stopping}, timeout=max(deadline - time.monotonic(), 0.0), return_when="FIRST_COMPLETED"
        )
    finally:
        stopping.cancel()
    if ready not in done:
        ready.cancel()
        for r in ranks:
            r.kill()
        if control.stop.is_set():
            return None
        raise TimeoutError(
            f"no {unit} unit for {len(ranks)} new trainer ranks within {RANKS_TIMEOUT_S:.0f} s"
        )
    try:
        ready.result()
    except Exception:
        for r in ranks:
            r.kill()
        raise
    return ranks
