"""The rollout-engine interface: token ids in, token ids with behaviour logprobs and versions out.

Every engine (the built-in torch engine, the vLLM adapter) is a Ray actor with these methods; the
workflow side reaches them through `EnginePool`, the driver for weights, pause/resume and stats.
Logprob convention (shared with the trainers): the log-probability of the sampled token under the
model's logits divided by the temperature, restricted to `allowed_ids` when given. `top_p` narrows
sampling but not the recorded logprob (as vLLM's processed logprobs).

A generation ends at a stop id (EOS), when the decoded reply contains a stop string (its tokens stay
in `token_ids`: they were sampled and are trained on; `Generation.stop_str` names the string so the
workflow can cut the reply text), after `max_new_tokens`, or at the model's context limit; or it is
aborted (`Engine.abort`, by its `request_id`) and its `generate` raises `RequestAbortedError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # weights.api imports torch, which a workflow worker (it imports this) never loads
    from polyrl_runtime.weights.api import SyncReport, WeightManifest


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_ids: tuple[int, ...] = ()
    allowed_ids: tuple[int, ...] = ()  # constrained decoding: sample only these ids (empty: any)
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings, any length: the reply ends where one appears
    include_stop_str: bool = False  # whether the reply text keeps the matched stop string
    # The policy the request samples for ("": the engine's own). An engine serving several policies
    # as LoRA adapters on one base runs the request with that policy's adapter.
    policy: str = ""
    # A past version of the policy to sample with (a league's opponent), which the engine holds as a
    # snapshot (`snapshot` of an engine of LoRA adapters); None: its current weights.
    snapshot: int | None = None
    # The caller's name for the request ("": none), unique among the requests it sends: what
    # `Engine.abort` names to stop it (`EnginePool` sets one on every request).
    request_id: str = ""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.snapshot is not None and self.snapshot < 0:
            raise ValueError(f"snapshot must be a weight version >= 0, got {self.snapshot}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature >= 0 and 0 < top_p <= 1 required")


@dataclass(frozen=True)
class Generation:
    """One completion: response token ids, behaviour logprobs and the weight version of each token."""

    token_ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]
    versions: npt.NDArray[np.int32]
    finish_reason: str  # "stop" | "length"
    engine: str = ""
    stop_str: str = ""  # the stop string that ended the reply ("" for a stop id or a length limit)


@dataclass
class EngineStats:
    engine: str
    policy: str
    version: int
    in_flight: int  # requests accepted and not finished (queued + running)
    queued: int  # waiting for a batch slot
    busy_s: float  # cumulative time spent in forward passes
    requests: int
    tokens: int
    paused: bool
    extra: dict[str, Any] = field(default_factory=dict)
    # An engine serving policies as LoRA adapters: each policy's adapter version (`version` is the
    # oldest of them).
    adapters: dict[str, int] = field(default_factory=dict)
    # Requests stopped before they finished because their caller aborted (`Engine.abort`) or went
    # away, and the tokens they did not generate: each one's max_new_tokens minus what it had.
    aborted: int = 0
    freed_tokens: int = 0
    # Per policy with snapshots (an engine of LoRA adapters), the past versions it holds.
    snapshots: dict[str, list[int]] = field(default_factory=dict)


class UnknownSnapshotError(ValueError):
    """A request names a past version of a policy that the engine does not hold (never taken, or
    evicted by a newer one)."""

    def __init__(self, engine: str, policy: str, version: int, held: Sequence[int]) -> None:
        have = ", ".join(map(str, held)) or "none"
        super().__init__(
            f"engine {engine} holds no snapshot of policy {policy!r} at version {version} (it holds: {have})"
        )
        self.engine, self.policy, self.version, self.held = engine, policy, version, tuple(held)

    def __reduce__(self) -> tuple[type[UnknownSnapshotError], tuple[str, str, int, tuple[int, ...]]]:
        return UnknownSnapshotError, (self.engine, self.policy, self.version, self.held)  # through Ray


@dataclass(frozen=True)
class SnapshotReport:
    """What `EngineAdapters.snapshot` did: the version it holds now, the versions it evicted, and the
    bytes the policy's snapshots occupy on the engine's device."""

    policy: str
    version: int
    evicted: tuple[int, ...]
    held: tuple[int, ...]
    nbytes: int


class PromptTooLongError(ValueError):
    """A prompt leaves no room for a reply in the model's context (the prompt and every generated
    token must fit in `limit` positions, as the trainer recomputes them in one sequence)."""

    def __init__(self, policy: str, prompt_len: int, limit: int, agent: str = "") -> None:
        who = f"agent {agent} (policy {policy})" if agent else f"policy {policy}"
        super().__init__(
            f"{who}: a prompt of {prompt_len} tokens does not fit the model's context of "
            f"{limit} tokens (max_position_embeddings) with room for a reply; shorten the prompt"
        )
        self.policy, self.prompt_len, self.limit, self.agent = policy, prompt_len, limit, agent

    def __reduce__(self) -> tuple[type[PromptTooLongError], tuple[str, int, int, str]]:
        return PromptTooLongError, (self.policy, self.prompt_len, self.limit, self.agent)  # through Ray


class RequestAbortedError(RuntimeError):
    """The request was aborted (`Engine.abort`) before it finished: what its `generate` raises."""

    def __init__(self, engine: str, request_id: str, generated: int, max_new_tokens: int) -> None:
        super().__init__(
            f"engine {engine}: request {request_id} was aborted by its caller after {generated} of at "
            f"most {max_new_tokens} tokens"
        )
        self.engine, self.request_id = engine, request_id
        self.generated, self.max_new_tokens = generated, max_new_tokens

    def __reduce__(self) -> tuple[type[RequestAbortedError], tuple[str, str, int, int]]:
        return RequestAbortedError, (self.engine, self.request_id, self.generated, self.max_new_tokens)


class EngineUnavailableError(RuntimeError):
    """No live engine of the policy could serve the request (all dead or draining)."""


SLEEP_LEVELS = (1, 2)


@dataclass(frozen=True)
class SleepReport:
    """What one `Engine.sleep` did: the seconds it took (the wait for in-flight requests included)
    and the bytes of device memory it released (KV cache, and weights moved to the host or dropped)."""

    engine: str
    level: int
    seconds: float
    freed_bytes: int


@dataclass(frozen=True)
class WakeReport:
    """What one `Engine.wake_up` did: the seconds it took, the bytes it brought back onto the device,
    and whether the engine waits for a weight update before it serves (after a level-2 sleep)."""

    engine: str
    level: int  # the level it slept at
    seconds: float
    restored_bytes: int
    needs_weights: bool


class EngineAsleepError(RuntimeError):
    """An asleep engine refused a call that needs its device memory (a weight update, another sleep)."""

    def __init__(self, engine: str, level: int, what: str) -> None:
        super().__init__(f"engine {engine} is asleep (level {level}): wake_up() it before {what}")
        self.engine, self.level, self.what = engine, level, what

    def __reduce__(self) -> tuple[type[EngineAsleepError], tuple[str, int, str]]:
        return EngineAsleepError, (self.engine, self.level, self.what)  # through Ray


def check_sleep_level(engine: str, level: int) -> None:
    if level not in SLEEP_LEVELS:
        raise ValueError(
            f"engine {engine}: sleep level {level} is not one of {SLEEP_LEVELS} (1: weights to host "
            "memory, KV cache freed; 2: weights and KV cache freed, reloaded by the next weight update)"
        )


class Engine(Protocol):
    """What the pool and the driver call on an engine actor, through `engines.client.EngineClient`
    (an engine class is started as an `ActorHandle[Engine]`, which checks that it implements this)."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...

    # Optional (the pool falls back to `generate`): many requests in one call, each answer streamed
    # back as it finishes, as `engines.batching.stream_generations` does.
    def generate_many(
        self, requests: list[tuple[list[int], SamplingParams]]
    ) -> AsyncIterator[list[tuple[int, Generation | BaseException]]]: ...

    async def abort(self, request_ids: list[str]) -> None:
        """Stop these requests (by `SamplingParams.request_id`) at the engine's next step and free
        their batch slots and KV cache; each one's `generate` raises `RequestAbortedError`. An id the
        engine does not hold (finished, or still on its way: calls to an async actor may start out
        of order) is remembered among the last `aborts.REMEMBERED` such ids, and a request of that
        id arriving later is refused the same way."""
        ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def receive_weights(self, manifest: WeightManifest) -> SyncReport:
        """Load one published version (weights/endpoints.py drives it)."""
        ...

    def weight_version(self) -> int: ...

    def stats(self) -> EngineStats: ...

    async def snapshot(self, policy: str, keep: int) -> SnapshotReport:
        """Hold `policy`'s current version as a snapshot that requests name by
        `SamplingParams.snapshot` (a league's opponents), at most `keep` (the oldest evicted, its
        requests still in the engine failed with `UnknownSnapshotError`). An engine that cannot hold
        one raises a ValueError saying why."""
        ...

    async def snapshot_state(self, policy: str, versions: Sequence[int]) -> dict[int, dict[str, Any]]:
        """Copies of `policy`'s snapshots at `versions` (version -> its tensors), for an engine that
        joined to hold them (`load_snapshots`); `UnknownSnapshotError` for one it does not hold."""
        ...

    async def load_snapshots(
        self, policy: str, states: Mapping[int, Mapping[str, Any]], keep: int
    ) -> SnapshotReport:
        """Hold snapshots another engine of the policy's base gave (`snapshot_state`) beside its own,
        at most `keep` of all (the oldest evicted)."""
        ...

    # Device pools: an engine sleeps while other roles use its device, vLLM's sleep-mode semantics.
    async def sleep(self, level: int = 1) -> SleepReport:
        """Free the engine's device memory. Requests it accepted before the call finish first; requests
        arriving while it sleeps wait and are served after `wake_up`. Level 1: the KV cache is freed,
        the weights move to host memory (they stay where they are on a CPU engine, whose device is
        the host). Level 2: KV cache and weights are freed; the version becomes -1 and the next
        weight update loads the weights. Weight updates and a second sleep are refused with
        `EngineAsleepError` until `wake_up` (a collective update is received and dropped, so the
        sender and the other engines are not held)."""
        ...

    async def wake_up(self) -> WakeReport:
        """Undo `sleep`: weights (level 1) and room for the KV cache back on the device. After level 2
        the waiting requests are served once a weight update has loaded weights."""
        ...
