"""`engine: vllm` — the rollout engine for GPU pods, an adapter around vLLM's async engine.

Same actor interface as the torch engine (`engines.api`). Generation goes through vLLM (continuous
batching, paged attention, prefix caching) with `allowed_token_ids` for constrained decoding and one
logprob per sampled token. Weight updates arrive through the job's weight-sync transport into a
staging copy shaped like the trainer's (Hugging Face) state dict, then go into the running model in
place with vLLM's own `model.load_weights` on every worker (`collective_rpc`), between two scheduler
steps: vLLM maps checkpoint names to its fused layers itself. An update holds new requests back and
waits for the running ones, so no request spans two versions; each token records the version that
produced it.

vLLM is not a dependency of the runtime: install the `gpu` extra (`polyrl-runtime[gpu]`) in GPU images.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import structlog
import torch

from polyrl_runtime.engines.api import EngineStats, Generation, SamplingParams
from polyrl_runtime.engines.batching import Answer, Request, stream_generations
from polyrl_runtime.models import model_dir
from polyrl_runtime.weights.api import SyncReport, WeightManifest
from polyrl_runtime.weights.endpoints import EngineWeights

log = structlog.get_logger(__name__)


class StagingTarget:
    """A `WeightTarget` whose tensors are allocated from the first manifest (the trainer's names and
    shapes) and, after each complete write, handed to `apply(named_tensors)`."""

    def __init__(self, apply: Any, device: str = "cpu") -> None:
        self._apply = apply
        self._device = device
        self._tensors: dict[str, torch.Tensor] = {}
        self._version = -1

    def prepare(self, manifest: WeightManifest) -> None:
        specs = manifest.layout.specs
        if {s.name for s in specs} != set(self._tensors) or any(
            tuple(self._tensors[s.name].shape) != s.shape or self._tensors[s.name].dtype != s.dtype
            for s in specs
        ):
            self._tensors = {s.name: torch.empty(s.shape, dtype=s.dtype, device=self._device) for s in specs}

    @property
    def version(self) -> int:
        return self._version

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    @contextmanager
    def paused(self, new_version: int) -> Iterator[None]:
        yield
        self._apply(self._tensors)
        self._version = new_version


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside each vLLM worker process (collective_rpc): in-place update of the served model."""
    model = worker.model_runner.model
    model.load_weights(weights=iter(weights))
    return len(weights)


class VllmEngine(EngineWeights):
    def __init__(
        self,
        name: str,
        policy: str,
        model_uri: str,
        *,
        transport: str = "collective",
        transport_kwargs: dict[str, Any] | None = None,
        seed: int = 0,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        **engine_args: Any,
    ) -> None:
        try:
            self._vllm: Any = importlib.import_module("vllm")
        except ImportError as e:
            raise RuntimeError(
                f"{name}: engine vllm needs vLLM installed (polyrl-runtime[gpu]); use engine torch on CPU"
            ) from e
        self.name, self.policy = name, policy
        args = self._vllm.AsyncEngineArgs(
            model=str(model_dir(model_uri)),
            trust_remote_code=trust_remote_code,
            dtype="bfloat16" if dtype == "auto" else dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            **engine_args,
        )
        self.engine = self._vllm.AsyncLLMEngine.from_engine_args(args)
        self.target = StagingTarget(
            self._apply_weights, device="cuda" if torch.cuda.is_available() else "cpu"
        )
        self.init_weight_receiver(transport, self.target, **(transport_kwargs or {}))
        self._ids = itertools.count()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._in_flight = self._queued = self._requests = self._tokens = 0
        self._busy_s = 0.0

    def _apply_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        weights = list(tensors.items())
        rpc = getattr(self.engine, "collective_rpc", None) or self.engine.engine.collective_rpc
        result = rpc(_load_weights_on_worker, args=(weights,))
        if asyncio.iscoroutine(result):
            raise RuntimeError("collective_rpc must be synchronous here (called from the sync thread)")
        log.info("vllm.weights_loaded", engine=self.name, tensors=len(weights))

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self._queued += 1
        await self._unpaused.wait()
        self._queued -= 1
        self._in_flight += 1
        self._requests += 1
        version = self.target.version
        sp = self._vllm.SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_ids) or None,
            allowed_token_ids=list(params.allowed_ids) or None,
            logprobs=0,
            seed=params.seed,
        )
        start = time.perf_counter()
        final: Any = None
        try:
            prompt = {"prompt_token_ids": list(prompt_ids)}
            async for out in self.engine.generate(prompt, sp, f"{self.name}-{next(self._ids)}"):
                final = out
        finally:
            self._in_flight -= 1
            self._busy_s += time.perf_counter() - start
        completion = final.outputs[0]
        ids = list(completion.token_ids)
        lps = [float(step[tok].logprob) for step, tok in zip(completion.logprobs or [], ids, strict=True)]
        self._tokens += len(ids)
        return Generation(
            np.asarray(ids, dtype=np.int32),
            np.asarray(lps, dtype=np.float32),
            np.full(len(ids), version, dtype=np.int32),
            "stop" if completion.finish_reason == "stop" else "length",
            self.name,
        )

    async def generate_many(self, requests: list[Request]) -> AsyncIterator[list[Answer]]:
        """`generate` for each request in one actor call (streamed: `num_returns="streaming"`),
        answers sent as they finish (see `engines/batching.py`)."""
        async for answers in stream_generations(self.generate, requests):
            yield answers

    async def receive_weights(self, manifest: WeightManifest) -> SyncReport:  # type: ignore[override]
        self.target.prepare(manifest)
        self._unpaused.clear()  # new requests wait; running ones finish on the old weights
        try:
            while self._in_flight:
                await asyncio.sleep(0.005)
            return await asyncio.to_thread(EngineWeights.receive_weights, self, manifest)
        finally:
            self._unpaused.set()

    async def pause(self) -> None:
        self._unpaused.clear()

    async def resume(self) -> None:
        self._unpaused.set()

    def weight_version(self) -> int:
        return self.target.version

    def stats(self) -> EngineStats:
        return EngineStats(
            engine=self.name,
            policy=self.policy,
            version=self.target.version,
            in_flight=self._in_flight + self._queued,
            queued=self._queued,
            busy_s=self._busy_s,
            requests=self._requests,
            tokens=self._tokens,
            paused=not self._unpaused.is_set(),
            extra={"pod": os.environ.get("POLYRL_POD_NAME", "")},
        )

    def ping(self) -> str:
        return self.name
