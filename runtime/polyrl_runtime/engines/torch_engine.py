"""The built-in torch engine: continuous batching over a small causal LM, on CPU (or one GPU).

Requests queue in `generate`; one loop admits them into the running batch between forward passes, so
a long generation never holds up short ones (the benchmark's long-tail lengths depend on this). Each
step runs under the weight target's serving lock: a weight update waits for the current step and
applies between two steps, so an unfinished generation continues with the new weights and each token
records the version that produced it (partial rollouts, as in APRIL).

Every model decodes with a KV cache: a request's sequence is prefilled once, then each step feeds
one token per running request, so a token costs the same at any position. The built-in models keep
their own `KVCache` (prefilled with all but the last token, which the next decoding step feeds); a
Hugging Face causal LM keeps transformers' `DynamicCache`, left-padded (`engines/hf_cache.py`),
prefilled with the whole sequence, whose last position gives the next token, so a request of n
tokens costs one prefill and n - 1 decoding steps, as in `model.generate`. Each request's cache row
remembers which weights computed it; after a weight update the rows are prefilled again under the
new weights before the next token, so every token is exactly what the new weights give for the
whole sequence (as the trainer computes it). Steps run in `torch.inference_mode`.

A reply ends at a stop id, a stop string (`engines/stops.py`; the tokenizer is loaded only when a
request has stop strings), `max_new_tokens`, or the model's context limit (`max_position_embeddings`):
prompt and reply must fit in it, as the trainer recomputes them as one sequence. A prompt that
leaves no room is refused before it joins the batch (`PromptTooLongError`).

Several policies may share one engine as LoRA adapters on its base model (`adapters`, see
`engines/adapters.py`): a request names its policy (`SamplingParams.policy`), each row of a batch runs
with its own policy's adapter in the same forward pass, every token records its adapter's version,
and a weight update of one adapter re-prefills only that adapter's requests. The frozen policies of
the shared base (`base_policies`) run on the base alone, their tokens at the base's version.

An aborted request (`Engine.abort`, or a `generate` call cancelled by its caller) leaves the queue or
the running batch before the next step, its cache row freed, and is counted with the tokens it did
not generate (the `TorchEngineAborts` mixin, `engines/torch_aborts.py`).

Sleep and wake (`Engine.sleep`, for device pools) are the `TorchEngineSleep` mixin
(`engines/torch_sleep.py`). Sleep, wake and weight updates exclude each other (`_control`): an update
while asleep is refused (`EngineAsleepError`). Tokens are sampled by `engines/sampling.py`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import numpy as np
import structlog
import torch

from polyrl_operator.api import Lora
from polyrl_operator.pod_contract import ENV_POD_NAME
from polyrl_runtime.cpusets import pin_from_env
from polyrl_runtime.device_memory import HostBuffers, ParkedMemory
from polyrl_runtime.engines.aborts import Aborts
from polyrl_runtime.engines.adapters import EngineAdapters
from polyrl_runtime.engines.api import (
    EngineAsleepError,
    EngineStats,
    Generation,
    PromptTooLongError,
    SamplingParams,
)
from polyrl_runtime.engines.batching import Answer, Request, stream_generations
from polyrl_runtime.engines.hf_cache import BatchCache, prefill
from polyrl_runtime.engines.sampling import sample_batch
from polyrl_runtime.engines.stops import find_stop
from polyrl_runtime.engines.torch_aborts import TorchEngineAborts
from polyrl_runtime.engines.torch_request import TorchRequest
from polyrl_runtime.engines.torch_sleep import TorchEngineSleep
from polyrl_runtime.engines.torch_snapshots import TorchEngineSnapshots
from polyrl_runtime.models import ModelLoadError, Tokenizer, context_limit, load_model, load_tokenizer
from polyrl_runtime.models.tiny import KVCache, TinyCausalLM
from polyrl_runtime.weights.api import SyncReport, TensorTarget, WeightManifest
from polyrl_runtime.weights.collective import TRANSPORT as COLLECTIVE
from polyrl_runtime.weights.registry import DEFAULT_TRANSPORT
from polyrl_runtime.weights.sides import EngineWeights

log = structlog.get_logger(__name__)

# A step this short runs on the event loop: blocking it that long delays a queued call no more than
# a thread hand-off would.
INLINE_STEP_S = 0.01


class TorchEngine(EngineWeights, TorchEngineSleep, TorchEngineAborts, TorchEngineSnapshots):
    """A rollout engine actor for `engine: torch` (methods are called through Ray)."""

    def __init__(
        self,
        name: str,
        policy: str,
        model_uri: str,
        *,
        transport: str = DEFAULT_TRANSPORT,
        transport_kwargs: dict[str, Any] | None = None,
        seed: int = 0,
        max_batch: int = 256,
        device: str = "cpu",
        dtype: str = "auto",
        trust_remote_code: bool = False,
        adapters: Mapping[str, Lora] | None = None,
        base_policies: Sequence[str] = (),
        model_seed: int | None = None,
        snapshot_slots: int = 1,
        model: torch.nn.Module | None = None,
    ) -> None:
        pin_from_env()
        torch.set_num_threads(1)
        self.name = name
        self.policy = policy
        self.model_uri = model_uri
        self.device = torch.device(device)
        self.trust_remote_code = trust_remote_code
        # A built-in model's weights come from `model_seed` (the policy's: every engine and trainer
        # rank of the policy alike; a frozen policy's engines get no other weights), else `seed`.
        # `model`: one loaded already (a serving copy of past weights, engines/full_snapshots.py).
        self.model = model or load_model(
            model_uri,
            seed=seed if model_seed is None else model_seed,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            cuda=self.device.type == "cuda",
        )
        self.model = self.model.to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.target = TensorTarget.from_module(self.model)
        self.init_weight_receiver(transport, self.target, **(transport_kwargs or {}))
        # Several policies as LoRA adapters on this base (`engines/adapters.py`), and the frozen
        # policies it serves the base alone; None: one policy's full weights.
        self.adapters: EngineAdapters | None = None
        if base_policies and not adapters:
            raise ValueError(f"engine {name}: policies served the base alone need a shared base's adapters")
        if adapters:
            if isinstance(self.model, TinyCausalLM):
                raise ModelLoadError(
                    f"engine {name}: policies {', '.join(adapters)} share {model_uri} as LoRA adapters, "
                    "which needs a Hugging Face model; the plain-torch builtin models take none"
                )
            self.adapters = EngineAdapters(name, self.model, self.target, adapters, base_policies)
        # Past versions of full weights (a league's): made at the first snapshot, with at most
        # `snapshot_slots` serving copies of the model.
        self.snapshot_slots, self.full_snapshots = snapshot_slots, None
        self.max_batch = max_batch
        self.max_len = context_limit(self.model)
        hf: Any = self.model
        embeddings = hf.tok if isinstance(hf, TinyCausalLM) else hf.get_input_embeddings()
        self.vocab = int(embeddings.num_embeddings)
        # The built-in models' cache: `_active[i]` owns cache row i (rows 0..n-1 live).
        self._cache: KVCache | None = (
            self.model.new_cache(8) if isinstance(self.model, TinyCausalLM) else None
        )
        # A Hugging Face model's cache: row i belongs to `_kv_rows[i]` (finished or stale rows are
        # dropped at the next step).
        self._kv = BatchCache.empty(self.device)
        self._kv_rows: list[TorchRequest] = []
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        self._pad_id = int(pad) if isinstance(pad, int) else 0
        self._tokenizer: Tokenizer | None = None  # loaded for the first request with stop strings
        self._rng = torch.Generator().manual_seed(seed)
        self._pending: list[TorchRequest] = []
        self._active: list[TorchRequest] = []
        self._wakeup: asyncio.Event | None = None
        self._paused = False
        self._loop_task: asyncio.Task[None] | None = None
        self._busy_s = 0.0
        self._last_step_s = 0.0
        self._requests = 0
        self._tokens = 0
        self._forwards = 0
        self._aborts = Aborts(name)
        self._by_id: dict[str, TorchRequest] = {}  # request id -> its request, while it is served
        # Sleep (see the module docstring): the level asleep at (0: awake), the parked weights,
        # requests that arrived since `sleep` began, and whether they wait for a weight update.
        self._asleep = 0
        self._draining = False
        self._parked: ParkedMemory | None = None
        self._host_buffers = HostBuffers()  # pinned once, reused by every sleep
        self._held: list[TorchRequest] = []
        self._needs_weights = False
        self._control_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    # -- serving -------------------------------------------------------------------------------

    def _ensure_loop(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._loop_task is None or self._loop_task.done() or self._loop_task.get_loop() is not loop:
            # The serving loop and its event belong to one event loop (an engine used from a new
            # loop, as by successive `asyncio.run`s in-process, starts a new serving loop there).
            self._wakeup = asyncio.Event()
            self._loop_task = loop.create_task(self._serve())
        assert self._wakeup is not None
        return self._wakeup

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if not prompt_ids:
            raise ValueError("empty prompt")
        if self.adapters is not None:
            self.adapters.check(params.policy, params.snapshot)  # refused here, not in a batch
        elif params.policy not in ("", self.policy):
            raise ValueError(f"engine {self.name} serves policy {self.policy}, not {params.policy}")
        elif params.snapshot is not None:
            return await self._snapshot_generate(prompt_ids, params)
        if len(prompt_ids) >= self.max_len:  # refused here: in a forward pass it would fail the batch
            raise PromptTooLongError(self.policy, len(prompt_ids), self.max_len)
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab:
            bad = next(i for i in prompt_ids if not 0 <= i < self.vocab)
            raise ValueError(
                f"policy {self.policy}: prompt token id {bad} is outside the model's vocabulary "
                f"(0..{self.vocab - 1}; {self.model_uri})"
            )
        if params.stop and self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(self._load_tokenizer)
        if refused := self._aborts.arrived_aborted(params):
            raise refused
        wake = self._ensure_loop()
        fut: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        held = self._draining or self._asleep or self._needs_weights
        request = TorchRequest(list(prompt_ids), params, fut, generator=gen)
        (self._held if held else self._pending).append(request)
        if params.request_id:
            self._by_id[params.request_id] = request
        self._requests += 1
        wake.set()
        try:
            return await fut
        except asyncio.CancelledError:  # its caller went away: the loop drops it before the next step
            wake.set()
            raise
        finally:
            if self._by_id.get(params.request_id) is request:
                del self._by_id[params.request_id]

    async def generate_many(self, requests: list[Request]) -> AsyncIterator[list[Answer]]:
        """`generate` for each request in one actor call (streamed: `num_returns="streaming"`),
        answers sent as they finish (see `engines/batching.py`)."""
        async for answers in stream_generations(self.generate, requests):
            yield answers

    def _load_tokenizer(self) -> Tokenizer:
        try:
            return load_tokenizer(self.model_uri, trust_remote_code=self.trust_remote_code)
        except Exception as e:
            raise ValueError(
                f"policy {self.policy}: stop strings need the tokenizer of {self.model_uri}: {e}"
            ) from e

    def _decode(self, ids: Sequence[int]) -> str:
        assert self._tokenizer is not None  # loaded by `generate` for requests with stop strings
        return self._tokenizer.decode(ids)

    async def _serve(self) -> None:
        assert self._wakeup is not None
        while True:
            self._drop_abandoned()
            if self._paused or not (self._pending or self._active):
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            room = self.max_batch - len(self._active)
            if room > 0 and self._pending:
                self._active.extend(self._pending[:room])
                del self._pending[:room]
            batch = list(self._active)
            try:
                if self._inline(batch):
                    # A short step costs about as much as handing it to a thread (more on a busy
                    # host, where the thread waits to be scheduled): run it here, then let queued
                    # calls in.
                    finished = self._step(batch)
                    await asyncio.sleep(0)
                else:  # a long step: keep the event loop serving meanwhile
                    finished = await asyncio.to_thread(self._step, batch)
            except Exception as e:  # a bad request must not kill the loop: fail the batch, go on
                log.exception("engine.step_failed", engine=self.name)
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
                self._active = [r for r in self._active if r not in batch]
                for r in self._active:  # their cache rows may have moved: prefill them again
                    r.cached_weights = None
                self._kv, self._kv_rows = BatchCache.empty(self.device), []
                continue
            for r, reason in finished:
                self._retire(r)
                if not r.future.done():
                    r.future.set_result(
                        Generation(
                            np.asarray(r.tokens, dtype=np.int32),
                            np.asarray(r.logprobs, dtype=np.float32),
                            np.asarray(r.versions, dtype=np.int32),
                            reason,
                            self.name,
                            r.stop_str,
                        )
                    )

    def _inline(self, batch: list[TorchRequest]) -> bool:
        """Whether the next step is short enough to run on the event loop: always for the built-in
        models; for a Hugging Face model, a decoding step (no prefill) after one that took less than
        `INLINE_STEP_S`."""
        if self._cache is not None:
            return True
        return self._last_step_s < INLINE_STEP_S and all(r.cached_weights == self._weights(r) for r in batch)

    def _weights(self, r: TorchRequest) -> tuple[int, int]:
        """The update counts of the weights that serve `r` (the base's, its adapter's): its cache row
        is current while they are what it was computed with."""
        adapter = (
            self.adapters.updates(r.params.policy, r.params.snapshot) if self.adapters is not None else 0
        )
        return self.target.updates, adapter

    def _route(self, rows: list[TorchRequest]) -> None:
        """The next forward pass's row i serves `rows[i]` with its policy's adapter."""
        if self.adapters is not None:
            self.adapters.route([(r.params.policy, r.params.snapshot) for r in rows])

    def _retire(self, r: TorchRequest) -> None:
        """Drop a finished request; the last row takes its cache row, so live rows stay 0..n-1 (a
        Hugging Face cache drops its row at the next step)."""
        i, last = self._active.index(r), len(self._active) - 1
        if i != last:
            self._active[i] = self._active[last]
            if self._cache is not None:
                with torch.inference_mode():  # `_step` may have grown the cache in it
                    self._cache.move(last, i)
        self._active.pop()
        if not self._active:  # idle: free the Hugging Face cache now
            self._kv, self._kv_rows = BatchCache.empty(self.device), []

    @staticmethod
    def _buckets(batch: list[TorchRequest], trim: int = 0) -> list[list[TorchRequest]]:
        """Split by sequence length (a row of a full forward pass costs as much as the longest row),
        so long tails do not make every short sequence pay for their length."""
        rows = sorted(batch, key=lambda r: len(r.prompt) + len(r.tokens))
        out: list[list[TorchRequest]] = []
        for r in rows:
            n = len(r.prompt) + len(r.tokens) - trim
            if out and n <= 1.5 * (len(out[-1][0].prompt) + len(out[-1][0].tokens) - trim) + 4:
                out[-1].append(r)
            else:
                out.append([r])
        return out

    def _prefill(self, batch: list[TorchRequest], weights: tuple[int, int]) -> None:
        """Cache all but the last token of each sequence whose cache row is missing or was computed
        with other weights (the last token is fed by the decoding step that follows)."""
        assert self._cache is not None and isinstance(self.model, TinyCausalLM)
        row = {id(r): i for i, r in enumerate(batch)}
        stale = [r for r in batch if r.cached_weights != weights]
        for bucket in self._buckets(stale, trim=1):
            seqs = [(r.prompt + r.tokens)[:-1] for r in bucket]
            rows = torch.tensor([row[id(r)] for r in bucket], device=self.device)
            lengths = torch.tensor([len(s) for s in seqs], device=self.device)
            width = max(len(s) for s in seqs)
            if width == 0:  # one-token prompts: nothing to cache before their first decoding step
                self._cache.lengths[rows] = 0
            else:
                ids = torch.zeros(len(seqs), width, dtype=torch.long)
                for i, s in enumerate(seqs):
                    ids[i, : len(s)] = torch.tensor(s)
                self.model.prefill(ids.to(self.device), lengths, self._cache, rows)
                self._forwards += 1
            for r in bucket:
                r.cached_weights = weights

    def _logits(self, batch: list[TorchRequest]) -> tuple[list[TorchRequest], torch.Tensor]:
        """Next-token logits of every request of `batch` (in the order returned)."""
        if self._cache is None or not isinstance(self.model, TinyCausalLM):
            return self._hf_logits(batch)
        if self._cache.rows < len(batch):
            self._cache.grow(min(max(2 * self._cache.rows, len(batch)), max(self.max_batch, len(batch))))
        self._prefill(batch, (self.target.updates, 0))  # under the serving lock: no update in between
        ids = torch.tensor([r.last_token() for r in batch], device=self.device)
        self._forwards += 1
        return batch, self.model.decode(ids, self._cache).float().cpu()

    def _hf_logits(self, batch: list[TorchRequest]) -> tuple[list[TorchRequest], torch.Tensor]:
        """`_logits` of a Hugging Face model: rows of finished requests and rows computed with other
        weights leave the cache; the cached rows (all but their last token cached) decode their last
        token in one step; new and stale requests are prefilled whole (bucketed by length), which
        gives their next-token logits too, and join the cache."""
        # Under the serving lock: no update in between.
        live = {id(r) for r in batch}
        keep = [
            i for i, r in enumerate(self._kv_rows) if id(r) in live and r.cached_weights == self._weights(r)
        ]
        if len(keep) != len(self._kv_rows):
            self._kv = self._kv.select(keep)
            self._kv_rows = [self._kv_rows[i] for i in keep]
        parts = []
        if self._kv_rows:
            ids = torch.tensor([r.last_token() for r in self._kv_rows], device=self.device)
            self._route(self._kv_rows)
            parts.append(self._kv.decode(self.model, ids))
            self._forwards += 1
        cached = {id(r) for r in self._kv_rows}
        for bucket in self._buckets([r for r in batch if id(r) not in cached]):
            self._route(bucket)
            part, logits = prefill(self.model, [r.prompt + r.tokens for r in bucket], self._pad_id)
            self._forwards += 1
            self._kv = self._kv.concat(part)
            self._kv_rows.extend(bucket)
            parts.append(logits)
            for r in bucket:
                r.cached_weights = self._weights(r)
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        return list(self._kv_rows), logits.float().cpu()

    def _step(self, batch: list[TorchRequest]) -> list[tuple[TorchRequest, str]]:
        start, cpu = time.perf_counter(), time.thread_time()
        # Inference mode, not just no_grad: no version counters or view tracking on any tensor op
        # (about a tenth of the tiny Qwen2's decoding step on CPU). The tensors it creates (caches,
        # logits) are written only in inference mode again (see `_retire`).
        with torch.inference_mode():
            with self.target.serving() as version:
                batch, logits = self._logits(batch)
                adapters = self.adapters
                versions = [
                    version if adapters is None else adapters.version(r.params.policy, r.params.snapshot)
                    for r in batch
                ]
            # The step's own cost (CPU time: on a busy host the wall time includes waiting to run)
            self._last_step_s = time.thread_time() - cpu
            self._busy_s += time.perf_counter() - start
            tokens, logprobs = sample_batch(batch, logits, self._rng)
        self._tokens += len(batch)
        finished = []
        for r, tok, logprob, v in zip(batch, tokens, logprobs, versions, strict=True):
            p = r.params
            r.tokens.append(tok)
            r.logprobs.append(logprob)
            r.versions.append(v)
            if tok in p.stop_ids:
                finished.append((r, "stop"))
            elif p.stop and (hit := find_stop(self._decode, r.tokens, p.stop)):
                r.stop_str = hit
                finished.append((r, "stop"))
            elif len(r.tokens) >= p.max_new_tokens or len(r.prompt) + len(r.tokens) >= self.max_len:
                finished.append((r, "length"))
        return finished

    # -- control -------------------------------------------------------------------------------

    async def receive_weights(self, manifest: WeightManifest) -> SyncReport:  # type: ignore[override]
        async with self._control():
            if self._asleep:
                if manifest.transport == COLLECTIVE:  # take part, so the sender and peers go on
                    await asyncio.to_thread(self._drop_broadcast, manifest)
                raise EngineAsleepError(
                    self.name, self._asleep, f"a weight update (version {manifest.version})"
                )
            # An adapter's version goes to that adapter alone (the others keep serving meanwhile).
            target = self.adapters.target(manifest.policy) if self.adapters is not None else None
            # Off the event loop: fetching may block, and applying waits for the current forward pass.
            report = await asyncio.to_thread(EngineWeights.receive_weights, self, manifest, target)
            if self._needs_weights and report.applied:
                self._needs_weights = False
                self._release_held()
            return report

    def _drop_broadcast(self, manifest: WeightManifest) -> None:
        """Receive a collective version into scratch host tensors and drop it."""
        scratch = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in manifest.layout.specs}
        try:
            self._weight_receiver.receive(manifest, TensorTarget(scratch))
        except Exception:  # the refusal is the caller's error; a failed broadcast is the sender's
            log.warning("engine.asleep_broadcast_failed", engine=self.name, version=manifest.version)

    async def pause(self) -> None:
        self._paused = True

    async def resume(self) -> None:
        self._paused = False
        self._ensure_loop().set()

    def weight_version(self) -> int:
        """The version served: the oldest adapter's on an engine of adapters."""
        if self.adapters is not None:
            return min(self.adapters.versions().values())
        return self.target.version

    def stats(self) -> EngineStats:
        in_flight, queued = self.load()
        return EngineStats(
            engine=self.name,
            policy=self.policy,
            version=self.weight_version(),
            in_flight=in_flight,
            queued=queued,
            busy_s=self._busy_s,
            requests=self._requests,
            tokens=self._tokens,
            paused=self._paused,
            aborted=self._aborts.aborted,
            freed_tokens=self._aborts.freed_tokens,
            extra={
                "pod": os.environ.get(ENV_POD_NAME, ""),
                "forward_passes": self._forwards,
                "asleep": self._asleep,
                **self._snapshot_figures(),
            },
            adapters=self.adapters.versions() if self.adapters is not None else {},
            snapshots=self._snapshots_held(),
        )

    def ping(self) -> str:
        return self.name
