"""The experience buffer's types: per-policy configuration, counters and statistics, leases, drop
reasons and snapshots (the buffer itself is in buffer.py, snapshots are taken in snapshots.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from polyrl_runtime.experience.batches import SampleBatch
from polyrl_runtime.experience.columns import Segment
from polyrl_runtime.experience.types import Sample


class DropReason(StrEnum):
    STALE = "stale"  # older than max_staleness versions behind the trainer
    POLICY_FINISHED = "policy_finished"  # the policy's training is over
    JOB_CANCELLED = "job_cancelled"
    # its episode's policies were further apart than the job's maxVersionSkew (onVersionSkew drop)
    VERSION_SKEW = "version_skew"
    # arrived while the policy's trainer restarted alone (coordinator/policy_restart.py): its
    # credit does not hold the other policies' episodes back meanwhile
    POLICY_RESTARTING = "policy_restarting"
    # a frozen policy's turns (`trainer: null`): served, never trained on
    POLICY_FROZEN = "policy_frozen"
    # the workflow worker marked them (`FILTERED_KEY`): a group whose rewards were all equal (DAPO's
    # dynamic sampling, while the version's cap allows) and turns cut at their maximum new tokens
    # (overlong filtering)
    ZERO_VARIANCE = "zero_variance"
    OVERLONG = "overlong"


# Episode.metadata[FILTERED_KEY]: {drop reason value: [turn indices]}, the turns the workflow worker
# marked for the buffer to drop (`DropReason.ZERO_VARIANCE`, `DropReason.OVERLONG`).
FILTERED_KEY = "polyrl_filtered"


class UnknownTicketError(KeyError):
    """A put with a ticket that was never issued, already used, released, or voided by a restore."""


class UnknownLeaseError(KeyError):
    """An ack/nack of a lease that is not outstanding (already acked, redelivered, or voided)."""


@dataclass(frozen=True)
class PolicyConfig:
    name: str
    episodes_per_version: int  # episodes one trainer step consumes (spec.training.episodesPerStep)
    max_staleness: int = 0  # 0: sync mode
    # The version the policy's training ends at (spec.training.totalSteps), None: open-ended. Credit
    # never goes beyond the episodes its steps consume: in async mode the last steps would otherwise
    # admit maxStaleness steps' worth of episodes that no step can train on (dropped as
    # policy_finished: 112 samples per policy in the local example, a seventh of its last steps).
    final_version: int | None = None
    # Drop, on arrival, the samples of an episode whose policies still training are more than this
    # many versions apart (each policy's version: the oldest of its sampled tokens). None: no bound.
    max_version_skew: int | None = None
    # Never trained (`trainer: null`): finished from the start, it takes no credit, and its samples
    # are dropped on arrival (counted as policy_frozen).
    frozen: bool = False
    # Dynamic sampling: how many (episode, policy) pairs of equal rewards one version may drop
    # before it keeps them (maxRefills * episodesPerStep); None: they are kept.
    zero_variance_cap: int | None = None

    def __post_init__(self) -> None:
        if self.episodes_per_version < 1 or self.max_staleness < 0:
            raise ValueError(f"{self.name}: episodes_per_version >= 1 and max_staleness >= 0 required")
        if self.max_version_skew is not None and self.max_version_skew < 0:
            raise ValueError(f"{self.name}: max_version_skew >= 0 required (or None)")
        if self.zero_variance_cap is not None and self.zero_variance_cap < 0:
            raise ValueError(f"{self.name}: zero_variance_cap >= 0 required (or None)")
        if self.final_version is not None and self.final_version < 1:
            raise ValueError(f"{self.name}: final_version >= 1 required (or None)")


@dataclass(frozen=True)
class Lease:
    lease_id: int
    policy: str
    consumer: str
    batch: SampleBatch


@dataclass(frozen=True)
class PolicyStats:
    policy: str
    version: int
    buffered: int
    leased: int
    admitted: int
    credit: int
    produced: int
    consumed: int
    redelivered: int
    dropped: dict[str, int]
    staleness_mean: float
    staleness_max: int
    finished: bool
    pending: int = 0  # tickets naming the policy not yet put or released (episodes under way)


@dataclass
class PolicyState:
    """One policy's counters and queue inside the buffer (mutated under the buffer's lock)."""

    cfg: PolicyConfig
    version: int = 0
    admitted: int = 0  # (episode, policy) pairs granted and not dropped
    produced: int = 0
    consumed: int = 0
    redelivered: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in DropReason})
    staleness_sum: int = 0
    staleness_max: int = 0
    finished: bool = False
    zero_variance_dropped: int = 0  # pairs dropped for equal rewards at the current version
    # Its trainer restarts alone: it takes no credit and its arriving samples are dropped, so the
    # episodes the other policies train on keep starting; what it had buffered stays.
    restarting: bool = False
    queue: deque[Segment] = field(default_factory=deque)  # row ranges of chunks, oldest first
    buffered: int = 0  # rows in `queue`
    # Sync mode: the pairs of the earlier versions, taken when the policy reached its current
    # version: `admitted` then, less the pairs that count against the new version (samples still
    # buffered, tickets still out: BufferCore._pairs_ahead). Unused in async mode.
    base: int = 0

    def __post_init__(self) -> None:
        self.finished = self.finished or self.cfg.frozen

    def limit(self) -> int:
        if self.cfg.max_staleness == 0:
            # Sync: `episodes_per_version` on top of the earlier versions' episodes, however many
            # those were (a version may end up to a group over: failed episodes are replaced by whole
            # groups), so one version's replacements never shorten the next.
            done = self.cfg.final_version is not None and self.version >= self.cfg.final_version
            return self.base + (0 if done else self.cfg.episodes_per_version)
        versions = self.version + self.cfg.max_staleness + 1
        if self.cfg.final_version is not None:
            versions = min(versions, self.cfg.final_version)
        return versions * self.cfg.episodes_per_version

    def credit(self) -> int:
        return self.limit() - self.admitted

    def stats(self, leased: int, pending: int) -> PolicyStats:
        """The counters as `PolicyStats`; `leased`: this policy's rows out on leases, `pending`: the
        tickets naming it not yet put or released."""
        return PolicyStats(
            policy=self.cfg.name,
            version=self.version,
            buffered=self.buffered,
            leased=leased,
            admitted=self.admitted,
            credit=self.credit(),
            produced=self.produced,
            consumed=self.consumed,
            redelivered=self.redelivered,
            dropped=dict(self.dropped),
            staleness_mean=self.staleness_sum / self.consumed if self.consumed else 0.0,
            staleness_max=self.staleness_max,
            finished=self.finished,
            pending=pending,
        )


@dataclass
class LeaseState:
    """An outstanding lease: the row ranges a consumer holds until it acks or gives them back."""

    policy: str
    consumer: str
    segments: list[Segment]
    n: int  # rows in `segments`


@dataclass(frozen=True)
class BufferSnapshot:
    """Everything not yet consumed, plus the counters; leases and tickets are not kept (see restore)."""

    configs: tuple[PolicyConfig, ...]
    capacity_episodes: int
    policies: dict[str, dict[str, object]]
    samples: dict[str, list[Sample]]
    pairs: dict[tuple[str, str], tuple[int, int]]
    cancelled: bool
