"""`engine: vllm` — the rollout engine for GPU pods: an adapter around vLLM's v1 `AsyncLLM`.

Same actor interface as the torch engine (`engines.api`). The engine is built from `AsyncEngineArgs`
(`vllm_api.engine_args`: `rollout.gpus` as the tensor-parallel size, `rollout.engineArgs` on top)
with `logprobs_mode="processed_logprobs"`, so each token's behaviour logprob is the log-softmax of
logits / temperature over the allowed tokens, what the trainer's loss recomputes. Prefix caching is on.

A weight sync (`receive_weights`, one manifest from the trainer's `collective` sender, or its `cudaipc`
sender when the rollout shares the trainer's pool of one pod):
1. pause the scheduler between two steps, as `spec.weightSync.inflight` says: `keep` freezes running
   requests, `wait` lets them finish on the old weights, `abort` ends them (re-issued here after);
2. every worker receives the version straight into the served parameters (`vllm_worker.py`, called
   by name through `collective_rpc`): from the trainer's broadcasts, or from the trainer's GPU memory
   through CUDA IPC;
3. reset the prefix cache, preempting kept requests so their KV is recomputed by the new weights;
4. label the version in vLLM (`update_weight_version`), which records on each output token the
   version that sampled it (`CompletionOutput.weight_versions`), then resume.

Sleep and wake (`Engine.sleep`, for rollouts on a device pool, which start with vLLM's sleep mode:
`vllm_api.engine_args(sleep_mode=True)`): new requests are held here, vLLM's own `sleep(level)` lets
the requests it has finish (pause mode `wait`), then offloads the weights to host memory and discards
the KV cache (level 1) or discards both (level 2); `wake_up` reverses it. After level 2 the version is
-1 and requests wait until the next update has loaded weights (applied whatever its version). A
weight update while asleep fails with `EngineAsleepError`; a collective one first takes part in the
broadcast without loading it (the sender and the other engines go on), a cudaipc one has nothing to
drain. The bytes a sleep frees are measured on the
workers' GPUs (`polyrl_device_memory`: every process's use of the device).

An aborted request (`Engine.abort`) or a `generate` cancelled by its caller ends where it waits; in
vLLM, `AsyncLLM.abort` stops it and frees its KV blocks. Both count with the tokens they did not make.

New requests wait while a sync runs. A failure before any tensor reached the model resumes on the old
version and raises `WeightSyncError` (the driver's sync-failed path). A failure after that leaves the
weights mixed: the engine never serves again; it shuts vLLM down and exits its actor, so the driver
sees an engine lost and replaces it.

Several policies as LoRA adapters on one base (`adapters`: a rollout shared on a pool, see
`vllm_lora.py`): vLLM runs with LoRA on, a request runs with its policy's adapter (`SamplingParams.policy`),
and each adapter version arrives through the objectstore or shm transport and is added to vLLM under an
id of its own, without pausing any request; every token of a request has the version its request
started with. A frozen policy of the shared base (`base_policies`) is served the base alone: no
`LoRARequest`, no LoRA slot.

vLLM is not a dependency of the runtime: install the `gpu` extra (`polyrl-runtime[gpu]`) in GPU images.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from polyrl_operator.api import Lora
from polyrl_operator.pod_contract import ENV_POD_NAME
from polyrl_runtime.engines import vllm_api, vllm_lora
from polyrl_runtime.engines.aborts import Aborts
from polyrl_runtime.engines.api import (
    EngineAsleepError,
    EngineStats,
    Generation,
    SamplingParams,
    SleepReport,
    SnapshotReport,
    WakeReport,
    check_sleep_level,
)
from polyrl_runtime.engines.batching import Answer, Request, stream_generations
from polyrl_runtime.engines.vllm_weight_rpc import WeightsMixedError, receive_on_workers
from polyrl_runtime.models import model_dir
from polyrl_runtime.weights.api import SyncReport, VersionError, WeightManifest, WeightSyncError, make_report
from polyrl_runtime.weights.collective import TRANSPORT as COLLECTIVE
from polyrl_runtime.weights.collective_group import GroupAddress
from polyrl_runtime.weights.cudaipc import TRANSPORT as CUDAIPC
from polyrl_runtime.weights.cudaipc_handle import CudaIpcHandle

log = structlog.get_logger(__name__)

# The transports whose protocol the worker extension (vllm_worker.py) receives.
TRANSPORTS = (COLLECTIVE, CUDAIPC)
# The transports adapter versions arrive through (into the engine actor's host memory).
ADAPTER_TRANSPORTS = ("objectstore", "shm")
NO_SNAPSHOTS = (
    "engine {engine}: a vLLM engine holds no snapshots of past versions (policy {policy}); the torch "
    "engine does (a league needs rollout.engine torch)"
)


class VllmEngine:
    def __init__(
        self,
        name: str,
        policy: str,
        model_uri: str,
        *,
        transport: str = COLLECTIVE,
        transport_kwargs: Mapping[str, Any] | None = None,
        seed: int = 0,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        gpus: int = 1,
        engine_args: Mapping[str, Any] | None = None,
        inflight: str = "keep",
        policy_path: str = "rollout",
        sleep_mode: bool = False,
        adapters: Mapping[str, Lora] | None = None,
        base_policies: Sequence[str] = (),
        model_seed: int | None = None,  # built-in models' only: vLLM loads Hugging Face weights
    ) -> None:
        self.name, self.policy = name, policy
        if base_policies and not adapters:
            raise ValueError(f"{name}: policies served the base alone need a shared base's adapters")
        if adapters and transport not in ADAPTER_TRANSPORTS:
            raise ValueError(
                f"{name}: policies {', '.join(adapters)} share this engine as LoRA adapters, whose versions "
                f"arrive through {' or '.join(ADAPTER_TRANSPORTS)}; spec.weightSync.transport is {transport!r}"
            )
        if not adapters and transport not in TRANSPORTS:
            raise ValueError(
                f"{name}: engine vllm receives weights through {COLLECTIVE} (NCCL) or {CUDAIPC} (a rollout "
                f"on its trainer's pool of one pod); spec.weightSync.transport is {transport!r}: set it to "
                "one of those, or auto"
            )
        if inflight not in vllm_api.INFLIGHT_MODES:
            raise ValueError(
                f"spec.weightSync.inflight: {inflight!r} is not one of {vllm_api.INFLIGHT_MODES}"
            )
        path = str(model_dir(model_uri))
        kwargs = vllm_api.engine_args(
            path,
            gpus=gpus,
            dtype=dtype,
            seed=seed,
            trust_remote_code=trust_remote_code,
            extra=engine_args,
            policy_path=policy_path,
            sleep_mode=sleep_mode,
            lora_ranks=[lora.rank for lora in (adapters or {}).values()],
        )
        try:
            engine_args_cls = vllm_api.load("AsyncEngineArgs")
            llm_cls = vllm_api.load("AsyncLLM")
            self._sampling_cls = vllm_api.load("SamplingParams")
            lora_cls = vllm_api.load("LoRARequest") if adapters else None
        except ImportError as e:
            raise RuntimeError(
                f"{name}: engine vllm needs vLLM installed (polyrl-runtime[gpu]); use engine torch on CPU"
            ) from e
        log.info("vllm.starting", engine=name, tensor_parallel_size=kwargs["tensor_parallel_size"])
        self._llm: Any = llm_cls.from_engine_args(engine_args_cls(**kwargs))
        self._inflight = inflight
        self._timeout_s = float((transport_kwargs or {}).get("timeout_s", 600.0))
        self._version = -1
        self._pauses = 0  # bumped as each sync pauses: a request it aborted (abort mode) is re-issued
        self._retired = ""
        self._sync_lock = asyncio.Lock()
        self._open = asyncio.Event()  # cleared while a sync (or the driver's pause) holds new requests
        self._open.set()
        self._ids = itertools.count()
        self._aborts = Aborts(name)
        self._live: dict[str, _Live] = {}  # request id -> its request, while `generate` runs
        self._in_flight = self._queued = self._requests = self._tokens = 0
        self._busy_s = 0.0
        self._sleep_mode = sleep_mode
        self._asleep = 0  # the level it sleeps at (0: awake)
        self._weights_dropped = False  # a level-2 sleep: serve again only after an update
        self._adapters: vllm_lora.VllmAdapters | None = None
        if adapters:
            self._adapters = vllm_lora.VllmAdapters(
                name,
                self._llm,
                lora_cls,
                model_dir=path,
                trust_remote_code=trust_remote_code,
                loras=adapters,
                transport=transport,
                transport_kwargs=transport_kwargs,
                base_policies=base_policies,
            )

    # -- generation ----------------------------------------------------------------------------

    async def snapshot(self, policy: str, keep: int) -> SnapshotReport:
        raise ValueError(NO_SNAPSHOTS.format(engine=self.name, policy=policy))

    async def snapshot_state(self, policy: str, versions: Sequence[int]) -> dict[int, dict[str, Any]]:
        raise ValueError(NO_SNAPSHOTS.format(engine=self.name, policy=policy))

    async def load_snapshots(
        self, policy: str, states: Mapping[int, Mapping[str, Any]], keep: int
    ) -> SnapshotReport:
        raise ValueError(NO_SNAPSHOTS.format(engine=self.name, policy=policy))

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if params.snapshot is not None:
            raise ValueError(NO_SNAPSHOTS.format(engine=self.name, policy=params.policy or self.policy))
        if refused := self._aborts.arrived_aborted(params):
            raise refused
        live = _Live(asyncio.current_task())
        if params.request_id:
            self._live[params.request_id] = live
        try:
            return await self._generate(prompt_ids, params, live)
        except asyncio.CancelledError:
            # Aborted (`abort` cancels it) or its caller went away: stopped in vLLM either way.
            if live.vllm_id:
                await self._llm.abort(request_id=live.vllm_id)
            error = self._aborts.stopped(params, live.generated)
            task = asyncio.current_task()
            if live.aborted and task is not None and task.uncancel() == 0:  # cancelled by `abort` alone
                raise error from None
            raise
        finally:
            if self._live.get(params.request_id) is live:
                del self._live[params.request_id]

    async def abort(self, request_ids: list[str]) -> None:
        """`Engine.abort`: each request's `generate` is cancelled where it waits, which aborts it in
        vLLM (`AsyncLLM.abort`, freeing its KV blocks) and raises `RequestAbortedError`."""
        for rid in request_ids:
            live = self._live.get(rid)
            if live is None:
                if rid:
                    self._aborts.unmatched(rid)
            elif not live.aborted and live.task is not None:
                live.aborted = True
                live.task.cancel()

    async def _generate(self, prompt_ids: list[int], params: SamplingParams, live: _Live) -> Generation:
        sampling = self._sampling_cls(**vllm_api.sampling_kwargs(params))
        while True:
            if not self._open.is_set():
                self._queued += 1
                try:
                    await self._open.wait()
                finally:
                    self._queued -= 1
            if self._retired:
                raise WeightSyncError(f"{self.name}: retired ({self._retired})")
            version, pauses = self._version, self._pauses
            adapter = self._adapters.acquire(params.policy) if self._adapters is not None else None
            lora = self._adapters.request(adapter) if self._adapters is not None else None
            self._in_flight += 1
            self._requests += 1
            start = time.perf_counter()
            final: Any = None
            try:
                prompt = {"prompt_token_ids": list(prompt_ids)}
                request_id = live.vllm_id = f"{self.name}-{next(self._ids)}"
                async for out in self._llm.generate(prompt, sampling, request_id, lora_request=lora):
                    final = out
                    live.generated = len(final.outputs[0].token_ids)
                live.vllm_id = ""
            finally:
                self._in_flight -= 1
                self._busy_s += time.perf_counter() - start
                if self._adapters is not None:
                    await self._adapters.release(adapter)
            completion = final.outputs[0]
            reason, stop_str = vllm_api.finish_reason(completion.finish_reason, completion.stop_reason)
            if reason == "abort" and self._inflight == "abort" and self._pauses != pauses:
                continue  # ended by a weight update in abort mode: issue it again on the new weights
            if self._adapters is not None:  # every token: the adapter version the request started with
                base = params.policy in self._adapters.base_policies  # the base as loaded: its version
                served = adapter.version if adapter else version if base else -1
                return self._generation(completion, reason, stop_str, served, False)
            return self._generation(completion, reason, stop_str, version)

    def _generation(
        self, completion: Any, reason: str, stop_str: str, version: int, spans: bool = True
    ) -> Generation:
        """`version`: the weights the request started on, for tokens vLLM's version spans do not label
        (all of them without `spans`)."""
        ids = list(completion.token_ids)
        lps = []
        for step, tok in zip(completion.logprobs or [], ids, strict=True):
            entry = step[tok]
            lps.append(float(entry.logprob))
        labels = (
            [(span.version, span.start, span.end) for span in completion.weight_versions or ()]
            if spans
            else []
        )
        self._tokens += len(ids)
        return Generation(
            np.asarray(ids, dtype=np.int32),
            np.asarray(lps, dtype=np.float32),
            np.asarray(vllm_api.token_versions(labels, len(ids), version), dtype=np.int32),
            reason,
            self.name,
            stop_str,
        )

    async def generate_many(self, requests: list[Request]) -> AsyncIterator[list[Answer]]:
        """`generate` for each request in one actor call (streamed: `num_returns="streaming"`),
        answers sent as they finish (see `engines/batching.py`)."""
        async for answers in stream_generations(self.generate, requests):
            yield answers

    # -- weights -------------------------------------------------------------------------------

    async def receive_weights(self, manifest: WeightManifest) -> SyncReport:
        if self._retired:
            raise WeightSyncError(f"{self.name}: retired ({self._retired})")
        if self._adapters is not None:
            return await self._adapters.receive(manifest)
        if not isinstance(manifest.handle, GroupAddress | CudaIpcHandle):
            raise WeightSyncError(
                f"{self.name}: manifest of transport {manifest.transport!r}, not {COLLECTIVE} or {CUDAIPC}"
            )
        async with self._sync_lock:
            if self._asleep:
                await self._rpc(manifest, apply=False)  # collective: take part, the sender and peers go on
                raise EngineAsleepError(
                    self.name, self._asleep, f"a weight update (version {manifest.version})"
                )
            return await self._receive(manifest)

    async def _receive(self, manifest: WeightManifest) -> SyncReport:
        start = time.perf_counter()
        if manifest.version < self._version:
            # Still drain a broadcast: leaving would hang the sender and the other engines.
            await self._rpc(manifest, apply=False)
            raise VersionError(
                f"{manifest.policy}: update to version {manifest.version} is older than {self.name}'s "
                f"{self._version}"
            )
        # A resend to a current engine is drained only; after a level-2 sleep every version loads.
        apply = manifest.version != self._version or self._weights_dropped
        pause_start = time.perf_counter()
        if apply:
            self._open.clear()
            self._pauses += 1
            log.info("vllm.pausing", engine=self.name, mode=self._inflight, version=manifest.version)
            await self._llm.pause_generation(mode=self._inflight, clear_cache=False)
        try:
            written = await self._rpc(manifest, apply=apply)
        except BaseException as e:
            # Only a failure the workers reported before loading anything keeps the old version
            # serving; anything else (loaded, RPC failed or timed out, cancelled) is of unknown extent.
            if not isinstance(e, WeightSyncError) or isinstance(e, WeightsMixedError):
                await self._retire(f"{type(e).__name__}: {e}")
            if apply:
                await self._llm.resume_generation()
                if not self._weights_dropped:  # after a level-2 sleep only loaded weights serve
                    self._open.set()
            raise
        if not apply:
            return make_report(manifest, start, 0.0, applied=False)
        try:
            await self._llm.reset_prefix_cache(reset_running_requests=True)
            await self._llm.update_weight_version(new_version=str(manifest.version))
        except BaseException as e:
            await self._retire(f"weights of version {manifest.version} loaded, then: {e}")
            raise
        self._version = manifest.version
        self._weights_dropped = False
        await self._llm.resume_generation()
        self._open.set()
        pause = time.perf_counter() - pause_start
        log.info(
            "vllm.weights_applied", engine=self.name, version=manifest.version, tensors=written, pause_s=pause
        )
        return make_report(manifest, start, pause, applied=True)

    async def _rpc(self, manifest: WeightManifest, *, apply: bool) -> int:
        log.info("vllm.receiving", engine=self.name, version=manifest.version, bytes=manifest.nbytes)
        return await receive_on_workers(self._llm, manifest, apply=apply, timeout_s=self._timeout_s)

    async def _retire(self, reason: str) -> None:
        """The served weights are mixed: never serve again. Requests waiting here fail; vLLM shuts
        down and the actor exits, which the driver handles as a lost engine (it starts another)."""
        self._retired = reason
        log.error("vllm.retired", engine=self.name, reason=reason)
        self._open.set()
        try:
            self._llm.shutdown()
        finally:
            os._exit(1)  # the caller's call fails as an actor death: the driver's engine-lost path

    # -- control -------------------------------------------------------------------------------

    async def pause(self) -> None:
        self._open.clear()

    async def resume(self) -> None:
        if not (self._sync_lock.locked() or self._asleep or self._weights_dropped):
            self._open.set()

    # -- sleep ---------------------------------------------------------------------------------

    async def sleep(self, level: int = 1) -> SleepReport:
        check_sleep_level(self.name, level)
        if not self._sleep_mode:
            raise RuntimeError(
                f"engine {self.name} cannot sleep: it runs without vLLM's sleep mode, which polyrl turns "
                "on for rollouts on a device pool (rollout.pool)"
            )
        if level == 2 and self._adapters is not None:
            # Its trainers publish adapters only: nothing would ever bring the dropped base back.
            raise ValueError(
                f"engine {self.name} serves LoRA adapters on a base no update resends: it sleeps at level 1 only"
            )
        async with self._sync_lock:  # not during a weight sync
            if self._asleep:
                raise EngineAsleepError(self.name, self._asleep, "sleeping again")
            start = time.perf_counter()
            self._open.clear()  # new requests wait here until wake_up
            try:
                before = await self._device_bytes()
                await self._llm.sleep(level=level, mode=vllm_api.SLEEP_PAUSE_MODE)
            except BaseException:
                self._open.set()  # it did not sleep: it serves on
                raise
            freed = before - await self._device_bytes()
            self._asleep = level
            if level == 2:  # no weights: the next update loads them, whatever its version
                self._version, self._weights_dropped = -1, True
        report = SleepReport(self.name, level, time.perf_counter() - start, max(0, freed))
        log.info("vllm.asleep", engine=self.name, level=level, freed_bytes=freed, seconds=report.seconds)
        return report

    async def wake_up(self) -> WakeReport:
        async with self._sync_lock:
            if not self._asleep:
                raise RuntimeError(f"engine {self.name} is awake: nothing to wake")
            start = time.perf_counter()
            before = await self._device_bytes()
            await self._llm.wake_up()
            restored = await self._device_bytes() - before
            level, self._asleep = self._asleep, 0
            if not self._weights_dropped:
                self._open.set()
        report = WakeReport(
            self.name, level, time.perf_counter() - start, max(0, restored), self._weights_dropped
        )
        log.info("vllm.awake", engine=self.name, level=level, restored_bytes=restored, seconds=report.seconds)
        return report

    async def _device_bytes(self) -> int:
        """Device memory in use on the workers' GPUs (summed over tensor-parallel ranks)."""
        results = await self._llm.collective_rpc("polyrl_device_memory", timeout=60.0)
        return sum(int(r["used"]) for r in results)

    def weight_version(self) -> int:
        """The version served: the oldest adapter's on an engine of adapters."""
        if self._adapters is not None:
            return min(self._adapters.versions.versions().values())
        return self._version

    def stats(self) -> EngineStats:
        return EngineStats(
            engine=self.name,
            policy=self.policy,
            version=self.weight_version(),
            in_flight=self._in_flight + self._queued,
            queued=self._queued,
            busy_s=self._busy_s,
            requests=self._requests,
            tokens=self._tokens,
            paused=not self._open.is_set(),
            aborted=self._aborts.aborted,
            freed_tokens=self._aborts.freed_tokens,
            extra={"pod": os.environ.get(ENV_POD_NAME, ""), "retired": self._retired, "asleep": self._asleep},
            adapters=self._adapters.versions.versions() if self._adapters is not None else {},
        )

    def ping(self) -> str:
        return self.name


@dataclass
class _Live:
    """A request while its `generate` runs: its task, its vLLM id while in vLLM, tokens so far."""

    task: asyncio.Task[Any] | None
    vllm_id: str = ""
    generated: int = 0
    aborted: bool = False
