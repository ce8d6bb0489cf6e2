"""What a group of episodes of one task turns into, per agent of a grouped estimator (grpo, dr_grpo,
rloo, reinforce_pp_baseline: algorithms/estimators.py): each member's learning signal relative to its sub-group, and which
sub-groups carry no signal at all (every reward equal: DAPO's dynamic sampling drops them).

A group is as many episodes as the largest groupSize of its policies; an agent whose policy has a
smaller one is compared within consecutive sub-groups of its own size (the last one smaller where
the sizes do not divide). `members` gives each finished episode's position in the group (episodes
that failed leave gaps), default 0..n-1."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

# GRPO's std normalisation adds this to the group's std (TRL's value): a group whose rewards
# differ by a little less than it is not blown up into +-1 signals.
GROUP_STD_EPS = 1e-4


def subgroups(
    rewards: Sequence[Mapping[str, float]], agent: str, size: int, members: Sequence[int] | None = None
) -> list[list[int]]:
    """The indices into `rewards` of each of `agent`'s sub-groups of `size` (episodes without the
    agent are in none), in order."""
    position = list(range(len(rewards))) if members is None else list(members)
    out: dict[int, list[int]] = {}
    for i, r in enumerate(rewards):
        if agent in r:
            out.setdefault(position[i] // size, []).append(i)
    return list(out.values())


def group_relative(
    rewards: Sequence[Mapping[str, float]],
    group_sizes: Mapping[str, int],
    members: Sequence[int] | None = None,
    leave_one_out: frozenset[str] = frozenset(),
    std_scaled: frozenset[str] = frozenset(),
) -> list[dict[str, float]]:
    """Per agent of a grouped estimator (`group_sizes`: agent -> its policy's groupSize): its reward
    minus its baseline over its sub-group. The baseline is the sub-group's mean reward, or for
    agents in `leave_one_out` (rloo) the mean of the sub-group's other members (0 signal for a
    member alone); other agents keep the raw reward. Agents in `std_scaled` (advantageNorm
    per-group) have their signal divided by the standard deviation of their sub-group's rewards
    plus `GROUP_STD_EPS`: a sub-group of equal rewards keeps 0."""
    out = [dict(r) for r in rewards]
    for agent, size in group_sizes.items():
        for rows in subgroups(rewards, agent, size, members):
            total, n = sum(rewards[i][agent] for i in rows), len(rows)
            mean = total / n
            scale = 1.0
            if agent in std_scaled:
                scale = math.sqrt(sum((rewards[i][agent] - mean) ** 2 for i in rows) / n) + GROUP_STD_EPS
            for i in rows:
                own = rewards[i][agent]
                if agent in leave_one_out:
                    out[i][agent] = (own - (total - own) / (n - 1) if n > 1 else 0.0) / scale
                else:
                    out[i][agent] = (own - mean) / scale
    return out


def equal_reward_agents(
    rewards: Sequence[Mapping[str, float]],
    group_sizes: Mapping[str, int],
    members: Sequence[int] | None = None,
) -> list[frozenset[str]]:
    """Per episode, its agents (of `group_sizes`) whose sub-group's rewards are all equal (a
    sub-group of one included): their group-relative signals are all 0, whatever the estimator."""
    out: list[set[str]] = [set() for _ in rewards]
    for agent, size in group_sizes.items():
        for rows in subgroups(rewards, agent, size, members):
            if len({rewards[i][agent] for i in rows}) == 1:
                for i in rows:
                    out[i].add(agent)
    return [frozenset(s) for s in out]
