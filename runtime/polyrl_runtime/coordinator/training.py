"""One policy's training: wait for one step of samples, train every rank on its share, sync the new
weights to the engines, then grant the buffer more credit (see driver.py for the whole loop).

`PolicyTrainer` holds one policy's `PolicyRun` and the job's parts its step uses (`TrainingParts`);
`train_step` is one step, every cross-process hop in order, and each finished step becomes a
`StepRecord` handed to `record`."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from typing import Literal

import structlog

from polyrl_operator.api import RLJob
from polyrl_runtime.actors import actor_gone
from polyrl_runtime.algorithms.estimators import normalisation
from polyrl_runtime.algorithms.step_metrics import over_ranks
from polyrl_runtime.coordinator import policy_restart
from polyrl_runtime.coordinator.checkpoints.checkpointer import Checkpointer
from polyrl_runtime.coordinator.checkpoints.store import TRAINER_TAG, CheckpointRef
from polyrl_runtime.coordinator.evaluation import Evaluator
from polyrl_runtime.coordinator.failures import root_cause
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.coordinator.job_state import JobControl, PolicyRun
from polyrl_runtime.coordinator.league import Leagues
from polyrl_runtime.coordinator.metrics.records import StepRecord, Totals
from polyrl_runtime.coordinator.nonfinite import NonFiniteStreak, gradient_metrics
from polyrl_runtime.coordinator.pool_scheduler import DevicePools
from polyrl_runtime.coordinator.producer import EpisodeProducer
from polyrl_runtime.coordinator.starvation import Starvation
from polyrl_runtime.coordinator.version_skew import SkewGate
from polyrl_runtime.experience.buffer import DropReason, PolicyStats
from polyrl_runtime.experience.client import BufferClient
from polyrl_runtime.trainers.api import StepResult, node_local_ranks
from polyrl_runtime.weights import VersionRegistry, sender_options
from polyrl_runtime.weights.endpoints import PolicyWeightSync

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class TrainingParts:
    """The job's parts every policy's trainer works with (one object, shared by all of them)."""

    control: JobControl
    buffer: BufferClient
    fleet: Fleet
    producer: EpisodeProducer
    checkpointer: Checkpointer
    registry: VersionRegistry
    record: Callable[[StepRecord], Awaitable[None]]  # where each step's record goes (metrics/log.py)
    evaluator: Evaluator | None
    pools: DevicePools  # turns on the device pools the policies' roles share
    skew: SkewGate  # holds a policy back that would get too far ahead (spec.maxVersionSkew, wait)
    leagues: Leagues  # snapshots of the league policies after their syncs (coordinator/league.py)


@dataclass(frozen=True)
class StepLimits:
    """The driver's settings a step's wait obeys."""

    group_size: int  # episodes of one group: credit for less is never granted
    stall_timeout_s: float  # no credit, nothing buffered or in flight this long: the job fails


class PolicyTrainer:
    """The training loop of one policy and the weight sync after each of its steps."""

    def __init__(self, job: RLJob, run: PolicyRun, parts: TrainingParts, limits: StepLimits) -> None:
        self.spec, self.run, self.control = job.spec, run, parts.control
        self.evaluator = parts.evaluator
        self.policy = next(p for p in job.spec.policies if p.name == run.name)
        self.buffer, self.fleet, self.producer = parts.buffer, parts.fleet, parts.producer
        self.checkpointer, self.registry, self.record = parts.checkpointer, parts.registry, parts.record
        self.pools, self.skew, self.leagues = parts.pools, parts.skew, parts.leagues
        self.stall_timeout_s, self.group_size = limits.stall_timeout_s, limits.group_size
        self.episodes_per_step = job.spec.training.episodes_per_step
        self.total = job.spec.training.total_steps
        self._totals = Totals()  # at the previous step record (or the loop's start)
        self.transport = ""  # the policy's weight transport, once `connect` has run
        self.nonfinite = NonFiniteStreak(run.name, self.policy.algorithm.max_non_finite_steps)

    async def setup(self, ref: CheckpointRef | None) -> None:
        """Rendezvous the ranks and build their models; load the checkpoint if it has this policy."""
        run = self.run
        addr, port = await run.ranks[0].address()
        nodes = await asyncio.gather(*(r.node_id() for r in run.ranks))
        local = node_local_ranks(nodes)
        await asyncio.gather(*(r.setup(addr, port, i) for r, i in zip(run.ranks, local, strict=True)))
        if ref is not None and run.name in ref.state["policies"]:
            d = ref.trainer_dir(run.name)  # each rank downloads it first when it is in an object store
            await asyncio.gather(*(r.load(d, TRAINER_TAG) for r in run.ranks))
            run.step = int(ref.state["policies"][run.name]["step"])
        elif ref is not None:  # a policy added to the job since the checkpoint starts from its model
            log.info("policy.not_in_checkpoint", policy=run.name, checkpoint=ref.location)

    async def connect(self, transport: str) -> None:
        """Connect the weight sync to the policy's engines and publish the starting weights."""
        run, self.transport = self.run, transport
        engines = {n: s.actor for n, s in self.fleet.live_engines(run.name).items()}
        sync = self.spec.weight_sync
        kwargs = sender_options(
            transport, receivers=len(engines), deltas=sync.deltas, uri=sync.uri, full_every=sync.full_every
        )
        bucket = self.spec.weight_sync.bucket_mb << 20
        await run.ranks[0].init_sender(transport, bucket, kwargs)
        run.sync = await asyncio.to_thread(
            PolicyWeightSync, run.name, run.ranks[0], engines, self.registry, transport=transport
        )
        await self.sync_weights(run.version)

    def _read_totals(self, stats: PolicyStats) -> Totals:
        return Totals(dict(stats.dropped), sum(self.producer.failures.values()))

    async def loop(self) -> None:
        run = self.run
        # Per-step counters count from here: a resumed job's restored totals are not its first step's.
        start = await self.buffer.stats()
        self._totals = self._read_totals(start[run.name])
        try:
            await self._steps()
        finally:
            self.skew.ended(run.name)

    async def _steps(self) -> None:
        run, stop = self.run, self.control.stop
        while run.step < self.total and not stop.is_set():
            await self.skew.wait(run.name, stop)
            n = await self._wait_for_step()
            if not n:
                break
            async with run.lock:
                outcome = await self._step(n)
            if outcome == "stop":
                return
            if outcome == "restart":
                # Outside the lock: the new ranks may wait minutes for a pod, and a checkpoint
                # meanwhile (which takes every policy's lock) must not hold the others back.
                if not await self._restart():
                    return
                continue
            if run.step >= self.total:
                await self.buffer.finish(run.name)
            await self.checkpointer.maybe_checkpoint()

    async def _step(self, n: int) -> Literal["done", "restart", "stop"]:
        """One step on `n` samples, recorded and exported when due; a failed trainer's verdict."""
        run = self.run
        try:
            rec = await self.train_step(n)
        except Exception as e:
            return await self._failed(e)
        try:
            await self.record(await self._evaluated(rec))
        except Exception as e:
            self.control.fail(f"policy {run.name}: recording step {run.step} failed: {e}")
            return "stop"
        try:
            await self.checkpointer.maybe_export(run)
            if policy_restart.why_not_alone(self.spec, self.fleet, run.name) is None:  # else unused
                await self.checkpointer.maybe_restart_point(run)
        except Exception as e:
            if actor_gone(e):  # a rank died exporting or saving: as if in a step
                return await self._failed(e)
            self.control.fail(f"policy {run.name}: saving or exporting step {run.step} failed: {e}")
            return "stop"
        return "done"

    async def _failed(self, error: BaseException) -> Literal["restart", "stop"]:
        """A rank failed (coordinator/policy_restart.py): fail the job, freeze the policy, or mark
        its trainer restarting (before its lock is released: a checkpoint then carries the policy's
        entry of the latest one instead of saving its dead ranks)."""
        run = self.run
        v = policy_restart.verdict(self.spec, self.fleet, run, error)
        log.error("policy.trainer_failed", policy=run.name, step=run.step, action=v.action, error=v.message)
        if v.action == "fail":
            self.control.fail(v.message, retryable=v.retryable)
            return "stop"
        if run.sync is not None:  # engines keep serving the last version; none waits for another
            run.sync.close()
        if v.action == "freeze":
            await self._freeze(v.message)
            return "stop"
        run.restarts += 1
        run.trainer_state = "restarting"
        await self.buffer.pause(run.name)  # the others' episodes keep starting meanwhile
        self.control.emit("policy_restarting", policy=run.name, restarts=run.restarts, error=v.message)
        return "restart"

    async def _restart(self) -> bool:
        """New ranks for this policy, loaded from its part of the latest checkpoint, publishing past
        the last version its engines served; False when the job stops or the restart failed. New
        ranks that die before they are set up (placed on the lost pod's node before Ray noticed
        it gone) are replaced again, until `RANKS_TIMEOUT_S` has passed."""
        run = self.run
        deadline = time.monotonic() + policy_restart.RANKS_TIMEOUT_S
        ref = None
        while True:
            try:
                ranks = await policy_restart.replace_ranks(
                    run, self.spec, self.fleet, self.buffer, self.control, deadline=deadline
                )
                if ranks is None:
                    return False
                run.ranks = ranks
                async with run.lock:
                    served = run.version  # the engines hold it: the restarted trainer publishes past it
                    ref = self.checkpointer.latest_with(run.name)
                    await self.setup(ref)
                    if ref is None:
                        run.step = 0
                    run.version_offset = served + 1 - run.step
                    await self.buffer.restart(run.name, run.version, self.total + run.version_offset)
                    await self.connect(self.transport)
                    run.trainer_state = "training"
                break
            except Exception as e:
                if (
                    actor_gone(root_cause(e))
                    and time.monotonic() < deadline
                    and not self.control.stop.is_set()
                ):
                    log.warning("policy.trainer_restart_retried", policy=run.name, error=str(root_cause(e)))
                    continue
                self.control.fail(f"policy {run.name}: restarting its trainer failed: {e}")
                return False
        checkpoint = ref.location if ref is not None else None
        log.info(
            "policy.trainer_restarted",
            policy=run.name,
            step=run.step,
            version=run.version,
            checkpoint=checkpoint,
            restarts=run.restarts,
        )
        self.control.emit(
            "policy_restarted", policy=run.name, step=run.step, version=run.version, checkpoint=checkpoint
        )
        return True

    async def _freeze(self, message: str) -> None:
        """Out of restarts under onPolicyFailure freeze: the policy trains no more (its engines
        serve its last version); the job fails only when no policy is left to train."""
        run = self.run
        run.trainer_state = "frozen"
        for rank in run.ranks:
            rank.kill()
        await self.buffer.finish(run.name)
        self.control.emit("policy_frozen", policy=run.name, step=run.step, error=message)
        if not any(r.training for r in self.checkpointer.runs.values()):
            self.control.fail(f"every policy is frozen; the last: {message}", retryable=False)

    async def _evaluated(self, rec: StepRecord) -> StepRecord:
        """`rec` with this policy's result of the eval pass at its step, when one is due."""
        if self.evaluator is None:
            return rec
        last = rec.step >= self.total or self.producer.data_finished
        res = await self.evaluator.at_step(self.run.name, rec.step, last)
        rec = replace(rec, **self.leagues.ratings.progress(self.run.name))  # with this step's cross-play
        self.run.rating = rec.rating if rec.rating is not None else self.run.rating
        if res is None:
            return rec
        self.run.last_eval = res.progress()
        return replace(rec, eval_reward_mean=res.reward_mean, eval_pass_at_k=res.pass_at_k)

    async def _wait_for_step(self) -> int:
        """Samples for one step (0 when stopping).

        Sync: every sample of the version's episodes, once they are all in (its credit used up, no
        episode under way). Its episodes number episodesPerStep, or up to a group more when failed
        ones were replaced (experience/buffer.py); their samples, however many turns each had: a
        step of a fixed sample count left the rest of a version's samples to be dropped as stale.
        Async: a full step, or whatever is buffered when no more can come (credit exhausted,
        nothing in flight: episodes with fewer turns than usual)."""
        run = self.run
        sync = self.spec.effective_max_staleness == 0
        stalled_since: float | None = None
        starving = Starvation(time.monotonic())
        while not self.control.stop.is_set():
            # Read once: the first report sets it while we wait, and a step's size must not change
            # under us (unknown: wait for the first episode's report before counting samples).
            per_episode = run.samples_per_episode
            need = self.episodes_per_step * (per_episode or 1)
            # A long poll: the buffer answers as soon as the step is complete. Polling every 10 ms
            # (two Ray calls per policy each time) cost the driver and the buffer about 0.1 CPU-s
            # per optimizer step of the async benchmark, on 2 cores a visible share.
            stats = await self.buffer.stats((run.name, need), 0.05, whole_version=sync)
            st = run.stats = stats[run.name]
            in_flight = self.producer.in_flight
            # The train data ran out: whatever is buffered is the last step; nothing buffered, none.
            data_done = self.producer.data_finished and in_flight == 0
            if data_done and not st.buffered and not st.leased:
                return 0
            if sync:
                # `pending` and `credit` come from one reading under the buffer's lock: an episode
                # granted a ticket is counted from that moment, before the producer hears of it.
                if st.buffered and not st.pending and (st.credit <= 0 or data_done):
                    return int(st.buffered)
            elif per_episode is not None:
                if st.buffered >= need:
                    return need
                # Credit for less than a group is not granted (episodes start in whole groups).
                if st.buffered and (st.credit < self.group_size or data_done) and in_flight == 0:
                    return int(st.buffered)
            if starving.starved(st, self.stall_timeout_s):
                self.control.fail(self._starved(st, starving.since(st)), retryable=False)
                return 0
            # No credit, nothing buffered, leased or on its way: nothing can ever change (credit only
            # grows when this policy trains). A bug, but the job must fail clearly, never hang.
            has_credit = st.credit > 0 if sync else st.credit >= self.group_size
            if has_credit or st.buffered or st.leased or st.pending or in_flight:
                stalled_since = None
            elif stalled_since is None:
                stalled_since = time.monotonic()
            elif time.monotonic() - stalled_since > self.stall_timeout_s:
                self.control.fail(
                    f"policy {run.name}: stalled at step {run.step}: no staleness credit (admitted "
                    f"{st.admitted} at version {st.version}), nothing buffered and no episode in flight "
                    f"for {self.stall_timeout_s:.0f} s",
                    retryable=False,
                )
                return 0
        return 0

    def _starved(self, st: PolicyStats, dropped: dict[str, int]) -> str:
        """Why the policy can get no sample (`Starvation`), for the job's failure."""
        run, t = self.run, f"{self.stall_timeout_s:.0f}"
        if dropped.get(DropReason.VERSION_SKEW, 0) >= dropped.get(DropReason.STALE, 0):
            return (
                f"policy {run.name}: at step {run.step}, every episode of the last {t} s was dropped for "
                f"version skew (maxVersionSkew {self.spec.max_version_skew}, onVersionSkew drop; policy "
                f"steps: {self.skew.steps()}): it cannot catch up with the others. onVersionSkew wait "
                "holds the policies ahead back instead"
            )
        served = sorted({max(s.version, 0) for s in self.fleet.live_engines(run.name).values()})
        return (
            f"policy {run.name}: at step {run.step}, every sample of the last {t} s arrived too stale to "
            f"train on ({dropped[DropReason.STALE]} dropped; maxStaleness "
            f"{self.spec.effective_max_staleness}): its trainer is at version {st.version}, its engines "
            f"serve {served or 'nothing'}"
        )

    def _global_std(self) -> float | None:
        signals = self.producer.signals
        algo = self.policy.algorithm
        if normalisation(algo.name, algo.advantage_norm) != "global" or len(signals) < 2:
            return None
        m = sum(signals) / len(signals)
        return math.sqrt(sum((x - m) ** 2 for x in signals) / (len(signals) - 1))

    async def train_step(self, n: int) -> StepRecord:
        """One training step on `n` buffered samples, every cross-process hop in order."""
        run, version = self.run, self.run.version + 1
        t0 = time.perf_counter()
        # On a device pool, the step and the update are one turn: the trainer holds the devices.
        async with self.pools.training(run.name) as turn:
            # Each rank pulls its share from the buffer under a lease and takes the optimizer step.
            results = await self._train_ranks(version, n)
            self.nonfinite.check(run.step + 1, results)  # raises: the trainer failed (`_failed`)
            await self.buffer.ack([r.lease_id for r in results if r.lease_id is not None])
            t1 = time.perf_counter()
            async with self.pools.delivery(run.name, turn):
                await self.sync_weights(version)  # rank 0 publishes, every engine of the policy loads it
        if self.spec.effective_max_staleness == 0:
            # Sync: no episode can start before `advance`, so once the producer has accounted for
            # those in flight, the window holds exactly this step's episodes, whatever the timing.
            while self.producer.in_flight and not self.control.stop.is_set():
                await asyncio.sleep(0.005)
        await self.buffer.advance(run.name, version)  # engines first, then credit for new episodes
        run.step += 1
        sync_s = time.perf_counter() - t1
        rewards = run.window.take()  # before any await: no episode the new credit starts is in it
        skew = run.window.take_skew()
        if skew:  # a step on episodes reported before the previous one keeps the last reading
            run.version_skew = {other: hi for other, (_, hi) in skew.items()}
        stats = run.stats = (await self.buffer.stats())[run.name]
        run.staleness = (stats.staleness_mean, stats.staleness_max)
        rec = self._record(version, results, rewards, stats, train_s=t1 - t0, sync_s=sync_s, started=t0)
        run.rating = rec.rating if rec.rating is not None else run.rating
        rec = replace(
            rec,
            version_skew_mean={k: mean for k, (mean, _) in skew.items()},
            version_skew_max={k: hi for k, (_, hi) in skew.items()},
        )
        return rec if turn is None else replace(rec, **asdict(self.pools.turn_metrics(turn)))

    async def _train_ranks(self, version: int, n: int) -> list[StepResult]:
        """Every rank's part of the step: the samples split evenly, the same micro-batch count."""
        run = self.run
        world = len(run.ranks)
        shares = [n // world + (1 if i < n % world else 0) for i in range(world)]
        n_micro = max(1, math.ceil(max(shares) / self.policy.trainer.micro_batch_size))
        gstd = self._global_std()
        try:
            steps = (
                r.train_step(run.step + 1, s, n_micro, gstd, version)
                for r, s in zip(run.ranks, shares, strict=True)
            )
            async with self.fleet.step_lock(run.name):  # one policy at a time on a shared trainer
                return list(await asyncio.gather(*steps))
        except Exception:
            for i in range(world):  # whatever the ranks leased goes back to the buffer
                await self.buffer.consumer_failed(f"{run.name}-trainer-{i}")
            raise

    def _record(
        self,
        version: int,
        results: list[StepResult],
        rewards: tuple[float | None, float | None, int],
        stats: PolicyStats,
        *,
        train_s: float,
        sync_s: float,
        started: float,
    ) -> StepRecord:
        """The step's record: the ranks' results, the reward window's episodes since the last step
        (`rewards`: mean reward, mean success, episodes) and the buffer's counters after the step."""
        run = self.run
        reward, success, episodes = rewards
        run.last_reward = reward
        samples = sum(r.samples for r in results)
        totals = self._read_totals(stats)
        step, self._totals = totals.since(self._totals), totals
        return StepRecord(
            policy=run.name,
            step=run.step,
            version=version,
            reward_mean=reward,
            success_mean=success,
            episodes=episodes,
            samples=samples,
            tokens=sum(r.tokens for r in results),
            staleness_mean=sum(r.staleness_mean * r.samples for r in results) / max(samples, 1),
            staleness_max=max(r.staleness_max for r in results),
            **over_ranks(results),
            **gradient_metrics(results),
            train_s=train_s,
            sync_s=sync_s,
            elapsed_s=self.control.elapsed(),
            samples_per_s=samples / max(time.perf_counter() - started, 1e-9),
            dropped=step.dropped,
            dropped_total=totals.dropped,
            failed_episodes=step.failed_episodes,
            failed_episodes_total=totals.failed_episodes,
            **self.leagues.progress(run.name),
            **self.leagues.ratings.progress(run.name),
        )

    async def sync_weights(self, version: int) -> None:
        run = self.run
        assert run.sync is not None
        peers = []
        if self.policy.trainer.zero_stage == 3 and len(run.ranks) > 1:
            peers = [r.gather_for_peers() for r in run.ranks[1:]]
        result = await asyncio.to_thread(run.sync.sync, version)
        if peers:
            await asyncio.gather(*peers)
        for engine, err in result.failures.items():
            log.warning("weights.engine_failed", policy=run.name, engine=engine, error=str(err))
            if actor_gone(err):
                lost = self.fleet.mark_dead({engine})
                self.control.report_lost(self.fleet, lost)
                if engine in run.sync.engines:  # out now: the next step's sync must not wait on it
                    await asyncio.to_thread(run.sync.remove_engine, engine)
                if lost:  # supervision will not see it in the sync, so the workers' routes change here
                    await self.fleet.push_routes()
        await self.leagues.after_sync(run.name, version)  # a league's snapshot of this version, if due
