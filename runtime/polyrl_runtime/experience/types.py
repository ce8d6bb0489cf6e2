"""Typed experience records: episodes of agent turns, per-policy samples, and columnar sample batches.

Token ids, logprobs and versions are numpy arrays rather than lists: Ray moves numpy buffers out of
band (no per-element pickling), which is what lets experience stream at close to raw transfer speed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float32]
_T = TypeVar("_T")


def _arr(name: str, value: Any, dtype: type[np.generic]) -> Any:
    a = np.ascontiguousarray(value, dtype=dtype)
    if a.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {a.shape}")
    return a


# A turn's array fields and their dtypes. Arrays that already match are kept as they are without a
# call into numpy: a workflow builds two or more turns per episode, and the buffer benchmark's producer
# spent a fifth of its time validating them.
_TURN_ARRAYS = (
    ("prompt_ids", np.dtype(np.int32)),
    ("response_ids", np.dtype(np.int32)),
    ("logprobs", np.dtype(np.float32)),
    ("versions", np.dtype(np.int32)),
    ("allowed_ids", np.dtype(np.int32)),
)

# The empty `allowed_ids` (unconstrained) every record without a constraint shares: read-only, so
# sharing it is safe.
_EMPTY_IDS: IntArray = np.zeros(0, dtype=np.int32)
_EMPTY_IDS.flags.writeable = False


def _no_ids() -> IntArray:
    return _EMPTY_IDS


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
    allowed_ids: IntArray = field(default_factory=_no_ids)

    def __post_init__(self) -> None:
        d = self.__dict__  # frozen: fields are set through the instance dict
        for name, dtype in _TURN_ARRAYS:
            v = d[name]
            if type(v) is not np.ndarray or v.dtype != dtype or v.ndim != 1 or not v.flags.c_contiguous:
                d[name] = _arr(name, v, dtype.type)
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

    @cached_property
    def min_version(self) -> int:
        """The oldest policy version among the response tokens (set in bulk by `unpack_episodes`)."""
        return int(self.versions.min())

    def __getstate__(self) -> dict[str, Any]:
        return _without_row(self.__dict__)


@dataclass(frozen=True, eq=False)
class Episode:
    """One multi-agent episode: its turns in order, one reward per agent, free-form metadata."""

    episode_id: str
    turns: tuple[Turn, ...]
    rewards: Mapping[str, float]
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        d = self.__dict__
        if type(self.turns) is not tuple:
            d["turns"] = tuple(self.turns)
        d["rewards"] = MappingProxyType({k: float(v) for k, v in self.rewards.items()})
        if not self.episode_id:
            raise ValueError("episode_id must be non-empty")
        for t in self.turns:
            if t.agent not in self.rewards:
                raise ValueError(f"episode {self.episode_id}: no reward for agent {t.agent!r}")

    @cached_property
    def policies(self) -> frozenset[str]:
        return frozenset(t.policy for t in self.turns)

    def samples(self) -> list[Sample]:
        """One sample per turn; they share the episode id and carry the turn's agent reward."""
        eid, rewards = self.episode_id, self.rewards
        # Built unchecked: every field comes from this (validated) episode, and the buffer makes
        # one sample per turn of every episode it takes in. A turn unpacked from the wire passes on
        # where its row sits in its policy's columns (see `_Rows`).
        out = []
        for i, t in enumerate(self.turns):
            d = t.__dict__
            sample = {
                "sample_id": f"{eid}/{i}",
                "episode_id": eid,
                "policy": d["policy"],
                "agent": d["agent"],
                "turn_index": i,
                "prompt_ids": d["prompt_ids"],
                "response_ids": d["response_ids"],
                "logprobs": d["logprobs"],
                "versions": d["versions"],
                "reward": rewards[d["agent"]],
                "allowed_ids": d["allowed_ids"],
                "min_version": t.min_version,
                "_row": d.get("_row"),
            }
            out.append(_unchecked(Sample, sample))
        return out

    def __reduce__(self) -> Any:
        return _rebuild_episode, pack_episodes([self])


# One head per episode: (episode id, per-turn (agent, policy, prompt, response, allowed lengths), rewards,
# metadata). Builtins only: Ray's pickler runs a Python hook for every other object it meets.
EpisodeHead = tuple[str, tuple[tuple[str, str, int, int, int], ...], dict[str, float], dict[str, Any]]


def pack_episodes(episodes: Sequence[Episode]) -> tuple[list[EpisodeHead], IntArray]:
    """Episodes as builtin heads plus one flat int32 array, column by column for each policy: all its
    turns' prompts, then responses, versions, allowed ids and logprobs (as raw float32 bits).

    One array: Ray handles each numpy buffer separately, and per-object overhead, not bytes, dominates
    episode transfer. Columns: a trainer's batch of consecutive samples is then a slice of them."""
    heads: list[EpisodeHead] = []
    by_policy: dict[str, list[Turn]] = {}
    for e in episodes:
        row = []
        for t in e.turns:
            by_policy.setdefault(t.policy, []).append(t)
            row.append((t.agent, t.policy, len(t.prompt_ids), len(t.response_ids), len(t.allowed_ids)))
        heads.append((e.episode_id, tuple(row), dict(e.rewards), dict(e.metadata)))
    parts: list[npt.NDArray[Any]] = []
    for turns_of_policy in by_policy.values():
        parts += [t.prompt_ids for t in turns_of_policy]
        parts += [t.response_ids for t in turns_of_policy]
        parts += [t.versions for t in turns_of_policy]
        parts += [t.allowed_ids for t in turns_of_policy if len(t.allowed_ids)]  # most are empty
        parts += [t.logprobs.view(np.int32) for t in turns_of_policy]
    return heads, np.concatenate(parts) if parts else np.zeros(0, np.int32)


@dataclass(frozen=True, eq=False)
class _Rows:
    """One policy's columns from one unpacked batch. A turn (and its sample) knows its row, so a
    batch of consecutive rows is built from slices, not by copying every sample."""

    prompt_ids: IntArray
    prompt_offsets: npt.NDArray[np.int64]
    response_ids: IntArray
    response_offsets: npt.NDArray[np.int64]
    logprobs: FloatArray
    versions: IntArray
    allowed_ids: IntArray
    allowed_offsets: npt.NDArray[np.int64]


def _columns(flat: IntArray, start: int, lengths: list[tuple[int, int, int]]) -> tuple[_Rows, int]:
    n_prompt, n_resp, n_allowed = (sum(x) for x in zip(*lengths, strict=True))
    r = start + n_prompt
    v = r + n_resp
    a = v + n_resp
    lp = a + n_allowed
    rows = _Rows(
        prompt_ids=flat[start:r],
        prompt_offsets=_offsets([x[0] for x in lengths]),
        response_ids=flat[r:v],
        response_offsets=_offsets([x[1] for x in lengths]),
        logprobs=flat[lp : lp + n_resp].view(np.float32),
        versions=flat[v:a],
        allowed_ids=flat[a:lp],
        allowed_offsets=_offsets([x[2] for x in lengths]),
    )
    return rows, lp + n_resp


def unpack_episodes(heads: Sequence[EpisodeHead], flat: IntArray) -> list[Episode]:
    """The inverse of `pack_episodes`; every array is a view into `flat`."""
    lengths: dict[str, list[tuple[int, int, int]]] = {}
    for _, turns_of_episode, _, _ in heads:
        for _, policy, n_prompt, n_resp, n_allowed in turns_of_episode:
            lengths.setdefault(policy, []).append((n_prompt, n_resp, n_allowed))
    columns: dict[str, tuple[_Rows, list[int], list[int], list[int], list[int]]] = {}
    end = 0
    for policy, lens in lengths.items():
        rows, end = _columns(flat, end, lens)
        # Every turn's oldest version in one call (the buffer checks staleness against it).
        mins = np.minimum.reduceat(rows.versions, rows.response_offsets[:-1]).tolist()
        columns[policy] = (
            rows,
            rows.prompt_offsets.tolist(),
            rows.response_offsets.tolist(),
            rows.allowed_offsets.tolist(),
            mins,
        )
    # The layout was written by `pack_episodes` from validated turns, so the turns are rebuilt
    # unchecked: re-validating five arrays per turn was most of the buffer's deserialisation time.
    taken = dict.fromkeys(lengths, 0)
    out = []
    for episode_id, turns_of_episode, rewards, metadata in heads:
        turns = []
        for agent, policy, _, _, n_allowed in turns_of_episode:
            rows, po, ro, ao, mins = columns[policy]
            i = taken[policy]
            taken[policy] = i + 1
            r0, r1 = ro[i], ro[i + 1]
            turns.append(
                _unchecked(
                    Turn,
                    {
                        "agent": agent,
                        "policy": policy,
                        "prompt_ids": rows.prompt_ids[po[i] : po[i + 1]],
                        "response_ids": rows.response_ids[r0:r1],
                        "logprobs": rows.logprobs[r0:r1],
                        "versions": rows.versions[r0:r1],
                        # Most turns are unconstrained: they share the one empty array instead of a view.
                        "allowed_ids": rows.allowed_ids[ao[i] : ao[i + 1]] if n_allowed else _EMPTY_IDS,
                        "min_version": mins[i],
                        "_row": (rows, i),
                    },
                )
            )
        episode = {
            "episode_id": episode_id,
            "turns": tuple(turns),
            "rewards": MappingProxyType(rewards),
            "metadata": metadata,
            "policies": frozenset(t[1] for t in turns_of_episode),  # the cached property's value
        }
        out.append(_unchecked(Episode, episode))
    return out


def _rebuild_episode(heads: list[EpisodeHead], flat: IntArray) -> Episode:
    return unpack_episodes(heads, flat)[0]


def _without_row(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != "_row"}


def _unchecked(cls: type[_T], fields: dict[str, Any]) -> _T:
    """An instance of a frozen dataclass without running `__init__`/`__post_init__`: for values
    rebuilt from ones that were validated already (the wire format, an episode's own turns). The
    fields come as one dict, not keywords: the buffer builds a turn and a sample for every turn it
    takes in, and an episode for every episode."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


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
    allowed_ids: IntArray = field(default_factory=_no_ids)  # empty: any

    @cached_property
    def min_version(self) -> int:
        """The oldest policy version among the response tokens: what staleness is measured from.

        Cached: the buffer checks it on put, on every version advance and on ack."""
        return int(self.versions.min())

    def __getstate__(self) -> dict[str, Any]:
        # A snapshot keeps this sample's own arrays, not the whole batch its row was unpacked from.
        return _without_row(self.__dict__)

    @property
    def nbytes(self) -> int:
        return int(
            self.prompt_ids.nbytes + self.response_ids.nbytes + self.logprobs.nbytes + self.versions.nbytes
        )


def _consecutive_rows(samples: Sequence[Sample]) -> tuple[_Rows, int, int] | None:
    """(columns, first row, end row) when the samples are consecutive rows of one unpacked batch."""
    if not samples:
        return None
    first = samples[0].__dict__.get("_row")
    if first is None:
        return None
    rows, start = first
    for k, s in enumerate(samples):
        row = s.__dict__.get("_row")
        if row is None or row[0] is not rows or row[1] != start + k:
            return None
    return rows, start, start + len(samples)


def _per_sample(samples: Sequence[Sample]) -> dict[str, Any]:
    """The one-value-per-sample columns of a `SampleBatch` (the ragged token columns vary by path)."""
    return {
        "sample_ids": tuple(s.sample_id for s in samples),
        "episode_ids": tuple(s.episode_id for s in samples),
        "agents": tuple(s.agent for s in samples),
        "turn_index": np.array([s.turn_index for s in samples], dtype=np.int32),
        "rewards": np.array([s.reward for s in samples], dtype=np.float32),
    }


def _offsets(lengths: list[int]) -> npt.NDArray[np.int64]:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    offsets[1:] = lengths  # then a cumsum of an array: numpy wraps a list argument in Python first
    np.cumsum(offsets, out=offsets)
    return offsets


def _flat(parts: list[npt.NDArray[Any]], dtype: type[np.generic]) -> Any:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


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
    allowed_ids: IntArray = field(default_factory=_no_ids)
    allowed_offsets: npt.NDArray[np.int64] | None = None

    @classmethod
    def from_samples(cls, policy: str, samples: Sequence[Sample]) -> SampleBatch:
        rows = _consecutive_rows(samples)
        if rows is not None:
            return cls._from_rows(policy, samples, *rows)
        responses = [s.response_ids for s in samples]
        # Logprobs and versions share the response offsets; the allowed-ids column is only built
        # when some sample is constrained (the common case is none: one offsets array of zeros).
        allowed = [s.allowed_ids for s in samples]
        a_len = [len(a) for a in allowed]
        return cls(
            policy=policy,
            **_per_sample(samples),
            prompt_ids=_flat([s.prompt_ids for s in samples], np.int32),
            prompt_offsets=_offsets([len(s.prompt_ids) for s in samples]),
            response_ids=_flat(responses, np.int32),
            response_offsets=_offsets([len(r) for r in responses]),
            logprobs=_flat([s.logprobs for s in samples], np.float32),
            versions=_flat([s.versions for s in samples], np.int32),
            allowed_ids=_flat(allowed, np.int32) if any(a_len) else _EMPTY_IDS,
            allowed_offsets=_offsets(a_len),
        )

    @classmethod
    def _from_rows(cls, policy: str, samples: Sequence[Sample], rows: _Rows, i: int, j: int) -> SampleBatch:
        """Rows i..j-1 of one unpacked batch's columns: slices (views), not a copy of every sample."""
        po, ro, ao = rows.prompt_offsets, rows.response_offsets, rows.allowed_offsets
        constrained = ao[j] > ao[i]
        return cls(
            policy=policy,
            **_per_sample(samples),
            prompt_ids=rows.prompt_ids[po[i] : po[j]],
            prompt_offsets=po[i : j + 1] - po[i],
            response_ids=rows.response_ids[ro[i] : ro[j]],
            response_offsets=ro[i : j + 1] - ro[i],
            logprobs=rows.logprobs[ro[i] : ro[j]],
            versions=rows.versions[ro[i] : ro[j]],
            allowed_ids=rows.allowed_ids[ao[i] : ao[j]] if constrained else _EMPTY_IDS,
            allowed_offsets=ao[i : j + 1] - ao[i],
        )

    def allowed(self, i: int) -> IntArray:
        """Sample `i`'s decoding constraint (empty: unconstrained)."""
        if self.allowed_offsets is None:
            return _EMPTY_IDS
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
