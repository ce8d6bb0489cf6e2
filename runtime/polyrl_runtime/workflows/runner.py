"""The workflow worker: runs groups of episodes and streams them into the experience buffer.

A group is `groupSize` episodes of the same task (same seed), played concurrently. When all are done,
each agent's reward becomes its learning signal: for a policy of a grouped estimator (grpo, dr_grpo,
rloo, reinforce_pp_baseline: algorithms/estimators.py), the reward minus the baseline of the same agent over its policy's
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
from polyrl_runtime.engines.api import EngineUnavailableError, SamplingParams, UnknownSnapshotError
from polyrl_runtime.engines.client import EngineClient
from polyrl_runtime.engines.pool import EnginePool
from polyrl_runtime.experience.client import BufferClient
from polyrl_runtime.experience.state import FILTERED_KEY, DropReason
from polyrl_runtime.experience.types import Episode, Ticket, Turn
from polyrl_runtime.experience.wire import EpisodeBatch
from polyrl_runtime.models import Tokenizer, load_tokenizer
from polyrl_runtime.rewards.load import RewardError
from polyrl_runtime.workflows.api import EpisodeContext, Outcome, load_workflow
from polyrl_runtime.workflows.crossplay import CrossPlayGame, CrossPlayResult, sides
from polyrl_runtime.workflows.failure import PolicyFailure
from polyrl_runtime.workflows.groups import equal_reward_agents, group_relative
from polyrl_runtime.workflows.judge import JudgeError
from polyrl_runtime.workflows.opponents import OpponentRecord, OpponentTable, opponent_score
from polyrl_runtime.workflows.overlong import Ramp, overlong_penalties, overlong_turns

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
    # Agents that played a league snapshot (`ctx.opponent`): the version each played and the score of
    # the current version's agents against it (workflows/opponents.py).
    opponents: dict[str, OpponentRecord] = field(default_factory=dict)
    opponent_policies: frozenset[str] = frozenset()  # the league policies `ctx.opponent` was asked for
    # The snapshot (policy, version) this episode was drawn first and found gone (evicted, or not
    # on the engine): the episode was played again from the start against another draw.
    replaced_snapshot: tuple[str, int] | None = None


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


# The failures a policy causes, trained on with the failure reward; every other reason is the
# machinery's or the workflow's, and its episode is dropped and played again.
POLICY_FAILURES = frozenset({"timeout", "policy_failure"})
# How long a timed-out episode waits for its requests' aborts to reach their engines before it is
# reported (a dead engine's failed abort returns at once; a hung one costs this much, once).
ABORTS_DELIVERED_S = 5.0


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


def _opponents(ctx: EpisodeContext, rewards: Mapping[str, float]) -> dict[str, OpponentRecord]:
    """The snapshots the episode's opponents played, each with the trained agents' score against it."""
    trained = {t.agent for t in ctx.turns}
    return {
        agent: OpponentRecord(policy, version, opponent_score(rewards, trained, agent))
        for agent, (policy, version) in ctx.opponents.items()
        if version is not None
    }


def marked(metadata: dict[str, Any], reason: DropReason, turns: Sequence[int]) -> dict[str, Any]:
    """`metadata` with `turns` marked for the buffer to drop for `reason` (`FILTERED_KEY`)."""
    if not turns:
        return metadata
    marks = dict(metadata.get(FILTERED_KEY) or {})
    marks[reason.value] = sorted({*marks.get(reason.value, ()), *turns})
    return {**metadata, FILTERED_KEY: marks}


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
        opponent_tables: Mapping[str, OpponentTable] | None = None,
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
        # DAPO (workflows/overlong.py, groups.py): what this worker marks for the buffer to drop.
        self.dynamic_sampling = frozenset(p.name for p in spec.policies if p.algorithm.dynamic_sampling)
        self.overlong_filtered = frozenset(p.name for p in spec.policies if p.algorithm.overlong_filter)
        self.ramps = {p.name: r for p in spec.policies if (r := Ramp.of(p)) is not None}
        # Per league policy, what `ctx.opponent` draws from (the driver's `set_opponents`); until the
        # first table, the latest version.
        self.opponent_tables: dict[str, OpponentTable] = {
            p.name: OpponentTable(p.name) for p in spec.policies if p.league is not None
        }
        self.opponent_tables.update(opponent_tables or {})
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

    def set_opponents(self, tables: Mapping[str, OpponentTable]) -> None:
        """Install the driver's opponent tables (coordinator/league.py): what `ctx.opponent` draws from."""
        self.opponent_tables.update(tables)

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
        `run_group` sets them from its group (`failure_rewards`). An episode whose league snapshot
        is gone is played once more from the start, that version left out of this worker's draws
        (the driver's next table leaves it out too); a cross-play cell is not (its versions are
        the cell's)."""
        gone: list[tuple[str, int]] = []
        report, episode = await self._play(ctx, gone)
        if not gone or ctx.stand_ins:
            return report, episode
        policy, version = gone[0]
        table = self.opponent_tables.get(policy)
        if table is not None and version in table.held:
            keep = [i for i, v in enumerate(table.held) if v != version]
            self.opponent_tables[policy] = replace(
                table, held=tuple(table.held[i] for i in keep), weights=tuple(table.weights[i] for i in keep)
            )
        log.info("episode.snapshot_replaced", episode=ctx.episode_id, policy=policy, version=version)
        again = self._context(ctx.group_id, ctx.index, ctx.seed, ctx.sampling, ctx.sample)
        report, episode = await self._play(again, [])
        report.replaced_snapshot = (policy, version)
        return report, episode

    async def _play(
        self, ctx: EpisodeContext, gone: list[tuple[str, int]]
    ) -> tuple[EpisodeReport, Episode | None]:
        """`_one`'s single play; a snapshot found gone is appended to `gone`."""
        report = EpisodeReport(ctx.episode_id, ok=False)
        try:
            try:
                result = await asyncio.wait_for(self.workflow.run_episode(ctx), self.timeout)
            finally:
                ctx.close_endpoints()
            outcome = result if isinstance(result, Outcome) else Outcome(dict(result))
            rewards = outcome.returns()  # per agent: reward plus its per-turn rewards
            for agent, penalty in overlong_penalties(ctx.calls, self.ramps).items():
                if agent in rewards:
                    rewards[agent] += penalty
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
            await self.pool.aborts_delivered(ABORTS_DELIVERED_S)  # counted before the report is
            report.reason = "timeout"
            report.error = f"episode exceeded workflow.episodeTimeoutSeconds ({self.timeout:g} s)"
        except PolicyFailure as e:
            report.reason, report.error = "policy_failure", str(e) or type(e).__name__
        except EngineUnavailableError as e:
            report.reason, report.error = "engine_error", str(e)
        except UnknownSnapshotError as e:  # evicted, or on an engine that joined after it was taken
            report.reason, report.error = "snapshot_unavailable", str(e)
            gone.append((e.policy, e.version))
        except RewardError as e:
            report.reason, report.error = "reward_error", str(e)
            log.warning("episode.failed", episode=ctx.episode_id, error=report.error)
        except JudgeError as e:
            report.reason, report.error = "judge_error", str(e)
        except Exception as e:
            if ctx.endpoint_errors and isinstance(ctx.endpoint_errors[0], EngineUnavailableError):
                # an agent framework's call through the OpenAI endpoint met it: the engine's failure
                report.reason, report.error = (
                    "engine_error",
                    f"through the OpenAI endpoint: {ctx.endpoint_errors[0]}",
                )
            else:
                report.reason = "workflow_error"
                report.error = "".join(traceback.format_exception_only(e)).strip()
            log.warning("episode.failed", episode=ctx.episode_id, error=report.error)
        else:
            report.ok = True
            report.opponents = _opponents(ctx, rewards)
            report.opponent_policies = frozenset(policy for policy, _ in ctx.opponents.values())
            meta = marked(dict(outcome.metadata), DropReason.OVERLONG, self._overlong(ctx))
            return report, _settled(report, ctx.group_id, tuple(ctx.turns), rewards, meta)
        if report.reason in POLICY_FAILURES and ctx.turns:
            report.penalised = True
            unset = {t.agent: math.nan for t in ctx.turns}
            meta = marked(
                {"failed": report.reason, "error": report.error}, DropReason.OVERLONG, self._overlong(ctx)
            )
            return report, _settled(report, ctx.group_id, tuple(ctx.turns), unset, meta)
        return report, None

    def _overlong(self, ctx: EpisodeContext) -> list[int]:
        return overlong_turns(ctx.calls, self.overlong_filtered) if self.overlong_filtered else []

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
        equal = self._equal_reward_turns(done, sizes)
        items = [
            (t, Episode(e.episode_id, e.turns, s, marked(dict(e.metadata), DropReason.ZERO_VARIANCE, turns)))
            for (_, t, e), s, turns in zip(done, signals, equal, strict=True)
        ]
        if items:
            await self.buffer.put(EpisodeBatch(items))
        if failed:
            await self.buffer.release(failed)
        return GroupReport(group_id, [r for r, _ in results], self.pool.take_dead(), time.monotonic() - start)

    def _equal_reward_turns(
        self, done: Sequence[tuple[int, Ticket, Episode]], sizes: Mapping[str, int]
    ) -> list[list[int]]:
        """Per finished episode, the indices of its turns of dynamic-sampling policies whose agent's
        sub-group had equal rewards: they carry no signal (DAPO drops them)."""
        if not self.dynamic_sampling:
            return [[] for _ in done]
        agents = {
            t.agent: sizes[t.agent] for _, _, e in done for t in e.turns if t.policy in self.dynamic_sampling
        }
        equal = equal_reward_agents([e.rewards for _, _, e in done], agents, [i for i, _, _ in done])
        return [
            [k for k, t in enumerate(e.turns) if t.agent in same]
            for (_, _, e), same in zip(done, equal, strict=True)
        ]

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
        (nothing is trained on them): per episode its mean raw reward per policy, or its error. A
        league's `ctx.opponent` is the latest version here: the pass measures the current weights."""
        sampling = (
            {n: replace(p, temperature=0.0) for n, p in self.sampling.items()} if greedy else self.sampling
        )
        latest = {name: OpponentTable(name) for name in self.opponent_tables}
        ctxs = self._contexts(eval_id, k, seed, sampling, Row(row), opponent_tables=latest)
        results = await asyncio.gather(*(self._one(c) for c in ctxs))
        return [
            r.policy_rewards if r.ok else f"episode {r.episode_id} ({r.reason}): {r.error}"
            for r, _ in results
        ]

    async def cross_play(
        self, play_id: str, seed: int, rows: Sequence[RowRef | None], greedy: bool, game: CrossPlayGame
    ) -> list[CrossPlayResult | str]:
        """One cross-play cell (workflows/crossplay.py): an episode per entry of `rows` (its eval row,
        or None), `game`'s versions playing, kept out of the buffer. Per episode its side rewards, or
        its error."""
        sampling = (
            {n: replace(p, temperature=0.0) for n, p in self.sampling.items()} if greedy else self.sampling
        )
        latest = {name: OpponentTable(name) for name in self.opponent_tables}  # a league outside the pair
        ctxs = [
            self._contexts(
                f"{play_id}e{e}", 1, seed + e, sampling, Row(ref) if ref else None, opponent_tables=latest
            )[0]
            for e, ref in enumerate(rows)
        ]
        for ctx in ctxs:
            ctx.versions, ctx.stand_ins = game.agent_versions(), game.stand_ins()
        return list(await asyncio.gather(*(self._cross_play_one(ctx, game) for ctx in ctxs)))

    async def _cross_play_one(self, ctx: EpisodeContext, game: CrossPlayGame) -> CrossPlayResult | str:
        try:
            result = await asyncio.wait_for(self.workflow.run_episode(ctx), self.timeout)
            rewards = (result if isinstance(result, Outcome) else Outcome(dict(result))).returns()
        except TimeoutError:
            await self.pool.aborts_delivered(ABORTS_DELIVERED_S)
            return f"episode {ctx.episode_id} (timeout): exceeded workflow.episodeTimeoutSeconds ({self.timeout:g} s)"
        except Exception as e:
            return f"episode {ctx.episode_id}: {''.join(traceback.format_exception_only(e)).strip()}"
        bad = {a: v for a, v in rewards.items() if not math.isfinite(v)}
        if bad:
            return f"episode {ctx.episode_id}: rewards that are not finite numbers: {bad}"
        return sides(game, rewards, ctx.roster, ctx.opponents)

    def _contexts(
        self,
        group_id: str,
        n: int,
        seed: int,
        sampling: Mapping[str, SamplingParams],
        sample: Mapping[str, Any] | None,
        *,
        opponent_tables: Mapping[str, OpponentTable] | None = None,
    ) -> list[EpisodeContext]:
        """The contexts of a group's `n` episodes (`<group id>-<index>`), all playing `sample`."""
        return [
            self._context(group_id, i, seed, sampling, sample, opponent_tables=opponent_tables)
            for i in range(n)
        ]

    def _context(
        self,
        group_id: str,
        index: int,
        seed: int,
        sampling: Mapping[str, SamplingParams],
        sample: Mapping[str, Any] | None,
        *,
        opponent_tables: Mapping[str, OpponentTable] | None = None,
    ) -> EpisodeContext:
        """Episode `index` of the group `group_id`, a fresh context (its episode played from the start)."""
        return EpisodeContext(
            episode_id=f"{group_id}-{index}",
            group_id=group_id,
            index=index,
            seed=seed,
            pool=self.pool,
            tokenizers=self.tokenizers,
            sampling=sampling,
            agent_policies=self.agent_policies,
            sample=sample,
            opponent_tables=self.opponent_tables if opponent_tables is None else opponent_tables,
        )

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
