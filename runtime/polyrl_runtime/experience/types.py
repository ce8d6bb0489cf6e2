"""Typed experience records: episodes of agent turns, per-policy samples, and columnar sample batches.

Token ids, logprobs and versions are numpy arrays rather than lists: Ray moves numpy buffers out of
band (no per-element pickling), which is what lets experience stream at close to raw transfer speed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float32]


def _arr(name: str, value: Any, dtype: type[np.generic]) -> Any:
    a = np.ascontiguousarray(value, dtype=dtype)
    if a.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {a.shape}")
    return a


@dataclass(frozen=True, eq=False)
class Turn:
    """One agent turn: the prompt it saw and the response its policy produced, token by token."""

    agent: str
    policy: str
    prompt_ids: IntArray
    response_ids: IntArray
    logprobs: FloatArray  # behaviour logprob of each response token
    versions: IntArray  # policy version that produced each response token (may change mid-turn)
    # Constrained decoding: the token ids every response token was sampled from (empty: the whole
    # vocabulary). Trainers compute logprobs under the same constraint as the behaviour policy.
    allowed_ids: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))

    def __post_init__(self) -> None:
        for name, dtype in (
            ("prompt_ids", np.int32),
            ("response_ids", np.int32),
            ("logprobs", np.float32),
            ("versions", np.int32),
            ("allowed_ids", np.int32),
        ):
            object.__setattr__(self, name, _arr(name, getattr(self, name), dtype))
        n = len(self.response_ids)
        if n == 0:
            raise ValueError(f"turn of agent {self.agent!r} has no response tokens")
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"turn of agent {self.agent!r}: {n} response tokens but {len(self.logprobs)} logprobs "
                f"and {len(self.versions)} versions"
            )
        if not self.agent or not self.policy:
            raise ValueError("agent and policy names must be non-empty")


@dataclass(frozen=True, eq=False)
class Episode:
    """One multi-agent episode: its turns in order, one reward per agent, free-form metadata."""

    episode_id: str
    turns: tuple[Turn, ...]
    rewards: Mapping[str, float]
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "turns", tuple(self.turns))
        object.__setattr__(self, "rewards", MappingProxyType({k: float(v) for k, v in self.rewards.items()}))
        if not self.episode_id:
            raise ValueError("episode_id must be non-empty")
        for t in self.turns:
            if t.agent not in self.rewards:
                raise ValueError(f"episode {self.episode_id}: no reward for agent {t.agent!r}")

    @property
    def policies(self) -> frozenset[str]:
        return frozenset(t.policy for t in self.turns)

    def samples(self) -> list[Sample]:
        """One sample per turn; they share the episode id and carry the turn's agent reward."""
        return [
            Sample(
                sample_id=f"{self.episode_id}/{i}",
                episode_id=self.episode_id,
                policy=t.policy,
                agent=t.agent,
                turn_index=i,
                prompt_ids=t.prompt_ids,
                response_ids=t.response_ids,
                logprobs=t.logprobs,
                versions=t.versions,
                reward=self.rewards[t.agent],
                allowed_ids=t.allowed_ids,
            )
            for i, t in enumerate(self.turns)
        ]

    def __reduce__(self) -> Any:
        # On the wire an episode is two flat arrays (int32: every turn's prompt, response and versions;
        # float32: logprobs) plus lengths, not four small arrays per turn: Ray handles each numpy buffer
        # separately, and per-buffer overhead, not bytes, dominated episode transfer.
        ints = [a for t in self.turns for a in (t.prompt_ids, t.response_ids, t.versions, t.allowed_ids)]
        flat_i = np.concatenate(ints) if ints else np.zeros(0, np.int32)
        flat_f = np.concatenate([t.logprobs for t in self.turns]) if self.turns else np.zeros(0, np.float32)
        heads = tuple(
            (t.agent, t.policy, len(t.prompt_ids), len(t.response_ids), len(t.allowed_ids))
            for t in self.turns
        )
        return (
            _rebuild_episode,
            ((self.episode_id, heads, flat_i, flat_f, dict(self.rewards), dict(self.metadata)),),
        )


def _rebuild_episode(
    state: tuple[
        str,
        tuple[tuple[str, str, int, int, int], ...],
        IntArray,
        FloatArray,
        dict[str, float],
        dict[str, Any],
    ],
) -> Episode:
    episode_id, heads, flat_i, flat_f, rewards, metadata = state
    turns, i, f = [], 0, 0
    for agent, policy, n_prompt, n_resp, n_allowed in heads:
        prompt = flat_i[i : i + n_prompt]
        response = flat_i[i + n_prompt : i + n_prompt + n_resp]
        versions = flat_i[i + n_prompt + n_resp : i + n_prompt + 2 * n_resp]
        j = i + n_prompt + 2 * n_resp
        allowed = flat_i[j : j + n_allowed]
        turns.append(Turn(agent, policy, prompt, response, flat_f[f : f + n_resp], versions, allowed))
        i = j + n_allowed
        f += n_resp
    return Episode(episode_id, tuple(turns), rewards, metadata)


@dataclass(frozen=True, eq=False)
class Sample:
    """What a policy's trainer consumes: one turn of one episode with that agent's reward."""

    sample_id: str
    episode_id: str
    policy: str
    agent: str
    turn_index: int
    prompt_ids: IntArray
    response_ids: IntArray
    logprobs: FloatArray
    versions: IntArray
    reward: float
    allowed_ids: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # empty: any

    @property
    def min_version(self) -> int:
        """The oldest policy version among the response tokens: what staleness is measured from."""
        return int(self.versions.min())

    @property
    def nbytes(self) -> int:
        return int(
            self.prompt_ids.nbytes + self.response_ids.nbytes + self.logprobs.nbytes + self.versions.nbytes
        )


def _ragged(parts: Sequence[npt.NDArray[Any]], dtype: type[np.generic]) -> tuple[Any, npt.NDArray[np.int64]]:
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    flat = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)
    return flat, offsets


@dataclass(frozen=True, eq=False)
class SampleBatch:
    """Samples of one policy in columnar form: ragged token arrays as flat values plus offsets."""

    policy: str
    sample_ids: tuple[str, ...]
    episode_ids: tuple[str, ...]
    agents: tuple[str, ...]
    turn_index: npt.NDArray[np.int32]
    rewards: FloatArray
    prompt_ids: IntArray
    prompt_offsets: npt.NDArray[np.int64]
    response_ids: IntArray
    response_offsets: npt.NDArray[np.int64]
    logprobs: FloatArray
    versions: IntArray
    # Ragged per-sample decoding constraints (see Turn.allowed_ids); empty rows mean unconstrained.
    allowed_ids: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    allowed_offsets: npt.NDArray[np.int64] | None = None

    @classmethod
    def from_samples(cls, policy: str, samples: Sequence[Sample]) -> SampleBatch:
        prompt, p_off = _ragged([s.prompt_ids for s in samples], np.int32)
        response, r_off = _ragged([s.response_ids for s in samples], np.int32)
        logprobs, _ = _ragged([s.logprobs for s in samples], np.float32)
        versions, _ = _ragged([s.versions for s in samples], np.int32)
        allowed, a_off = _ragged([s.allowed_ids for s in samples], np.int32)
        return cls(
            policy=policy,
            sample_ids=tuple(s.sample_id for s in samples),
            episode_ids=tuple(s.episode_id for s in samples),
            agents=tuple(s.agent for s in samples),
            turn_index=np.array([s.turn_index for s in samples], dtype=np.int32),
            rewards=np.array([s.reward for s in samples], dtype=np.float32),
            prompt_ids=prompt,
            prompt_offsets=p_off,
            response_ids=response,
            response_offsets=r_off,
            logprobs=logprobs,
            versions=versions,
            allowed_ids=allowed,
            allowed_offsets=a_off,
        )

    def allowed(self, i: int) -> IntArray:
        """Sample `i`'s decoding constraint (empty: unconstrained)."""
        if self.allowed_offsets is None:
            return np.zeros(0, dtype=np.int32)
        return self.allowed_ids[self.allowed_offsets[i] : self.allowed_offsets[i + 1]]

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def nbytes(self) -> int:
        return int(
            self.prompt_ids.nbytes + self.response_ids.nbytes + self.logprobs.nbytes + self.versions.nbytes
        )

    def samples(self) -> list[Sample]:
        out = []
        for i, sid in enumerate(self.sample_ids):
            p = slice(self.prompt_offsets[i], self.prompt_offsets[i + 1])
            r = slice(self.response_offsets[i], self.response_offsets[i + 1])
            out.append(
                Sample(
                    sample_id=sid,
                    episode_id=self.episode_ids[i],
                    policy=self.policy,
                    agent=self.agents[i],
                    turn_index=int(self.turn_index[i]),
                    prompt_ids=self.prompt_ids[p],
                    response_ids=self.response_ids[r],
                    logprobs=self.logprobs[r],
                    versions=self.versions[r],
                    reward=float(self.rewards[i]),
                    allowed_ids=self.allowed(i),
                )
            )
        return out
