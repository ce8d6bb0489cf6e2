"""The driver: runs one RLJob to completion (in the coordinator pod, or locally under `polyrl run`).

The loop, per policy p (all policies concurrently; the producer feeds them all):

    producer:  tickets <- buffer.acquire(policies, group)    # staleness credit = back-pressure
               groups <- worker.run_groups(seeds, tickets)  # episodes -> buffer (worker puts them)
    trainer p: wait until the buffer holds one step of p's samples (episodesPerStep episodes)
               ranks.train_step()  -> buffer.ack(leases)     # each rank pulls its share, one optimizer step
               weights.sync(version + 1) -> buffer.advance(p) # engines first, then more credit
               metrics.add(step record)                      # memory, metrics files, sinks
               every checkpoint.everySteps: checkpoint(weights, optimizer, buffer, counters)

sync mode is the same loop with maxStaleness 0: the buffer grants exactly one step of credit per
version, so generation waits for the weights of the previous step (strictly on-policy). In async mode
generation runs up to maxStaleness versions ahead; older samples are dropped (and counted) by the
buffer, newer-but-stale ones are corrected by truncated importance weights in the loss.

`Driver` composes one component per responsibility (listed in coordinator/job_state.py). `_start`
starts the actors and builds the components that use them, all at once (`JobParts`); `run` runs their
loops and reports a `JobSnapshot` (report.py). Every hop of a step is a typed call through an actor's
client (polyrl_runtime/actors.py); `PolicyTrainer.train_step` (training.py) makes them in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from polyrl_operator.api import RLJob
from polyrl_operator.api.progress import Progress
from polyrl_runtime.actors import Actor
from polyrl_runtime.algorithms.estimators import estimator
from polyrl_runtime.coordinator.checkpoints.checkpointer import Checkpointer
from polyrl_runtime.coordinator.checkpoints.store import CheckpointRef, CheckpointStore
from polyrl_runtime.coordinator.crossplay import CrossPlayer, recent_versions
from polyrl_runtime.coordinator.datafeed import DataFeed, buffered_groups, open_train_feed
from polyrl_runtime.coordinator.evaluation import Evaluator, load_eval_rows
from polyrl_runtime.coordinator.failures import JobFailedError, root_cause
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.coordinator.fleet_supervisor import FleetSupervisor
from polyrl_runtime.coordinator.job_state import DriverOptions, JobControl, PolicyRun, State, version_offset
from polyrl_runtime.coordinator.league import Leagues
from polyrl_runtime.coordinator.metrics.log import MetricsLog
from polyrl_runtime.coordinator.metrics.records import RewardWindow, StepRecord
from polyrl_runtime.coordinator.pool_scheduler import device_pools
from polyrl_runtime.coordinator.producer import EpisodeProducer, ProducerLimits
from polyrl_runtime.coordinator.producer_events import ProducerEventSink
from polyrl_runtime.coordinator.ratings import job_ratings
from polyrl_runtime.coordinator.report import (
    JobSnapshot,
    RunSummary,
    actor_counts,
    policy_snapshot,
    pool_snapshots,
    progress_report,
    run_summary,
    worker_views,
)
from polyrl_runtime.coordinator.training import PolicyTrainer, StepLimits, TrainingParts
from polyrl_runtime.coordinator.version_skew import SkewGate
from polyrl_runtime.data import DataError
from polyrl_runtime.experience.buffer import BufferSnapshot, PolicyConfig
from polyrl_runtime.experience.client import BufferClient
from polyrl_runtime.models import ModelLoadError
from polyrl_runtime.weights import VersionRegistry, choose_transports
from polyrl_runtime.workflows.preflight import PreflightError, check_entry_points

__all__ = ["Driver", "DriverOptions", "JobFailedError"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class JobParts:
    """What `Driver._start` builds, all at once: the buffer, the producer, the supervision and each
    policy's trainer (the actors are the fleet's, which the driver holds from the start)."""

    buffer: BufferClient
    producer: EpisodeProducer
    supervisor: FleetSupervisor
    trainers: dict[str, PolicyTrainer]


class Driver:
    """Runs one RLJob to completion with the components it composes (see the module docstring)."""

    def __init__(self, job: RLJob, opts: DriverOptions) -> None:
        self.job, self.opts, self.spec = job, opts, job.spec
        self.episodes_per_step = self.spec.training.episodes_per_step
        self.total = self.spec.training.total_steps
        grouped = [
            p.algorithm.group_size
            for p in self.spec.policies
            if not p.frozen and estimator(p.algorithm.name).grouped
        ]
        self.group_size = max(grouped or [1])
        self.store = CheckpointStore(opts.checkpoint_root, self.spec.checkpoint.keep)
        self.control = JobControl(opts.on_event, opts.startup)
        self.state: State = "starting"
        self.message, self.retryable, self.interrupted = "", True, False
        self.runs: dict[str, PolicyRun] = {}  # filled as `_start` starts each policy's trainer
        # Read at each turn: engines come and go, and the ranks exist once `_start` has run.
        self.pools = device_pools(
            self.spec,
            engines=lambda p: [s.actor for s in self.fleet.live_engines(p).values()],
            ranks=lambda p: self.runs[p].ranks,
        )
        self.checkpointer = Checkpointer(
            job, self.store, self.control, self.runs, opts.checkpoint_requests, pools=self.pools
        )
        self.metrics = MetricsLog(job, opts)
        self.transports = choose_transports(self.spec, same_host=opts.same_host)
        # Starts no actor before `run`; then it starts (and `close` stops) every one.
        self.fleet = Fleet(
            job,
            self.transports,
            place_by_resource=opts.place_by_resource,
            cpu_sets=opts.cpu_sets,
            colocate=opts.colocate,
        )
        self.ratings = job_ratings(self.spec)
        self.leagues = Leagues(
            self.spec,
            self.fleet,
            lambda m: self.control.fail(m, retryable=False),
            opts.unused_episodes,
            self.ratings,
        )
        self.registry = VersionRegistry()
        self.parts: JobParts | None = None  # once `run` has started the job
        self.evaluator: Evaluator | None = None  # once started, for a job with spec.evaluation
        self.resumed = False  # once started: whether from a checkpoint
        self.closed = False

    async def run(self) -> RunSummary:
        """Run the job to its end (done, interrupted or failed) and summarise it. However it ends,
        cancelled included, every actor it started is stopped before it returns (`close`)."""
        try:
            return await self._run()
        finally:
            self.close()

    async def _run(self) -> RunSummary:
        try:
            parts = self.parts = await self._start()
            await self._evaluate_before_training()
            self.state = "running"
            log.info("job.running", policies=sorted(self.runs), resumed=self.resumed)
            guarded = self.control.guarded
            trainers = [guarded(t.loop(), f"policy {n}: training loop") for n, t in parts.trainers.items()]
            side = [
                guarded(parts.producer.run(self.control.stop), "episode producer"),
                guarded(parts.supervisor.loop(), "housekeeping"),
                *(
                    guarded(s.watch(lambda: parts.producer.in_flight > 0, self.control.stop), f"pool {n}")
                    for n, s in self.pools.schedulers.items()
                ),
            ]
            await self._until_done_or_stopped(trainers)
            await self._wind_down(trainers, side)
            if self.control.fatal is not None:
                raise self.control.fatal
            request = self.checkpointer.pending_request()
            if request is not None:
                self.handled_requests.append(request)  # the final checkpoint below answers it
            await self.checkpoint("final")
            await self.fleet.poll()  # the final /progress shows the engines' final versions
            data_end = parts.producer.data_end_message({n: r.step for n, r in self.runs.items()})
            done = data_end is not None or all(
                r.step >= self.total or r.trainer_state == "frozen" for r in self.runs.values()
            )
            self.state = "done" if done else "running"
            frozen = [n for n, r in self.runs.items() if r.trainer_state == "frozen" and not r.served_only]
            finished = "all policies finished" + (f" but {', '.join(frozen)} (frozen)" if frozen else "")
            self.message = (data_end or finished) if done else "interrupted; checkpointed"
        except JobFailedError as e:
            self.state, self.message, self.retryable = "failed", str(e), e.retryable
            log.error("job.failed", error=str(e))
            if self.parts is not None:  # the engines' final counters (aborted requests) for the summary
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.fleet.poll(), 10.0)
        await asyncio.to_thread(self.metrics.close)
        startup = self.control.startup.seconds
        buffer = self.parts.buffer if self.parts is not None else None
        return await run_summary(self.snapshot(), self.records, buffer, self.metrics.ends, startup)

    async def _evaluate_before_training(self) -> None:
        """The eval pass of the initial weights (step 0), recorded as each policy's step-0 metrics
        row and its latest evaluation; a resumed job has its checkpoint's latest pass instead."""
        ev, cfg = self.evaluator, self.spec.evaluation
        if ev is None or cfg is None or not cfg.before_training or self.resumed or not ev.rows:
            return
        with self.control.phase(
            "eval_before_training", f"evaluating the initial weights on {len(ev.rows)} eval rows"
        ):
            results = await ev.before_training()
        for name, res in results.items():
            run = self.runs[name]
            run.last_eval = res.progress()
            rec = StepRecord.before_training(
                name, run.version, self.control.elapsed(), res.reward_mean, res.pass_at_k
            )
            await self.metrics.add(rec)

    async def _until_done_or_stopped(self, trainers: list[asyncio.Task[None]]) -> None:
        waiters: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(asyncio.gather(*trainers)),
            asyncio.ensure_future(self.control.stop.wait()),
        ]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        self.control.stop.set()
        for w in waiters:  # a loop's error is reported by `guarded`: mark it read here
            if w.done() and not w.cancelled():
                w.exception()

    async def _wind_down(self, trainers: list[asyncio.Task[None]], side: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*trainers, return_exceptions=True)
        for run in self.runs.values():  # no publish follows: release engines waiting for one
            if run.sync is not None:
                run.sync.close()
        for t in side:
            t.cancel()
        await asyncio.gather(*side, return_exceptions=True)

    def close(self) -> None:
        """Stop every actor this driver started (engines, workflow workers, trainers, the buffer);
        `run` does it as it returns. Idempotent.

        The driver and its helpers hold each other, so without this the actors would live until
        Python's cycle collector ran: in a process that runs several jobs in one Ray session (a
        library user, the benchmarks, the test suite) a finished job's processes stayed beside the
        next job's, with their memory and a share of the cores."""
        self.closed = True
        self.fleet.close()

    def stop(self, reason: str = "interrupted") -> None:
        """Stop after the steps in progress; `run` then checkpoints and returns (Ctrl-C, SIGTERM)."""
        self.interrupted = True
        self.message = reason
        self.control.stop.set()

    async def _start(self) -> JobParts:
        """Start every actor, build the components that use them, restore the checkpoint when
        resuming and publish the first weights; returns the parts `_run` runs."""
        spec = self.spec
        try:
            check_entry_points(spec)  # before any actor: the code the job names imports
            feed = await asyncio.to_thread(open_train_feed, spec)
            eval_rows = await asyncio.to_thread(load_eval_rows, spec)
        except PreflightError as e:
            raise JobFailedError(str(e), retryable=False) from e
        except DataError as e:
            raise JobFailedError(str(e), retryable=False) from e
        ref = self.store.latest() if self.opts.resume else None
        fleet, s = self.fleet, spec.effective_max_staleness
        # A policy whose trainer restarted alone publishes versions past its steps (PolicyRun.version_offset).
        offsets = (
            {n: version_offset(st) for n, st in ref.state["policies"].items()} if ref is not None else {}
        )
        configs = [
            PolicyConfig(
                p.name,
                self.episodes_per_step,
                s,
                final_version=self.total + offsets.get(p.name, 0),
                max_version_skew=spec.max_version_skew if spec.version_skew_action == "drop" else None,
                frozen=p.frozen,
                zero_variance_cap=(
                    ds.max_refills * self.episodes_per_step if (ds := p.algorithm.dynamic_sampling) else None
                ),
            )
            for p in spec.policies
        ]
        capacity = (s + 2) * self.episodes_per_step * len(configs) + 4 * self.group_size
        snapshot = ref.buffer() if ref is not None else None
        phase = self.control.phase
        with phase("actors", f"starting actors ({actor_counts(self.spec, len(self.fleet.colocated))})"):
            buffer = fleet.new_buffer(configs, capacity, snapshot)
            for p in spec.policies:
                ranks = fleet.start_policy(p, buffer)
                run = PolicyRun(p.name, ranks, window=RewardWindow(self.episodes_per_step))
                if p.frozen:  # served by its engines, never trained: no trainer, sync or checkpoint
                    run.trainer_state, run.served_only = "frozen", True
                self.runs[p.name] = run
            job_json = self.job.model_dump_json(by_alias=True)
            for _ in range(spec.workflow.replicas.min):
                fleet.new_worker(job_json, buffer)
            await asyncio.gather(
                buffer.ready(), *(self._reported(n, self._ready(run.ranks)) for n, run in self.runs.items())
            )
        if ref is not None:  # a policy that had finished trains again when the job asks for more steps
            done = {
                p.name: int(ref.state["policies"].get(p.name, {}).get("step", 0))
                for p in spec.policies
                if not p.frozen
            }
            await asyncio.gather(*(buffer.reopen(n) for n, step in done.items() if step < self.total))
        producer = self._new_producer(feed, buffer)
        # What a checkpoint records beside the trainers and the buffer (`_restore_counters` reads it).
        self.checkpointer.attach(
            buffer, lambda: {**producer.state(), "ratings": self.ratings.state()}, self.metrics.flush
        )
        cp = spec.evaluation.cross_play if spec.evaluation is not None else None
        xp = (
            None
            if cp is None
            else CrossPlayer(
                spec,
                cp,
                rows=eval_rows or [],
                fleet=fleet,
                versions=lambda p: recent_versions(self.runs[p].version, self.leagues.held(p), cp.versions),
                ratings=self.ratings,
                out_dir=self.opts.out_dir,
                fail=lambda m: self.control.fail(m, retryable=False),
            )
        )
        evaluator = self.evaluator = Evaluator(spec, eval_rows, fleet, xp) if eval_rows is not None else None
        self.resumed = ref is not None
        shared = TrainingParts(
            control=self.control,
            buffer=buffer,
            fleet=fleet,
            producer=producer,
            checkpointer=self.checkpointer,
            registry=self.registry,
            record=self.metrics.add,
            evaluator=evaluator,
            pools=self.pools,
            skew=SkewGate.of(spec, self.runs),
            leagues=self.leagues,
        )
        limits = StepLimits(self.group_size, self.opts.stall_timeout_s)
        trainers = {
            n: PolicyTrainer(self.job, run, shared, limits)
            for n, run in self.runs.items()
            if not run.served_only
        }
        supervisor = FleetSupervisor(
            self.job,
            fleet=fleet,
            runs=self.runs,
            buffer=buffer,
            control=self.control,
            checkpointer=self.checkpointer,
            leagues=self.leagues,
            poll_s=self.opts.poll_s,
        )
        transports = self.transports
        log.info("weights.transports", transports=transports)
        self.control.emit("starting", transports=transports, resume=ref.location if ref else None)
        # One after the other: both are CPU-bound imports and model builds, so on a machine with few
        # cores running them at once makes neither finish sooner.
        await self._load_models()
        await self._init_trainers(trainers, ref)
        if ref is not None and snapshot is not None:
            await self._resume_versions(ref, snapshot, buffer)
        used = ", ".join(sorted(set(transports.values())))
        with phase("first_weights", f"first weight sync to the engines ({used})"):
            await asyncio.gather(*(self._reported(n, t.connect(transports[n])) for n, t in trainers.items()))
        await self.pools.park_trainers()  # pooled trainers wait for their turns in host memory
        if ref is not None:
            self._restore_counters(ref, producer, buffered_groups(snapshot))
        trained = {n: r.step for n, r in self.runs.items() if not r.served_only}
        await self.metrics.open(trained if ref is not None else {})
        self.control.emit("started", policies=list(self.runs))
        return JobParts(buffer, producer, supervisor, trainers)

    async def _resume_versions(
        self, ref: CheckpointRef, snapshot: BufferSnapshot, buffer: BufferClient
    ) -> None:
        """Each resumed policy's versions from its entry (`version_offset`), before the first publish.
        A policy whose entry is older than the buffer's state (carried while its trainer was
        restarting or frozen: `trainer_at`) publishes past the version the buffer holds for it, as
        a trainer restarted alone does."""
        for name, entry in ref.state["policies"].items():
            run = self.runs.get(name)
            if run is None:
                continue
            run.version_offset = version_offset(entry)
            held = int(snapshot.policies.get(name, {}).get("version", 0))  # type: ignore[call-overload]
            if held > run.version:
                run.version_offset = held + 1 - run.step
                await buffer.restart(name, run.version, self.total + run.version_offset)

    async def _load_models(self) -> None:
        """Wait for the rollout engines (loading their models) and the workflow workers (loading
        each policy's tokenizer), which began as their actors started."""
        engines, workers = self.fleet.engines, self.fleet.workers
        with self.control.phase("model_load", "loading the models into the rollout engines"):
            await asyncio.gather(
                *(self._reported(n, self._ready([s.actor for s in engines[n].values()])) for n in self.runs)
            )
            await self._reported(None, self._ready([w.actor for w in workers.values()]))

    async def _init_trainers(self, trainers: dict[str, PolicyTrainer], ref: CheckpointRef | None) -> None:
        doing = "initialising the trainers (process groups, models, DeepSpeed"
        with self.control.phase("trainer_init", doing + (", checkpoint)" if ref is not None else ")")):
            await asyncio.gather(*(self._reported(n, t.setup(ref)) for n, t in trainers.items()))

    @staticmethod
    async def _ready(actors: Sequence[Actor]) -> None:
        """Until each of `actors` is constructed (its process started and its `__init__` returned)."""
        await asyncio.gather(*(a.ready() for a in actors))

    async def _reported(self, name: str | None, work: Awaitable[None]) -> None:
        """Policy `name`'s start-up `work`, with a model that cannot be loaded reported as the job's
        failure, naming the policy (not retried: the same spec would fail the same way). `name`
        None: work for every policy; the policy named is the one whose model URI the error names."""
        try:
            await work
        except Exception as e:
            cause = root_cause(e)
            if name is None and isinstance(cause, ModelLoadError):
                name = next((p.name for p in self.spec.policies if p.model.uri in str(cause)), None)
                if name is None:
                    raise JobFailedError(str(cause), retryable=False) from e
            if isinstance(cause, ModelLoadError):
                named = str(cause) if str(cause).startswith(f"policy {name}") else f"policy {name}: {cause}"
                raise JobFailedError(named, retryable=False) from e
            raise

    def _new_producer(self, feed: DataFeed | None, buffer: BufferClient) -> EpisodeProducer:
        o = self.opts
        return EpisodeProducer(
            buffer=buffer,
            fleet=self.fleet,
            policies=list(self.runs),
            group_size=self.group_size,
            seed=self.spec.training.seed,
            entrypoint=self.spec.workflow.entrypoint,
            limits=ProducerLimits(
                o.max_in_flight_per_worker, o.groups_per_call, o.max_consecutive_failures, o.unused_episodes
            ),
            events=ProducerEventSink(self.runs, self.total, self.control, self.fleet, self.leagues),
            signals=8 * self.episodes_per_step,
            feed=feed,
        )

    def _restore_counters(
        self, ref: CheckpointRef, producer: EpisodeProducer, buffered: frozenset[str]
    ) -> None:
        st = ref.state
        producer.restore(st, buffered)
        self.ratings.restore(st.get("ratings", []))
        self.control.elapsed_before = float(st.get("elapsed_s", 0.0))
        self.checkpointer.resumed(ref)
        for name, run in self.runs.items():
            run.restored(st["policies"].get(name, {}))
        log.info("job.resumed", checkpoint=ref.location, steps={n: r.step for n, r in self.runs.items()})

    async def checkpoint(self, reason: str, request_id: str | None = None) -> CheckpointRef | None:
        if self.closed:  # the job has ended (its actors are gone): its final checkpoint answers
            if request_id is not None and self.last_ckpt is not None:
                self.handled_requests.append(request_id)
            log.info("checkpoint.after_end", reason=reason, request_id=request_id)
            return self.last_ckpt
        return await self.checkpointer.checkpoint(reason, request_id)

    async def set_draining(self, target: str, draining: bool = True) -> bool:
        """Drain (or undrain) the engine or worker `target`; False when none is named so (none is
        before the job has started)."""
        if self.parts is None:
            return False
        return await self.parts.supervisor.set_draining(target, draining)

    @property
    def records(self) -> list[StepRecord]:
        return self.metrics.records

    @property
    def handled_requests(self) -> list[str]:
        return self.checkpointer.handled_requests

    @property
    def last_ckpt(self) -> CheckpointRef | None:
        return self.checkpointer.last_ckpt

    def elapsed(self) -> float:
        return self.control.elapsed()

    def snapshot(self) -> JobSnapshot:
        """What the reports read: a copy of the job's state at this moment."""
        ckpt = self.checkpointer
        producer = self.parts.producer if self.parts is not None else None
        last = ckpt.last_ckpt
        return JobSnapshot(
            state="checkpointing" if ckpt.in_progress and self.state == "running" else self.state,
            message=self.message,
            retryable=self.retryable,
            attempt=self.opts.attempt,
            policies=[policy_snapshot(run, self.fleet, self.total) for run in self.runs.values()],
            workers=worker_views(self.fleet),
            last_ckpt_step=last.step if last is not None else None,
            last_ckpt_location=last.location if last is not None else None,
            last_request_id=ckpt.handled_requests[-1] if ckpt.handled_requests else None,
            ckpt_in_progress=ckpt.in_progress,
            episodes=producer.episodes_ok if producer is not None else 0,
            failed=dict(producer.failures) if producer is not None else {},
            elapsed_s=self.elapsed(),
            pools=pool_snapshots(self.pools.usage(), time.monotonic()),  # the schedulers' clock
        )

    def progress(self) -> Progress:
        """The `/progress` document the operator reads."""
        return progress_report(self.snapshot())
