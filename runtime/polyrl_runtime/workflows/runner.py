"""The workflow worker: runs groups of episodes and streams them into the experience buffer.

A group is `groupSize` episodes of the same task (same seed), played concurrently. When all are done,
each agent's reward becomes its learning signal: for a policy of a grouped estimator (grpo, dr_grpo,
rloo: algorithms/estimators.py), the reward minus the baseline of the same agent over its policy's
`groupSize` of the group's finished episodes (group-relative; a group is the largest groupSize);
otherwise the raw reward. That signal is what the episode's samples carry (`Sample.reward`); the raw rewards stay in
`episode.metadata["rewards"]`. Finished episodes go to the buffer in one call; an episode that raised
(workflow bug, engine loss, timeout) releases its ticket and is reported with its id and reason.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from polyrl_operator.api import RLJob
from polyrl_operator.pod_contract import ENV_POD_NAME
from polyrl_runtime.algorithms.estimators import estimator, normalisation
from polyrl_runtime.cpusets import pin_from_env
from polyrl_runtime.data.row import Row, RowRef
from polyrl_runtime.engines.api import EngineUnavailableError, SamplingParams
from polyrl_runtime.engines.client import EngineClient
from polyrl_runtime.engines.pool import EnginePool
from polyrl_runtime.experience.client import BufferClient
from polyrl_runtime.experience.types import Episode, Ticket, Turn
from polyrl_runtime.experience.wire import EpisodeBatch
from polyrl_runtime.models import Tokenizer, load_tokenizer
from polyrl_runtime.rewards.load import RewardError
from polyrl_runtime.workflows.api import EpisodeContext, Outcome, load_workflow
from polyrl_runtime.workflows.failure import PolicyFailure

log = structlog.get_logger(__name__)


@dataclass
class EpisodeReport:
    episode_id: str
    ok: bool
    rewards: dict[str, float] = field(default_factory=dict)  # raw, per agent
    policy_rewards: dict[str, float] = field(default_factory=dict)  # mean raw reward per policy
    samples: dict[str, int] = field(default_factory=dict)  # per policy
    tokens: int = 0
    reason: str = ""  # failure: workflow_error | engine_error | reward_error | timeout | policy_failure
    # A policy-caused failure (timeout, policy_failure) trained on with the failure reward: counted
    # by its reason and in the step's rewards alike.
    penalised: bool = False
    error: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)  # the episode's version vector


@dataclass
class GroupReport:
    group_id: str
    episodes: list[EpisodeReport]
    dead_engines: set[str]
    wall_s: float


# One group to play: (group id, seed, its episodes' tickets, its data row or None).
EpisodeGroup = tuple[str, int, Sequence[Ticket], RowRef | None]


@dataclass(frozen=True)
class WorkerStats:
    """What the driver polls of a workflow worker (coordinator/fleet.py)."""

    in_flight: int  # episodes running
    busy_s: float  # seconds with at least one episode running (utilisation)
    pod: str
    engine_requests: dict[str, int]  # engine name -> requests sent to it and not answered yet
    routes_epoch: int  # the routing table it holds


def group_relative(
    rewards: Sequence[Mapping[str, float]],
    group_sizes: Mapping[str, int],
    members: Sequence[int] | None = None,
    leave_one_out: frozenset[str] = frozenset(),
    std_scaled: frozenset[str] = frozenset(),
) -> list[dict[str, float]]:
    """Per agent of a grouped estimator (`group_sizes`: agent -> its policy's groupSize): its reward
    minus its baseline over its sub-group, the members whose position in the group (`members`,
    default 0..n-1) divided by its group size is the same. The baseline is the sub-group's mean
    reward, or for agents in `leave_one_out` (rloo) the mean of the sub-group's other members (0
    signal for a member alone). A group is as many episodes as the largest groupSize of its
    policies, so each policy's baseline is over its own groupSize episodes of the task (the last
    sub-group is smaller where the sizes do not divide); other agents keep the raw reward. Agents
    in `std_scaled` (advantageNorm per-group) have their signal divided by the standard deviation
    of their sub-group's rewards plus `GROUP_STD_EPS`: a sub-group of equal rewards keeps 0."""
    out = [dict(r) for r in rewards]
    position = list(range(len(rewards))) if members is None else list(members)
    for agent, size in group_sizes.items():
        subgroups: dict[int, list[int]] = {}
        for i, r in enumerate(rewards):
            if agent in r:
                subgroups.setdefault(position[i] // size, []).append(i)
        for rows in subgroups.values():
            total, n = sum(rewards[i][agent] for i in rows), len(rows)
            mean = total / n
            scale = 1.0
            if agent in std_scaled:
                scale = math.sqrt(sum((rewards[i][agent] - mean) ** 2 for i in rows) / n) + GROUP_STD_EPS
            for i in rows:
                own = rewards[i][agent]
                if agent in leave_one_out:
                    out[i][agent] = (own - (total - own) / (n - 1) if n > 1 else 0.0) / scale
                else:
                    out[i][agent] = (own - mean) / scale
    return out


# GRPO's std normalisation adds this to the group's std (TRL's value): a group whose rewards
# differ by a little less than it is not blown up into +-1 signals.
GROUP_STD_EPS = 1e-4


# The failures a policy causes, trained on with the failure reward; every other reason is the
# machinery's or the workflow's, and its episode is dropped and played again.
POLICY_FAILURES = frozenset({"timeout", "policy_failure"})


def _settled(
    report: EpisodeReport,
    group_id: str,
    turns: tuple[Turn, ...],
    rewards: dict[str, float],
    meta: dict[str, Any],
) -> Episode:
    """The episode of these turns with these per-agent rewards; sets the report's per-policy figures."""
    report.rewards, report.metadata, report.samples, report.tokens = rewards, meta, {}, 0
    per_policy: dict[str, list[float]] = {}
    for t in turns:
        report.samples[t.policy] = report.samples.get(t.policy, 0) + 1
        report.tokens += int(t.loss_mask.sum())  # sampled tokens (not a conversation's context)
        per_policy.setdefault(t.policy, []).append(rewards[t.agent])
    report.policy_rewards = {p: sum(v) / len(v) for p, v in per_policy.items()}
    episode = Episode(report.episode_id, turns, rewards, {"rewards": rewards, "group": group_id, **meta})
    report.versions = dict(episode.versions)
    return episode


def failure_rewards(
    finished: Sequence[Mapping[str, float]], agents: Sequence[str], fixed: float | None
) -> dict[str, float] | None:
    """The rewards of a penalised episode's `agents`: `fixed` (workflow.failureReward), else each
    agent's lowest reward among the group's `finished` episodes; None when an agent has none there
    (no reward to give the failure: the episode is dropped like any other failure)."""
    if fixed is not None:
        return dict.fromkeys(agents, fixed)
    out: dict[str, float] = {}
    for agent in agents:
        seen = [r[agent] for r in finished if agent in r]
        if not seen:
            return None
        out[agent] = min(seen)
    return out


class WorkflowWorker:
    """Ray actor (async). One per workflow pod or, locally, per `workflow.replicas.min`."""

    def __init__(
        self,
        name: str,
        job_json: str,
        buffer: BufferClient,
        routes: Mapping[str, Mapping[str, EngineClient]],
        *,
        routes_epoch: int = 0,
    ) -> None:
        pin_from_env()
        self.name = name
        self.routes_epoch = routes_epoch
        self.job = RLJob.model_validate_json(job_json)
        spec = self.job.spec
        self.workflow, self.agent_policies = load_workflow(spec.workflow.entrypoint, spec.workflow.args)
        self.buffer = buffer
        self.pool = EnginePool(routes)
        self.timeout = spec.workflow.episode_timeout_seconds
        self.failure_reward = spec.workflow.failure_reward
        self.tokenizers: dict[str, Tokenizer] = {
            p.name: load_tokenizer(p.model.uri, trust_remote_code=p.model.trust_remote_code)
            for p in spec.policies
        }
        self.sampling = {
            p.name: SamplingParams(
                temperature=p.rollout.sampling.temperature,
                top_p=p.rollout.sampling.top_p,
                max_new_tokens=p.rollout.sampling.max_new_tokens,
            )
            for p in spec.policies
        }
        grouped = [(p, estimator(p.algorithm.name)) for p in spec.policies]
        self.group_sizes = {p.name: p.algorithm.group_size for p, e in grouped if e.grouped}
        self.leave_one_out = {p.name for p, e in grouped if e.baseline == "leave_one_out"}
        self.std_scaled = {
            p.name
            for p, _ in grouped
            if normalisation(p.algorithm.name, p.algorithm.advantage_norm) == "per-group"
        }
        self.in_flight = 0
        self._busy_s = 0.0
        self._busy_since: float | None = None

    def set_routes(self, routes: Mapping[str, Mapping[str, EngineClient]], epoch: int = 0) -> None:
        """Install the driver's routing table `epoch`; an older one arriving late is ignored (calls
        to a concurrent actor may run out of order)."""
        if epoch and epoch < self.routes_epoch:
            return
        self.routes_epoch = max(epoch, self.routes_epoch)
        self.pool.set_routes(routes)

    def stats(self) -> WorkerStats:
        busy = self._busy_s + (time.monotonic() - self._busy_since if self._busy_since else 0.0)
        return WorkerStats(
            in_flight=self.in_flight,
            busy_s=busy,
            pod=os.environ.get(ENV_POD_NAME, ""),
            engine_requests=self.pool.outstanding(),
            routes_epoch=self.routes_epoch,
        )

    def _track(self, delta: int) -> None:
        now = time.monotonic()
        if self.in_flight and self._busy_since is not None:
            self._busy_s += now - self._busy_since
        self.in_flight += delta
        self._busy_since = now if self.in_flight else None

    async def _one(self, ctx: EpisodeContext) -> tuple[EpisodeReport, Episode | None]:
        """The episode's report and, when it is to be trained on, its Episode. A policy-caused
        failure with turns comes back `penalised`, with an Episode whose rewards are NaN until
        `run_group` sets them from its group (`failure_rewards`)."""
        report = EpisodeReport(ctx.episode_id, ok=False)
        try:
            result = await asyncio.wait_for(self.workflow.run_episode(ctx), self.timeout)
            outcome = result if isinstance(result, Outcome) else Outcome(dict(result))
            rewards = outcome.returns()  # per agent: reward plus its per-turn rewards
            bad = {a: v for a, v in rewards.items() if not math.isfinite(v)}
            if bad:  # never into a group's baseline: one NaN makes the policy's whole step NaN
                raise RewardError(
                    f"episode {ctx.episode_id}: workflow {self.job.spec.workflow.entrypoint} gave "
                    f"agents a reward that is not a finite number: {bad}"
                )
            if not ctx.turns:
                raise ValueError("the episode made no agent turn")
            missing = {t.agent for t in ctx.turns} - set(rewards)
            if missing:
                raise ValueError(f"no reward for agents {sorted(missing)}")
        except TimeoutError:
            report.reason = "timeout"
            report.error = f"episode exceeded workflow.episodeTimeoutSeconds ({self.timeout:g} s)"
        except PolicyFailure as e:
            report.reason, report.error = "policy_failure", str(e) or type(e).__name__
        except EngineUnavailableError as e:
            report.reason, report.error = "engine_error", str(e)
        except RewardError as e:
            report.reason, report.error = "reward_error", str(e)
            log.warning("episode.failed", episode=ctx.episode_id, error=report.error)
        except Exception as e:
            report.reason = "workflow_error"
            report.error = "".join(traceback.format_exception_only(e)).strip()
            log.warning("episode.failed", episode=ctx.episode_id, error=report.error)
        else:
            report.ok = True
            return report, _settled(report, ctx.group_id, tuple(ctx.turns), rewards, dict(outcome.metadata))
        if report.reason in POLICY_FAILURES and ctx.turns:
            report.penalised = True
            unset = {t.agent: math.nan for t in ctx.turns}
            meta = {"failed": report.reason, "error": report.error}
            return report, _settled(report, ctx.group_id, tuple(ctx.turns), unset, meta)
        return report, None

    async def run_group(
        self, group_id: str, seed: int, tickets: Sequence[Ticket], row: RowRef | None = None
    ) -> GroupReport:
        """Play one group (every member on the same data `row`, if the job has data) and put its
        finished episodes in the buffer."""
        start = time.monotonic()
        sample = Row(row) if row is not None else None
        self._track(len(tickets))
        try:
            ctxs = self._contexts(group_id, len(tickets), seed, self.sampling, sample)
            results = await asyncio.gather(*(self._one(c) for c in ctxs))
        finally:
            self._track(-len(tickets))
        results = self._penalise(results)
        done = [
            (i, t, e) for i, (t, (_, e)) in enumerate(zip(tickets, results, strict=True)) if e is not None
        ]
        failed = [t for t, (_, e) in zip(tickets, results, strict=True) if e is None]
        sizes = {
            t.agent: self.group_sizes[t.policy]
            for _, _, e in done
            for t in e.turns
            if t.policy in self.group_sizes
        }
        loo = frozenset(t.agent for _, _, e in done for t in e.turns if t.policy in self.leave_one_out)
        scaled = frozenset(t.agent for _, _, e in done for t in e.turns if t.policy in self.std_scaled)
        signals = group_relative([e.rewards for _, _, e in done], sizes, [i for i, _, _ in done], loo, scaled)
        items = [
            (t, Episode(e.episode_id, e.turns, s, e.metadata))
            for (_, t, e), s in zip(done, signals, strict=True)
        ]
        if items:
            await self.buffer.put(EpisodeBatch(items))
        if failed:
            await self.buffer.release(failed)
        return GroupReport(group_id, [r for r, _ in results], self.pool.take_dead(), time.monotonic() - start)

    def _penalise(
        self, results: Sequence[tuple[EpisodeReport, Episode | None]]
    ) -> list[tuple[EpisodeReport, Episode | None]]:
        """The group's results with each penalised episode's rewards set (`failure_rewards`), or
        its episode dropped where no reward can be given."""
        finished = [e.rewards for r, e in results if e is not None and r.ok]
        out: list[tuple[EpisodeReport, Episode | None]] = []
        for r, e in results:
            if e is None or not r.penalised:
                out.append((r, e))
                continue
            rewards = failure_rewards(finished, sorted(e.rewards), self.failure_reward)
            if rewards is None:
                r.penalised = False
                out.append((r, None))
                continue
            meta = {k: v for k, v in e.metadata.items() if k not in ("rewards", "group")}
            out.append((r, _settled(r, str(e.metadata["group"]), e.turns, rewards, meta)))
        return out

    async def evaluate(
        self, eval_id: str, seed: int, row: RowRef, k: int, greedy: bool
    ) -> list[dict[str, float] | str]:
        """`k` episodes on the eval `row` with the engines' current weights, kept out of the buffer
        (nothing is trained on them): per episode its mean raw reward per policy, or its error."""
        sampling = (
            {n: replace(p, temperature=0.0) for n, p in self.sampling.items()} if greedy else self.sampling
        )
        ctxs = self._contexts(eval_id, k, seed, sampling, Row(row))
        results = await asyncio.gather(*(self._one(c) for c in ctxs))
        return [
            r.policy_rewards if r.ok else f"episode {r.episode_id} ({r.reason}): {r.error}"
            for r, _ in results
        ]

    def _contexts(
        self, group_id: str, n: int, seed: int, sampling: dict[str, SamplingParams], sample: Row | None
    ) -> list[EpisodeContext]:
        """The contexts of a group's `n` episodes (`<group id>-<index>`), all playing `sample`."""
        return [
            EpisodeContext(
                episode_id=f"{group_id}-{i}",
                group_id=group_id,
                index=i,
                seed=seed,
                pool=self.pool,
                tokenizers=self.tokenizers,
                sampling=sampling,
                agent_policies=self.agent_policies,
                sample=sample,
            )
            for i in range(n)
        ]

    async def run_groups(self, groups: Sequence[EpisodeGroup]) -> list[GroupReport | str]:
        """Several groups in one call, played concurrently, each put in the buffer as soon as it is
        done. A Ray call costs about a millisecond of CPU here, as much as a group's own work, so the
        driver dispatches up to a few groups per call. Per group: its report, or the error that kept
        its episodes out of the buffer (the driver releases those)."""
        results = await asyncio.gather(*(self.run_group(*g) for g in groups), return_exceptions=True)
        out: list[GroupReport | str] = []
        for r in results:
            if isinstance(r, asyncio.CancelledError):
                raise r
            out.append(r if isinstance(r, GroupReport) else f"{type(r).__name__}: {r}")
        return out
