"""The driver: runs one RLJob to completion (in the coordinator pod, or locally under `polyrl run`).

The loop, per policy p (all policies concurrently; the producer feeds them all):

    producer:  tickets <- buffer.acquire(policies, group)    # staleness credit = back-pressure
               groups <- worker.run_groups(seeds, tickets)  # episodes -> buffer (worker puts them)
    trainer p: wait until the buffer holds one step of p's samples (episodesPerStep episodes)
               ranks.train_step()  -> buffer.ack(leases)     # each rank pulls its share, one optimizer step
               weights.sync(version + 1) -> buffer.advance(p) # engines first, then more credit
               every checkpoint.everySteps: checkpoint(weights, optimizer, buffer, counters)

sync mode is the same loop with maxStaleness 0: the buffer grants exactly one step of credit per
version, so generation waits for the weights of the previous step (strictly on-policy). In async mode
generation runs up to maxStaleness versions ahead; older samples are dropped (and counted) by the
buffer, newer-but-stale ones are corrected by truncated importance weights in the loss.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import ray
import structlog
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from polyrl_operator.api import RLJob
from polyrl_operator.api.progress import (
    Progress,
)
from polyrl_runtime import storage
from polyrl_runtime.actors import actor_gone
from polyrl_runtime.coordinator.checkpoint import TRAINER_TAG, CheckpointRef, CheckpointStore
from polyrl_runtime.coordinator.fleet import Fleet, Slot
from polyrl_runtime.coordinator.metrics import RewardWindow, StepRecord
from polyrl_runtime.coordinator.producer import EpisodeProducer, ProducerLimits
from polyrl_runtime.coordinator.report import RunSummary, progress_report, run_summary
from polyrl_runtime.coordinator.tasks import fail_on_error, root_cause
from polyrl_runtime.experience.actor import create_experience_actor
from polyrl_runtime.experience.buffer import PolicyConfig, PolicyStats
from polyrl_runtime.models import ModelLoadError
from polyrl_runtime.trainers.export import export_due, export_location
from polyrl_runtime.weights import VersionRegistry, choose_transport
from polyrl_runtime.weights.endpoints import PolicyWeightSync
from polyrl_runtime.workflows.api import load_workflow

log = structlog.get_logger(__name__)

State = Literal["starting", "running", "checkpointing", "done", "failed"]


class JobFailedError(RuntimeError):
    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass
class DriverOptions:
    out_dir: Path
    checkpoint_root: Path | str  # a local directory or an object-store URI (coordinator/checkpoint.py)
    resume: bool = True
    episode_timeout_s: float = 300.0
    max_consecutive_failures: int = 64
    max_in_flight_per_worker: int = 512
    groups_per_call: int = 4  # episode groups a worker gets per Ray call (a call costs ~1 ms of CPU)
    poll_s: float = 0.5
    same_host: bool = True
    # How long a policy may sit with no credit and no experience anywhere before the job fails.
    stall_timeout_s: float = 30.0
    unused_episodes: int = 2000  # episodes in a row without a turn of a policy before the job fails
    place_by_resource: bool = True  # False: ignore polyrl/<policy>/<role> resources (tests on a plain Ray)
    cpu_sets: dict[str, frozenset[int]] = field(default_factory=dict)  # role -> CPUs (local mode's --cpus)
    on_record: Callable[[StepRecord], None] | None = None
    # Polled every poll_s: the id of a checkpoint request (the pod's checkpoint-request annotation).
    checkpoint_requests: Callable[[], str | None] | None = None
    on_event: Callable[[str, dict[str, Any]], None] | None = None
    attempt: int | None = None  # the pod's POLYRL_ATTEMPT, reported in /progress (None: polyrl run)


@dataclass
class _PolicyRun:
    name: str
    ranks: list[Any]
    sync: PolicyWeightSync | None = None
    step: int = 0
    samples_per_episode: int | None = None
    window: RewardWindow = field(default_factory=lambda: RewardWindow(64))
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    stats: PolicyStats | None = None
    staleness: tuple[float, int] = (0.0, 0)
    last_reward: float | None = None
    last_ckpt_step: int | None = None


class Driver:
    def __init__(self, job: RLJob, opts: DriverOptions) -> None:
        self.job, self.opts, self.spec = job, opts, job.spec
        self.E = self.spec.training.episodes_per_step
        self.total = self.spec.training.total_steps
        grpo = [p.algorithm.group_size for p in self.spec.policies if p.algorithm.name == "grpo"]
        self.group_size = max(grpo or [1])
        self.store = CheckpointStore(opts.checkpoint_root, self.spec.checkpoint.keep)
        self.state: State = "starting"
        self.message, self.retryable = "", True
        self.runs: dict[str, _PolicyRun] = {}
        self.producer: EpisodeProducer | None = None
        self._stop = asyncio.Event()
        self._fatal: JobFailedError | None = None
        self._ckpt_lock = asyncio.Lock()
        self.ckpt_in_progress = False
        self.last_ckpt: CheckpointRef | None = None
        self.handled_requests: list[str] = []
        self.records: list[StepRecord] = []
        self.started = time.monotonic()
        self._elapsed_before = 0.0
        self.interrupted = False
        self.buffer: Any = None
        self.fleet: Fleet | None = None
        self.registry = VersionRegistry()

    # -- lifecycle -------------------------------------------------------------------------------

    async def run(self) -> RunSummary:
        try:
            await self._start()
            self.state = "running"
            trainers = [self._guarded(self._train_loop(n), f"policy {n}: training loop") for n in self.runs]
            assert self.producer is not None
            side = [
                self._guarded(self.producer.run(self._stop), "episode producer"),
                self._guarded(self._housekeep(), "housekeeping"),
            ]
            waiters: list[asyncio.Future[Any]] = [
                asyncio.ensure_future(asyncio.gather(*trainers)),
                asyncio.ensure_future(self._stop.wait()),
            ]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            self._stop.set()
            for w in waiters:  # a loop's error is reported by _guarded: mark it read here
                if w.done() and not w.cancelled():
                    w.exception()
            await asyncio.gather(*trainers, return_exceptions=True)
            for run in self.runs.values():  # no publish follows: release engines waiting for one
                if run.sync is not None:
                    run.sync.close()
            for t in side:
                t.cancel()
            await asyncio.gather(*side, return_exceptions=True)
            if self._fatal is not None:
                raise self._fatal
            request = self._pending_request()
            if request is not None:
                self.handled_requests.append(request)  # the final checkpoint below answers it
            await self.checkpoint("final")
            if self.fleet is not None:
                await self.fleet.poll()  # the final /progress shows the engines' final versions
            done = all(r.step >= self.total for r in self.runs.values())
            self.state = "done" if done else "running"
            self.message = "all policies finished" if done else "interrupted; checkpointed"
        except JobFailedError as e:
            self.state, self.message, self.retryable = "failed", str(e), e.retryable
            log.error("job.failed", error=str(e))
        return await run_summary(self)

    def close(self) -> None:
        """Stop every actor this driver started (engines, workflow workers, trainers, the buffer).

        For callers that run several jobs in one Ray session (benchmarks): the driver and its helpers
        hold each other, so without this the actors live until Python's cycle collector runs, and a
        finished job's processes stay beside the next job's. Not needed when the process exits."""
        handles: list[Any] = [r for run in self.runs.values() for r in run.ranks]
        if self.fleet is not None:
            handles += [s.handle for engines in self.fleet.engines.values() for s in engines.values()]
            handles += [s.handle for s in self.fleet.workers.values()]
        if self.buffer is not None:
            handles.append(self.buffer)
        for handle in handles:
            with contextlib.suppress(Exception):  # already dead: nothing to stop
                ray.kill(handle, no_restart=True)

    def stop(self, reason: str = "interrupted") -> None:
        """Stop after the steps in progress; `run` then checkpoints and returns (Ctrl-C, SIGTERM)."""
        self.interrupted = True
        self.message = reason
        self._stop.set()

    def _guarded(self, work: Any, what: str) -> asyncio.Task[None]:
        """A task whose unexpected exception fails the job (retryably), naming it."""
        return fail_on_error(asyncio.create_task(work), what, self._fail)

    def _fail(self, message: str, *, retryable: bool = True) -> None:
        if self._fatal is None:
            self._fatal = JobFailedError(message, retryable=retryable)
        self._stop.set()

    def _emit(self, kind: str, **data: Any) -> None:
        if self.opts.on_event is not None:
            self.opts.on_event(kind, data)

    async def _start(self) -> None:
        spec = self.spec
        try:
            load_workflow(spec.workflow.entrypoint, spec.workflow.args)
        except ImportError as e:
            raise JobFailedError(f"spec.workflow.entrypoint: {e}", retryable=False) from e
        ref = self.store.latest() if self.opts.resume else None
        cuda = any(p.trainer.gpus > 0 for p in spec.policies)
        transport = choose_transport(spec.weight_sync.transport, cuda=cuda, same_host=self.opts.same_host)
        self.fleet = Fleet(
            self.job, transport, place_by_resource=self.opts.place_by_resource, cpu_sets=self.opts.cpu_sets
        )
        s = spec.effective_max_staleness
        configs = [PolicyConfig(p.name, self.E, s, final_version=self.total) for p in spec.policies]
        capacity = (s + 2) * self.E * len(configs) + 4 * self.group_size
        node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        snapshot = ref.buffer() if ref is not None else None
        self.buffer = create_experience_actor(configs, capacity, snapshot=snapshot, scheduling_strategy=node)
        if ref is not None:  # a policy that had finished trains again when the job asks for more steps
            done = {p.name: int(ref.state["policies"].get(p.name, {}).get("step", 0)) for p in spec.policies}
            await asyncio.gather(
                *(self.buffer.reopen.remote(n) for n, step in done.items() if step < self.total)
            )
        for p in spec.policies:
            for _ in range(p.rollout.replicas.min):
                self.fleet.new_engine(p)
            self.runs[p.name] = _PolicyRun(p.name, self.fleet.new_trainers(p, self.buffer))
            self.runs[p.name].window = RewardWindow(self.E)
        self.producer = self._new_producer()
        self._emit("starting", transport=transport, resume=ref.location if ref else None)
        await asyncio.gather(*(self._setup_reported(p.name, ref, transport) for p in spec.policies))
        job_json = self.job.model_dump_json(by_alias=True)
        for _ in range(spec.workflow.replicas.min):
            self.fleet.new_worker(job_json, self.buffer, self.opts.episode_timeout_s)
        await asyncio.gather(*(w.handle.stats.remote() for w in self.fleet.workers.values()))
        if ref is not None:
            self._restore_counters(ref)
        self._emit("started", policies=list(self.runs))

    async def _setup_reported(self, name: str, ref: CheckpointRef | None, transport: str) -> None:
        """`_setup_policy`, with a model that cannot be loaded reported as the job's failure, naming
        the policy (not retried: the same spec would fail the same way)."""
        try:
            await self._setup_policy(name, ref, transport)
        except Exception as e:
            cause = root_cause(e)
            if isinstance(cause, ModelLoadError):
                named = str(cause) if str(cause).startswith(f"policy {name}") else f"policy {name}: {cause}"
                raise JobFailedError(named, retryable=False) from e
            raise

    async def _setup_policy(self, name: str, ref: CheckpointRef | None, transport: str) -> None:
        assert self.fleet is not None
        run = self.runs[name]
        addr, port = await run.ranks[0].address.remote()
        await asyncio.gather(*(r.setup.remote(addr, port) for r in run.ranks))
        if ref is not None and name in ref.state["policies"]:
            d = ref.trainer_dir(name)  # each rank downloads it first when it is in an object store
            await asyncio.gather(*(r.load.remote(d, TRAINER_TAG) for r in run.ranks))
            run.step = int(ref.state["policies"][name]["step"])
        elif ref is not None:  # a policy added to the job since the checkpoint starts from its model
            log.info("policy.not_in_checkpoint", policy=name, checkpoint=ref.location)
        engines = {n: s.handle for n, s in self.fleet.engines[name].items()}
        kwargs = {"num_receivers": len(engines)} if transport == "collective" else {}
        await run.ranks[0].init_sender.remote(transport, self._bucket(), kwargs)
        run.sync = await asyncio.to_thread(
            PolicyWeightSync, name, run.ranks[0], engines, self.registry, transport=transport
        )
        await self._sync_weights(name, run.step)

    def _bucket(self) -> int:
        return self.spec.weight_sync.bucket_mb << 20

    def _new_producer(self) -> EpisodeProducer:
        assert self.fleet is not None
        o = self.opts

        def on_episode(policy: str, reward: float, success: float | None, samples: int) -> None:
            run = self.runs[policy]
            run.window.add(reward, success)
            run.samples_per_episode = samples

        return EpisodeProducer(
            buffer=self.buffer,
            fleet=self.fleet,
            policies=list(self.runs),
            group_size=self.group_size,
            seed=self.spec.training.seed,
            entrypoint=self.spec.workflow.entrypoint,
            limits=ProducerLimits(
                o.max_in_flight_per_worker, o.groups_per_call, o.max_consecutive_failures, o.unused_episodes
            ),
            still_training=lambda name: self.runs[name].step < self.total,
            on_episode=on_episode,
            fail=lambda message, retryable: self._fail(message, retryable=retryable),
            emit=self._emit,
            lost=self._report_lost,
            signals=8 * self.E,
        )

    def _restore_counters(self, ref: CheckpointRef) -> None:
        st = ref.state
        assert self.producer is not None
        self.producer.restore(st)
        self._elapsed_before = float(st.get("elapsed_s", 0.0))
        self.handled_requests = list(st.get("request_ids", []))
        self.last_ckpt = ref
        for name, run in self.runs.items():
            run.last_ckpt_step = run.step
            run.samples_per_episode = st["policies"].get(name, {}).get("samples_per_episode")
        log.info("job.resumed", checkpoint=ref.location, steps={n: r.step for n, r in self.runs.items()})

    # -- training --------------------------------------------------------------------------------

    async def _wait_for_step(self, run: _PolicyRun) -> int:
        """Samples for one step of `run` (0 when stopping): a full step, or whatever is buffered when
        no more can come (credit exhausted, nothing in flight: episodes with fewer turns than usual)."""
        stalled_since: float | None = None
        while not self._stop.is_set():
            # Read once: the first report sets it while we wait, and a step's size must not change
            # under us (unknown: wait for the first episode's report before counting samples).
            per_episode = run.samples_per_episode
            need = self.E * (per_episode or 1)
            # A long poll: the buffer answers as soon as the step is complete. Polling every 10 ms
            # (two Ray calls per policy each time) cost the driver and the buffer about 0.1 CPU-s
            # per optimizer step of the async benchmark, on 2 cores a visible share.
            stats: dict[str, PolicyStats] = await self.buffer.stats.remote((run.name, need), 0.05)
            st = run.stats = stats[run.name]
            in_flight = self.producer.in_flight if self.producer is not None else 0
            if per_episode is not None:
                if st.buffered >= need:
                    return need
                # Credit for less than a group is not granted (episodes start in whole groups).
                if st.buffered and st.credit < self.group_size and in_flight == 0:
                    return int(st.buffered)
            # No credit, nothing buffered, leased or on its way: nothing can ever change (credit only
            # grows when this policy trains). A bug, but the job must fail clearly, never hang.
            if st.credit >= self.group_size or st.buffered or st.leased or in_flight:
                stalled_since = None
            elif stalled_since is None:
                stalled_since = time.monotonic()
            elif time.monotonic() - stalled_since > self.opts.stall_timeout_s:
                self._fail(
                    f"policy {run.name}: stalled at step {run.step}: no staleness credit (admitted "
                    f"{st.admitted} at version {st.version}), nothing buffered and no episode in flight "
                    f"for {self.opts.stall_timeout_s:.0f} s",
                    retryable=False,
                )
                return 0
        return 0

    async def _train_loop(self, name: str) -> None:
        run = self.runs[name]
        while run.step < self.total and not self._stop.is_set():
            n = await self._wait_for_step(run)
            if not n:
                break
            async with run.lock:
                try:
                    await self._train_once(run, n)
                except Exception as e:
                    self._fail(f"policy {name}: trainer failed at step {run.step + 1}: {e}")
                    return
                try:
                    await self._maybe_export(run)
                except Exception as e:
                    self._fail(f"policy {name}: Hugging Face export of step {run.step} failed: {e}")
                    return
            if run.step >= self.total:
                await self.buffer.finish.remote(name)
            await self._maybe_checkpoint()

    async def _train_once(self, run: _PolicyRun, n: int) -> None:
        p = next(p for p in self.spec.policies if p.name == run.name)
        world = len(run.ranks)
        shares = [n // world + (1 if i < n % world else 0) for i in range(world)]
        n_micro = max(1, math.ceil(max(shares) / p.trainer.micro_batch_size))
        gstd = None
        signals = self.producer.signals if self.producer is not None else ()
        if p.algorithm.advantage_norm == "global" and len(signals) > 1:
            m = sum(signals) / len(signals)
            gstd = math.sqrt(sum((x - m) ** 2 for x in signals) / (len(signals) - 1))
        t0 = time.perf_counter()
        version = run.step + 1
        try:
            results = await asyncio.gather(
                *(
                    r.train_step.remote(version, s, n_micro, gstd)
                    for r, s in zip(run.ranks, shares, strict=True)
                )
            )
        except Exception:
            for i in range(world):  # whatever the ranks leased goes back to the buffer
                await self.buffer.consumer_failed.remote(f"{run.name}-trainer-{i}")
            raise
        await self.buffer.ack.remote([r.lease_id for r in results if r.lease_id is not None])
        t1 = time.perf_counter()
        await self._sync_weights(run.name, version)
        if self.spec.effective_max_staleness == 0:
            # Sync: no episode can start before `advance`, so once the producer has accounted for
            # those in flight, the window holds exactly this step's episodes, whatever the timing.
            while self.producer is not None and self.producer.in_flight and not self._stop.is_set():
                await asyncio.sleep(0.005)
        await self.buffer.advance.remote(run.name, version)
        run.step = version
        sync_s = time.perf_counter() - t1
        reward, success, episodes = run.window.take()
        run.last_reward = reward
        stats: dict[str, PolicyStats] = await self.buffer.stats.remote()
        run.stats = stats[run.name]
        samples = sum(r.samples for r in results)
        run.staleness = (run.stats.staleness_mean, run.stats.staleness_max)
        rec = StepRecord(
            policy=run.name,
            step=version,
            version=version,
            reward_mean=reward,
            success_mean=success,
            episodes=episodes,
            samples=samples,
            tokens=sum(r.tokens for r in results),
            loss=sum(r.loss for r in results),
            staleness_mean=sum(r.staleness_mean * r.samples for r in results) / max(samples, 1),
            staleness_max=max(r.staleness_max for r in results),
            is_weight_mean=sum(r.is_weight_mean for r in results) / world,
            is_truncated_frac=sum(r.is_truncated_frac for r in results) / world,
            clip_frac=sum(r.clip_frac for r in results) / world,
            kl=sum(r.kl for r in results) / world,
            entropy=sum(r.entropy for r in results) / world,
            grad_norm=results[0].grad_norm,
            train_s=t1 - t0,
            sync_s=sync_s,
            elapsed_s=self.elapsed(),
            samples_per_s=samples / max(time.perf_counter() - t0, 1e-9),
            dropped=dict(run.stats.dropped),
            failed_episodes=sum(self.producer.failures.values()) if self.producer else 0,
        )
        self.records.append(rec)
        if self.opts.on_record is not None:
            self.opts.on_record(rec)

    async def _sync_weights(self, name: str, version: int) -> None:
        run = self.runs[name]
        assert run.sync is not None and self.fleet is not None
        p = next(p for p in self.spec.policies if p.name == name)
        peers = []
        if p.trainer.zero_stage == 3 and len(run.ranks) > 1:
            peers = [r.gather_for_peers.remote() for r in run.ranks[1:]]
        result = await asyncio.to_thread(run.sync.sync, version)
        if peers:
            await asyncio.gather(*peers)
        for engine, err in result.failures.items():
            log.warning("weights.engine_failed", policy=name, engine=engine, error=str(err))
            if actor_gone(err):
                lost = self.fleet.mark_dead({engine})
                self._report_lost(lost)
                if engine in run.sync.engines:  # out now: the next step's sync must not wait on it
                    await asyncio.to_thread(run.sync.remove_engine, engine)
                if lost:  # housekeeping will not see it in the sync, so the workers' routes change here
                    await self.fleet.push_routes()

    def _report_lost(self, slots: list[Slot]) -> None:
        """Report each engine or workflow worker once, when the fleet first marks it dead (whoever
        saw it die: the weight sync, a workflow worker, the producer or the housekeeping poll)."""
        assert self.fleet is not None
        for slot in slots:
            if slot.name in self.fleet.engines.get(slot.policy, {}):
                self._emit("engine_lost", engine=slot.name, policy=slot.policy)
            else:
                self._emit("worker_lost", worker=slot.name)

    def elapsed(self) -> float:
        return self._elapsed_before + time.monotonic() - self.started

    # -- checkpoints -----------------------------------------------------------------------------

    async def _maybe_export(self, run: _PolicyRun) -> None:
        """Export the policy as a Hugging Face directory every `checkpoint.exportEvery` steps and at
        its last step (trainers/export.py); every rank takes part (ZeRO-3 gathers are collective)."""
        if not export_due(run.step, self.total, self.spec.checkpoint.export_every):
            return
        location = export_location(self.store.root, run.step, run.name)
        await asyncio.gather(*(r.export.remote(location) for r in run.ranks))
        self._emit("export", policy=run.name, step=run.step, path=location)

    async def _maybe_checkpoint(self) -> None:
        every = self.spec.checkpoint.every_steps
        low = min(r.step for r in self.runs.values())
        last = self.last_ckpt.step if self.last_ckpt is not None else 0
        if low >= last + every and low < self.total:
            await self.checkpoint("periodic")

    async def checkpoint(self, reason: str, request_id: str | None = None) -> CheckpointRef | None:
        async with self._ckpt_lock:
            if request_id is not None and request_id in self.handled_requests:
                return self.last_ckpt
            steps = {n: r.step for n, r in self.runs.items()}
            if self.last_ckpt is not None and steps == {
                n: int(v["step"]) for n, v in self.last_ckpt.state["policies"].items()
            }:
                if request_id is not None:
                    self.handled_requests.append(request_id)
                return self.last_ckpt  # nothing new since the last one
            self.ckpt_in_progress = True
            prev, self.state = self.state, "checkpointing"
            locks = [self.runs[n].lock for n in sorted(self.runs)]
            for lock in locks:
                await lock.acquire()
            try:
                steps = {n: r.step for n, r in self.runs.items()}
                tmp = self.store.begin(min(steps.values()))
                for n, run in self.runs.items():
                    d = storage.join(tmp, "trainers", n)  # each rank uploads its part there
                    await asyncio.gather(*(r.save.remote(d, TRAINER_TAG) for r in run.ranks))
                snap = await self.buffer.snapshot.remote()
                if request_id is not None:
                    self.handled_requests.append(request_id)
                state = {
                    "step": min(steps.values()),
                    "reason": reason,
                    "policies": {
                        n: {"step": r.step, "version": r.step, "samples_per_episode": r.samples_per_episode}
                        for n, r in self.runs.items()
                    },
                    **(self.producer.state() if self.producer is not None else {}),
                    "elapsed_s": self.elapsed(),
                    "request_ids": self.handled_requests[-100:],
                    "job": self.job.metadata.name,
                }
                self.last_ckpt = await asyncio.to_thread(self.store.commit, tmp, state, snap)
                for r in self.runs.values():
                    r.last_ckpt_step = r.step
                self._emit("checkpoint", path=self.last_ckpt.location, reason=reason, steps=steps)
                return self.last_ckpt
            finally:
                for lock in locks:
                    lock.release()
                self.state = prev if prev != "checkpointing" else "running"
                self.ckpt_in_progress = False

    # -- housekeeping: health, drain, elasticity, requests ----------------------------------------

    async def _housekeep(self) -> None:
        assert self.fleet is not None
        while not self._stop.is_set():
            try:
                await self.housekeep_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("housekeeping.failed")
            await asyncio.sleep(self.opts.poll_s)

    def _pending_request(self) -> str | None:
        if self.opts.checkpoint_requests is None:
            return None
        request = self.opts.checkpoint_requests()
        return request if request and request not in self.handled_requests else None

    async def housekeep_once(self) -> None:
        assert self.fleet is not None
        request = self._pending_request()
        if request is not None:
            await self.checkpoint("request", request)
        newly_dead = await self.fleet.poll()
        self._report_lost(newly_dead)
        changed = bool(newly_dead)
        for run in self.runs.values():
            assert run.sync is not None
            for name in list(run.sync.engines):
                slot = self.fleet.engines[run.name].get(name)
                if slot is None or slot.dead:
                    await asyncio.to_thread(run.sync.remove_engine, name)
                    changed = True
        for p in self.spec.policies:
            # A free unit of the role's resource is a pod (or a dead engine's slot) with no engine.
            room = p.rollout.replicas.max - len(self.fleet.live_engines(p.name))
            for _ in range(max(0, min(room, self.fleet.free_units(p.name, "rollout")))):
                slot = self.fleet.new_engine(p)
                run = self.runs[p.name]
                assert run.sync is not None
                await asyncio.to_thread(run.sync.add_engine, slot.name, slot.handle)
                changed = True
                self._emit("engine_added", engine=slot.name, policy=p.name)
        live_workers = [w for w in self.fleet.workers.values() if not w.dead]
        free_w = self.fleet.free_units(None, "workflow")
        if free_w and len(live_workers) < self.spec.workflow.replicas.max:
            slot = self.fleet.new_worker(
                self.job.model_dump_json(by_alias=True), self.buffer, self.opts.episode_timeout_s
            )
            changed = True
            self._emit("worker_added", worker=slot.name)
        if changed:
            await self.fleet.push_routes()

    async def set_draining(self, target: str, draining: bool = True) -> bool:
        assert self.fleet is not None
        found = self.fleet.set_draining(target, draining)
        if found:
            await self.fleet.push_routes()
            self._emit("drain", target=target, draining=draining)
        return found

    # -- reporting (coordinator/report.py) -----------------------------------------------------

    def progress(self) -> Progress:
        """The `/progress` document the operator reads."""
        return progress_report(self)
