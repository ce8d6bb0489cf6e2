"""Local mode's CPU sets per role: rollout engines, workflow workers and trainers on their own cores.

In pods every role has its own CPUs or GPUs (the operator requests them per role), so a `sync` job
leaves the trainers' devices idle while the rollouts generate, and the other way round; `async` mode
reclaims that idle time. In local mode every actor shares every core by default, which hides that
difference. `polyrl run --cpus rollout=0 --cpus workflow=0 --cpus trainer=1` gives each role its own
cores on one machine, as AReaL's `allocation_mode` splits devices between inference and training.

A process is pinned as a whole: Linux affinity belongs to each thread, and threads started later
inherit their creator's, so `pin_from_env` pins every thread the actor process has when it starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import structlog

log = structlog.get_logger(__name__)

ROLES = ("rollout", "workflow", "trainer")
ENV = "POLYRL_CPU_SET"  # set per actor by the fleet, read by the actor's __init__


class CpuSetError(ValueError):
    """A `--cpus ROLE=LIST` item is malformed or names a CPU this process cannot use."""


def format_cpus(cpus: Iterable[int]) -> str:
    """`{0, 1, 2, 5}` -> `0-2,5` (the kernel's cpu-list format)."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def parse_cpus(text: str) -> frozenset[int]:
    """A kernel cpu-list (`0`, `0-3`, `0,2-3`) as a set; ValueError says what is wrong with it."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{part.strip()!r} is not a CPU number or range (e.g. 0, 2-3)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"range {part.strip()!r} ends before it starts")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def _available() -> frozenset[int]:
    if not hasattr(os, "sched_getaffinity"):
        raise CpuSetError("--cpus needs Linux: this platform cannot pin processes to CPUs")
    return frozenset(os.sched_getaffinity(0))


def parse_cpu_sets(
    items: Sequence[str], available: frozenset[int] | None = None
) -> dict[str, frozenset[int]]:
    """`["rollout=0", "trainer=1"]` -> {role: CPUs}; each error names the item and what is wrong."""
    sets: dict[str, frozenset[int]] = {}
    for item in items:
        role, sep, text = item.partition("=")
        role = role.strip()
        if not sep:
            raise CpuSetError(f"--cpus {item}: expected ROLE=CPUS, e.g. trainer=1 or rollout=0-3")
        if role not in ROLES:
            raise CpuSetError(f"--cpus {item}: unknown role {role!r} (roles: {', '.join(ROLES)})")
        if role in sets:
            raise CpuSetError(f"--cpus {item}: role {role!r} is given twice")
        try:
            cpus = parse_cpus(text)
        except ValueError as e:
            raise CpuSetError(f"--cpus {item}: {e}") from e
        avail = available if available is not None else _available()
        missing = cpus - avail
        if missing:
            raise CpuSetError(
                f"--cpus {item}: CPU {format_cpus(missing)} is not available to this process "
                f"(available: {format_cpus(avail)})"
            )
        sets[role] = cpus
    return sets


def role_env(cpu_sets: Mapping[str, frozenset[int]], role: str) -> dict[str, str]:
    """The env var that pins an actor of `role`, or nothing when the role is not pinned."""
    cpus = cpu_sets.get(role)
    return {ENV: format_cpus(cpus)} if cpus else {}


def pin_from_env() -> frozenset[int] | None:
    """Pin every thread of this process to the CPUs in `POLYRL_CPU_SET`, if set; returns them."""
    text = os.environ.get(ENV)
    if not text:
        return None
    try:
        cpus = parse_cpus(text)
    except ValueError as e:
        raise CpuSetError(f"{ENV}={text!r}: {e}") from e
    # Twice: a thread started while the first pass ran inherited the old mask from an unpinned creator.
    for _ in range(2):
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except ProcessLookupError:  # that thread has exited since the listing
                continue
    log.info("cpus.pinned", pid=os.getpid(), cpus=format_cpus(cpus))
    return cpus
