"""Typed experience records: episodes of agent turns and per-policy samples (columnar batches of
samples: batches.py).

Token ids, logprobs and versions are numpy arrays rather than lists: Ray moves numpy buffers out of
band (no per-element pickling), which is what lets experience stream at close to raw transfer speed.

Loss mask: a turn's response may interleave tokens the policy sampled with context tokens (tool
results, user messages and template tokens of later turns of a conversation, see workflows/chat.py).
A context token carries the version `CONTEXT` (the smallest int32; real versions start at -1, an
engine's initial weights) and logprob 0: it has no behaviour policy. The loss mask is
`versions != CONTEXT`, so it travels with the versions column through the wire format, the
buffer and the trainer's batches without a column of its own, and a single-turn response (every
token sampled) is all ones as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, NamedTuple, TypeVar

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


# The version of a context token: not sampled, no behaviour logprob, loss mask 0.
CONTEXT = int(np.iinfo(np.int32).min)
_NO_VERSION = np.iinfo(np.int32).max


def loss_mask_of(versions: IntArray) -> npt.NDArray[np.bool_]:
    """True on the tokens the policy sampled (trained), False on context tokens."""
    mask: npt.NDArray[np.bool_] = versions != CONTEXT
    return mask


def oldest_versions(versions: IntArray, offsets: npt.NDArray[np.int64]) -> IntArray:
    """Each row's oldest sampled-token version (rows start at `offsets`, the last offset excluded):
    context tokens are ignored; a row always has at least one sampled token."""
    mins: IntArray = np.minimum.reduceat(versions, offsets)
    if len(mins) and mins.min() == CONTEXT:  # some row has context tokens: the common case skips the copy
        mins = np.minimum.reduceat(np.where(versions == CONTEXT, _NO_VERSION, versions), offsets)
    return mins


class Ticket(NamedTuple):
    """Credit for one episode from each policy named. A named tuple, not a frozen dataclass: a
    workflow batch's tickets are built three times (issued, sent, sent back), and this builds in
    0.21 us against 0.32 us."""

    ticket_id: int
    policies: frozenset[str]


@dataclass(frozen=True, eq=False)
class Turn:
    """One agent turn: the prompt it saw and the response its policy produced, token by token."""

    agent: str
    policy: str
    prompt_ids: IntArray
    response_ids: IntArray
    logprobs: FloatArray  # behaviour logprob of each response token
    versions: IntArray  # policy version that produced each response token (may change mid-turn);
    # CONTEXT for a context token of a conversation (loss mask 0, logprob 0)
    # Constrained decoding: the token ids every response token was sampled from (empty: the whole
    # vocabulary). Trainers compute logprobs under the same constraint as the behaviour policy.
    allowed_ids: IntArray = field(default_factory=_no_ids)
    # The sampling temperature the response tokens were drawn at (the call's, else its policy's
    # `rollout.sampling.temperature`): the trainer scores the turn at it, so that its logprobs and the
    # behaviour logprobs come from the same distribution. 0 is greedy (scored at 1e-5, as engines do).
    # Every engine-backed producer passes it; the default serves hand-built turns.
    temperature: float = 1.0

    def __post_init__(self) -> None:
        d = self.__dict__  # frozen: fields are set through the instance dict
        t = d["temperature"]
        if type(t) is not float:
            t = d["temperature"] = float(t)
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"turn of agent {self.agent!r}: temperature must be finite and >= 0, got {t}")
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
        context = self.versions == CONTEXT
        if context.any():
            if context.all():
                raise ValueError(f"turn of agent {self.agent!r} has no sampled token (all context)")
            if self.logprobs[context].any():
                raise ValueError(f"turn of agent {self.agent!r}: context tokens must have logprob 0")

    @property
    def loss_mask(self) -> npt.NDArray[np.bool_]:
        """True on the response tokens the policy sampled (trained), False on context tokens."""
        return loss_mask_of(self.versions)

    @cached_property
    def min_version(self) -> int:
        """The oldest policy version among the sampled tokens (set in bulk by `unpack_episodes`)."""
        return int(oldest_versions(self.versions, np.zeros(1, dtype=np.int64))[0])


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

    @cached_property
    def versions(self) -> Mapping[str, int]:
        """The episode's version vector: for each policy that took part, the oldest version among
        its sampled tokens (what staleness is measured from, and version skew)."""
        return version_vector((t.policy, t.min_version) for t in self.turns)

    def samples(self) -> list[Sample]:
        """One sample per turn; they share the episode id and carry the turn's agent reward."""
        eid, rewards, versions = self.episode_id, self.rewards, self.versions
        # Built unchecked: every field comes from this (validated) episode.
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
                "temperature": d["temperature"],
                "episode_versions": versions,
                "min_version": t.min_version,
            }
            out.append(_unchecked(Sample, sample))
        return out

    def __reduce__(self) -> Any:
        return _rebuild_episode, pack_episodes([self])


# A turn's head: (agent, policy, prompt, response and allowed lengths, temperature).
TurnHead = tuple[str, str, int, int, int, float]
# One head per episode: (episode id, its turns' heads, rewards, metadata). Builtins only: Ray's pickler
# runs a Python hook for every other object it meets.
EpisodeHead = tuple[str, tuple[TurnHead, ...], dict[str, float], dict[str, Any]]


def pack_episodes(episodes: Sequence[Episode]) -> tuple[list[EpisodeHead], IntArray]:
    """Episodes as builtin heads plus one flat int32 array, column by column for each policy: all its
    turns' prompts, then responses, versions, allowed ids and logprobs (as raw float32 bits). A turn's
    scalars (lengths, temperature) are in its head.

    One array: Ray handles each numpy buffer separately, and per-object overhead, not bytes, dominates
    episode transfer. Columns: a trainer's batch of consecutive samples is then a slice of them."""
    heads: list[EpisodeHead] = []
    by_policy: dict[str, list[Turn]] = {}
    for e in episodes:
        row: list[TurnHead] = []
        for t in e.turns:
            by_policy.setdefault(t.policy, []).append(t)
            lengths = len(t.prompt_ids), len(t.response_ids), len(t.allowed_ids)
            row.append((t.agent, t.policy, *lengths, t.temperature))
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
    """One policy's token columns from one packed batch: ragged arrays as flat values plus offsets."""

    prompt_ids: IntArray
    prompt_offsets: npt.NDArray[np.int64]
    response_ids: IntArray
    response_offsets: npt.NDArray[np.int64]
    logprobs: FloatArray
    versions: IntArray
    allowed_ids: IntArray
    allowed_offsets: npt.NDArray[np.int64]


def _columns(flat: IntArray, start: int, lengths: Sequence[tuple[int, int, int]]) -> tuple[_Rows, int]:
    """One policy's columns, starting at `start` in `flat`, for rows of these (prompt, response,
    allowed) lengths; and where the next policy's columns start."""
    offsets = np.zeros((len(lengths) + 1, 3), dtype=np.int64)
    np.cumsum(np.array(lengths, dtype=np.int64).reshape(-1, 3), axis=0, out=offsets[1:])
    po, ro, ao = np.ascontiguousarray(offsets.T)  # one cumsum for all three columns
    (prompts, responses, versions, allowed, logprobs), end = _cut(flat, start, *offsets[-1].tolist())
    rows = _Rows(
        prompt_ids=prompts,
        prompt_offsets=po,
        response_ids=responses,
        response_offsets=ro,
        logprobs=logprobs,
        versions=versions,
        allowed_ids=allowed,
        allowed_offsets=ao,
    )
    return rows, end


def _cut(
    flat: IntArray, start: int, n_prompt: int, n_resp: int, n_allowed: int
) -> tuple[tuple[IntArray, IntArray, IntArray, IntArray, FloatArray], int]:
    """One policy's columns in `flat` as `pack_episodes` writes them (prompts, responses, versions,
    allowed ids, logprobs as raw float32 bits), as views; and where they end."""
    r = start + n_prompt
    v = r + n_resp
    a = v + n_resp
    lp = a + n_allowed
    columns = (flat[start:r], flat[r:v], flat[v:a], flat[a:lp], flat[lp : lp + n_resp].view(np.float32))
    return columns, lp + n_resp


def unpack_episodes(heads: Sequence[EpisodeHead], flat: IntArray) -> list[Episode]:
    """The inverse of `pack_episodes`; every array is a view into `flat`."""
    lengths: dict[str, list[tuple[int, int, int]]] = {}
    for _, turns_of_episode, _, _ in heads:
        for _, policy, n_prompt, n_resp, n_allowed, _ in turns_of_episode:
            lengths.setdefault(policy, []).append((n_prompt, n_resp, n_allowed))
    columns: dict[str, tuple[_Rows, list[int], list[int], list[int], list[int]]] = {}
    end = 0
    for policy, lens in lengths.items():
        rows, end = _columns(flat, end, lens)
        # Every turn's oldest version in one call (the buffer checks staleness against it).
        mins = oldest_versions(rows.versions, rows.response_offsets[:-1]).tolist()
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
        for agent, policy, _, _, n_allowed, temperature in turns_of_episode:
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
                        "temperature": temperature,
                        "min_version": mins[i],
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


# Plain dicts, not MappingProxyType: samples are pickled into checkpoints. Read only by convention
# (the samples of one episode share theirs).
_NO_VECTOR: Mapping[str, int] = {}


def version_vector(pairs: Iterable[tuple[str, int]]) -> Mapping[str, int]:
    """Per policy, the oldest of its (policy, version) pairs: an episode's version vector."""
    out: dict[str, int] = {}
    for policy, version in pairs:
        old = out.get(policy)
        if old is None or version < old:
            out[policy] = version
    return out


def version_skew(vector: Mapping[str, int]) -> int:
    """How many versions apart the policies of one episode are (0 for a single policy)."""
    return max(vector.values()) - min(vector.values()) if len(vector) > 1 else 0


def _rebuild_episode(heads: list[EpisodeHead], flat: IntArray) -> Episode:
    return unpack_episodes(heads, flat)[0]


def _unchecked(cls: type[_T], fields: dict[str, Any]) -> _T:
    """An instance of a frozen dataclass without running `__init__`/`__post_init__`: for values
    rebuilt from ones that were validated already (the wire format, an episode's own turns). The
    fields come as one dict, not keywords: cheaper per object built."""
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
    # The version vector of the sample's episode (`Episode.versions`): every policy that took part,
    # this one included, with the oldest version among its sampled tokens.
    episode_versions: Mapping[str, int] = field(default_factory=lambda: _NO_VECTOR)
    temperature: float = 1.0  # its response tokens' sampling temperature (`Turn.temperature`)

    @cached_property
    def min_version(self) -> int:
        """The oldest policy version among the sampled tokens: what staleness is measured from."""
        return int(oldest_versions(self.versions, np.zeros(1, dtype=np.int64))[0])

    @property
    def loss_mask(self) -> npt.NDArray[np.bool_]:
        """True on the response tokens the policy sampled (trained), False on context tokens."""
        return loss_mask_of(self.versions)

    @property
    def nbytes(self) -> int:
        return int(
            self.prompt_ids.nbytes + self.response_ids.nbytes + self.logprobs.nbytes + self.versions.nbytes
        )
