"""The buffer's storage: each put's rows kept in the columns they arrived in.

A put (episodes packed as `pack_episodes` lays them out: builtin heads plus one flat int32 array)
becomes one `Chunk` per policy: that policy's token columns (views of the put's one array) and small
per-row arrays (reward, sampling temperature, oldest version, which episode and which (episode, policy)
pair a row is of).
The buffer queues and leases row ranges of chunks and settles its accounts per range with numpy.
Building a Turn, an Episode and a Sample object per row, and settling each sample in Python, was most
of the buffer actor's CPU (docs/performance.md, experience streaming).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from polyrl_runtime.experience.batches import SampleBatch, _offsets
from polyrl_runtime.experience.types import (
    _EMPTY_IDS,
    Episode,
    EpisodeHead,
    IntArray,
    Sample,
    Ticket,
    TurnHead,
    _columns,
    _Rows,
    oldest_versions,
    pack_episodes,
    unpack_episodes,
    version_vector,
)

Counts = npt.NDArray[np.int64]
Index = npt.NDArray[np.intp]


class PackedEpisodes(Sequence[tuple[Ticket, Episode]]):
    """Finished episodes with their tickets, in wire form: what a put becomes after crossing Ray.

    The buffer takes its columns as they are. Anyone else may still read it as the list of
    (ticket, episode) pairs it was sent as: the episodes are unpacked on first use."""

    def __init__(
        self, ticket_ids: list[int], policies: list[frozenset[str]], heads: list[EpisodeHead], flat: IntArray
    ) -> None:
        if not len(ticket_ids) == len(policies) == len(heads):
            raise ValueError(f"{len(ticket_ids)} tickets, {len(policies)} policy sets, {len(heads)} episodes")
        self.ticket_ids, self.policies, self.heads, self.flat = ticket_ids, policies, heads, flat

    @classmethod
    def pack(cls, items: Sequence[tuple[Ticket, Episode]]) -> PackedEpisodes:
        if isinstance(items, PackedEpisodes):
            return items
        heads, flat = pack_episodes([e for _, e in items])
        return cls([t.ticket_id for t, _ in items], [t.policies for t, _ in items], heads, flat)

    @cached_property
    def _items(self) -> list[tuple[Ticket, Episode]]:
        tickets = (Ticket(i, p) for i, p in zip(self.ticket_ids, self.policies, strict=True))
        return list(zip(tickets, unpack_episodes(self.heads, self.flat), strict=True))

    def __len__(self) -> int:
        return len(self.heads)

    @overload
    def __getitem__(self, i: int) -> tuple[Ticket, Episode]: ...
    @overload
    def __getitem__(self, i: slice) -> list[tuple[Ticket, Episode]]: ...
    def __getitem__(self, i: int | slice) -> tuple[Ticket, Episode] | list[tuple[Ticket, Episode]]:
        return self._items[i]

    def __iter__(self) -> Iterator[tuple[Ticket, Episode]]:
        return iter(self._items)

    def __reduce__(self) -> Any:
        return PackedEpisodes, (self.ticket_ids, self.policies, self.heads, self.flat)


@dataclass(eq=False)
class Chunk:
    """One policy's rows from one put (or a restore). Token columns and per-row values are read only;
    the pair counts change as rows settle."""

    policy: str
    rows: _Rows
    sample_ids: list[str]
    episode_ids: list[str]
    agents: list[str]
    turn_index: npt.NDArray[np.int32]
    rewards: npt.NDArray[np.float32]
    temperatures: npt.NDArray[np.float64]  # each row's sampling temperature (`Turn.temperature`)
    min_version: IntArray  # each row's oldest token version: what staleness is measured from
    oldest: int  # min(min_version): a version step skips the row compare when even this is fresh
    row_pair: Index  # row -> its (episode, policy) pair in this chunk
    pair_live: Counts  # per pair: rows not yet consumed or dropped
    pair_consumed: Counts
    pair_episode: list[str]
    row_episode: Index  # row -> its episode in `episode_live`
    # Per episode of the put (shared by its chunks, changed in place): samples not yet consumed or
    # dropped, across all its policies.
    episode_live: Counts
    # Per episode of the put (shared by its chunks): its version vector (`Episode.versions`).
    episode_versions: list[Mapping[str, int]]

    def __len__(self) -> int:
        return len(self.sample_ids)


Segment = tuple[Chunk, int, int]  # rows i..j-1 of a chunk


def split(packed: PackedEpisodes) -> tuple[dict[str, Chunk], list[frozenset[str]], Counts]:
    """A put as one chunk per policy, each episode's policies, and the put's episode counts (zero:
    the buffer counts the rows it keeps)."""
    heads = packed.heads
    # (episode, turn index, turn head) per row, per policy in order of first appearance: the order
    # `pack_episodes` wrote the columns in.
    by_policy: dict[str, list[tuple[int, int, TurnHead]]] = {}
    for e, head in enumerate(heads):
        for k, turn in enumerate(head[1]):
            rows = by_policy.get(turn[1])
            if rows is None:
                rows = by_policy[turn[1]] = []
            rows.append((e, k, turn))
    episodes = np.zeros(len(heads), dtype=np.int64)
    vectors: list[Mapping[str, int]] = []
    chunks: dict[str, Chunk] = {}
    end = 0
    for policy, rows in by_policy.items():
        columns, end = _columns(packed.flat, end, [turn[2:5] for _, _, turn in rows])
        eids = [heads[e][0] for e, _, _ in rows]
        chunks[policy] = _chunk(
            policy,
            columns,
            sample_ids=[f"{heads[e][0]}/{k}" for e, k, _ in rows],
            episode_ids=eids,
            agents=[turn[0] for _, _, turn in rows],
            turn_index=[k for _, k, _ in rows],
            rewards=[heads[e][2][turn[0]] for e, _, turn in rows],
            temperatures=[turn[5] for _, _, turn in rows],
            row_episode=[e for e, _, _ in rows],
            episodes=episodes,
            vectors=vectors,
        )
    # Filled in place once every chunk's oldest versions are known (the chunks share the list).
    pairs: list[list[tuple[str, int]]] = [[] for _ in heads]
    for policy, c in chunks.items():
        for e, v in zip(c.row_episode.tolist(), c.min_version.tolist(), strict=True):
            pairs[e].append((policy, v))
    vectors += [version_vector(p) for p in pairs]
    return chunks, [frozenset(t[1] for t in head[1]) for head in heads], episodes


def _chunk(
    policy: str,
    rows: _Rows,
    *,
    sample_ids: list[str],
    episode_ids: list[str],
    agents: list[str],
    turn_index: list[int],
    rewards: list[float],
    temperatures: list[float],
    row_episode: list[int],
    episodes: Counts,
    vectors: list[Mapping[str, int]],
) -> Chunk:
    mins = oldest_versions(rows.versions, rows.response_offsets[:-1])  # context tokens (-1) ignored
    # A pair is an episode's rows of this policy; mostly one row each (one turn per agent).
    if len(set(row_episode)) == len(row_episode):
        row_pair = np.arange(len(row_episode), dtype=np.intp)
        pair_episode = episode_ids
    else:
        index: dict[str, int] = {}
        row_pair = np.array([index.setdefault(eid, len(index)) for eid in episode_ids], dtype=np.intp)
        pair_episode = list(index)
    return Chunk(
        policy=policy,
        rows=rows,
        sample_ids=sample_ids,
        episode_ids=episode_ids,
        agents=agents,
        turn_index=np.array(turn_index, dtype=np.int32),
        rewards=np.array(rewards, dtype=np.float32),
        temperatures=np.array(temperatures, dtype=np.float64),
        min_version=mins,
        oldest=int(mins.min()),
        row_pair=row_pair,
        pair_live=np.bincount(row_pair, minlength=len(pair_episode)).astype(np.int64),
        pair_consumed=np.zeros(len(pair_episode), dtype=np.int64),
        pair_episode=pair_episode,
        row_episode=np.array(row_episode, dtype=np.intp),
        episode_live=episodes,
        episode_versions=vectors,
    )


def settle(c: Chunk, rows: slice | Index, *, consumed: bool) -> tuple[int, int]:
    """Rows became final (consumed, or dropped). Returns (pairs closed with nothing consumed: their
    credit comes back, episodes no longer resident)."""
    pairs = c.row_pair[rows]
    if not len(pairs):
        return 0, 0
    np.subtract.at(c.pair_live, pairs, 1)
    if consumed:
        np.add.at(c.pair_consumed, pairs, 1)
    touched = np.unique(pairs)
    closed = touched[c.pair_live[touched] == 0]
    credit_back = int(np.count_nonzero(c.pair_consumed[closed] == 0)) if len(closed) else 0
    eps = c.row_episode[rows]
    live = c.episode_live
    np.subtract.at(live, eps, 1)
    return credit_back, int(np.count_nonzero(live[np.unique(eps)] == 0))


def runs(mask: npt.NDArray[np.bool_]) -> list[tuple[int, int]]:
    """The (start, end) of each run of True in `mask`."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    bounds = edges.tolist()
    return list(zip(bounds[::2], bounds[1::2], strict=True))


def segment_batch(c: Chunk, i: int, j: int) -> SampleBatch:
    """Rows i..j-1 as a batch: slices (views) of the chunk's columns, no per-sample copy."""
    r = c.rows
    po, ro, ao = r.prompt_offsets, r.response_offsets, r.allowed_offsets
    vectors, eids = c.episode_versions, c.episode_ids
    return SampleBatch(
        policy=c.policy,
        sample_ids=tuple(c.sample_ids[i:j]),
        episode_ids=tuple(c.episode_ids[i:j]),
        agents=tuple(c.agents[i:j]),
        turn_index=c.turn_index[i:j],
        rewards=c.rewards[i:j],
        temperatures=c.temperatures[i:j],
        prompt_ids=r.prompt_ids[po[i] : po[j]],
        prompt_offsets=po[i : j + 1] - po[i],
        response_ids=r.response_ids[ro[i] : ro[j]],
        response_offsets=ro[i : j + 1] - ro[i],
        logprobs=r.logprobs[ro[i] : ro[j]],
        versions=r.versions[ro[i] : ro[j]],
        allowed_ids=r.allowed_ids[ao[i] : ao[j]] if ao[j] > ao[i] else _EMPTY_IDS,
        allowed_offsets=ao[i : j + 1] - ao[i],
        episode_versions={eids[k]: vectors[e] for k, e in enumerate(c.row_episode[i:j].tolist(), i)},
    )


def lease_batch(policy: str, segments: Sequence[Segment]) -> SampleBatch:
    """The batch a lease of these row ranges hands out (one range: views; several: one copy)."""
    parts = [segment_batch(c, i, j) for c, i, j in segments]
    if len(parts) == 1:
        return parts[0]

    def cat(name: str) -> Any:
        return np.concatenate([getattr(b, name) for b in parts])

    def offsets(name: str) -> npt.NDArray[np.int64]:
        out, base = [np.zeros(1, dtype=np.int64)], 0
        for b in parts:
            o = getattr(b, name)
            out.append(o[1:] + base)
            base += int(o[-1])
        return np.concatenate(out)

    return SampleBatch(
        policy=policy,
        sample_ids=tuple(s for b in parts for s in b.sample_ids),
        episode_ids=tuple(s for b in parts for s in b.episode_ids),
        agents=tuple(s for b in parts for s in b.agents),
        turn_index=cat("turn_index"),
        rewards=cat("rewards"),
        temperatures=cat("temperatures"),
        prompt_ids=cat("prompt_ids"),
        prompt_offsets=offsets("prompt_offsets"),
        response_ids=cat("response_ids"),
        response_offsets=offsets("response_offsets"),
        logprobs=cat("logprobs"),
        versions=cat("versions"),
        allowed_ids=cat("allowed_ids"),
        allowed_offsets=offsets("allowed_offsets"),
        episode_versions={e: v for b in parts for e, v in b.episode_versions.items()},
    )


def lags(c: Chunk, i: int, j: int, version: int) -> tuple[int, int]:
    """(sum, max) of how many versions rows i..j-1 are behind `version` (0 for rows not behind)."""
    behind = np.maximum(version - c.min_version[i:j], 0)
    return int(behind.sum()), int(behind.max())


def samples(segments: Sequence[Segment]) -> list[Sample]:
    """The rows as samples (for a snapshot: each keeps copies of only its own tokens when pickled)."""
    out: list[Sample] = []
    for c, i, j in segments:
        out += segment_batch(c, i, j).samples()
    return out


def restored(
    by_policy: dict[str, list[Sample]], consumed: dict[tuple[str, str], int]
) -> tuple[dict[str, Chunk], Counts]:
    """Chunks holding a snapshot's samples, in order, with each pair's consumed count; one episode
    count covers them all."""
    episode_index: dict[str, int] = {}
    for ss in by_policy.values():
        for s in ss:
            episode_index.setdefault(s.episode_id, len(episode_index))
    episodes = np.zeros(len(episode_index), dtype=np.int64)
    vectors: list[Mapping[str, int]] = [{} for _ in episode_index]
    for ss in by_policy.values():
        for s in ss:
            vectors[episode_index[s.episode_id]] = s.episode_versions
    chunks: dict[str, Chunk] = {}
    for policy, ss in by_policy.items():
        if not ss:
            continue
        batch = SampleBatch.from_samples(policy, ss)
        rows = _Rows(
            prompt_ids=batch.prompt_ids,
            prompt_offsets=batch.prompt_offsets,
            response_ids=batch.response_ids,
            response_offsets=batch.response_offsets,
            logprobs=batch.logprobs,
            versions=batch.versions,
            allowed_ids=batch.allowed_ids,
            allowed_offsets=(
                batch.allowed_offsets if batch.allowed_offsets is not None else _offsets([0] * len(ss))
            ),
        )
        c = chunks[policy] = _chunk(
            policy,
            rows,
            sample_ids=list(batch.sample_ids),
            episode_ids=list(batch.episode_ids),
            agents=list(batch.agents),
            turn_index=batch.turn_index.tolist(),
            rewards=batch.rewards.tolist(),
            temperatures=batch.temperatures.tolist(),
            row_episode=[episode_index[s.episode_id] for s in ss],
            episodes=episodes,
            vectors=vectors,
        )
        c.pair_consumed[:] = [consumed.get((eid, policy), 0) for eid in c.pair_episode]
        np.add.at(episodes, c.row_episode, 1)
    return chunks, episodes
