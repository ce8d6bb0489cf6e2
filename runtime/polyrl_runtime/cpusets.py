"""Local mode's CPU sets per role: rollout engines, workflow workers and trainers on their own cores.

In pods every role has its own CPUs or GPUs (the operator requests them per role), so a `sync` job
leaves the trainers' devices idle while the rollouts generate, and the other way round; `async` mode
reclaims that idle time. In local mode every actor shares every core by default, which hides that
difference. `polyrl run --cpus rollout=0 --cpus workflow=0 --cpus trainer=1` gives each role its own
cores on one machine, as AReaL's `allocation_mode` splits devices between inference and training.

A device pool shares its pods' cores between the roles placed on it, so its cores are given once,
`--cpus pool:NAME=CPUS`, and pin every actor of those roles (`cpu_set_key`). `ROLE=CPUS` pins the
actors of that role that run on pods of their own; giving it when every one of them runs on a pool
is an error (`check_pools`), as is a pool the job does not define. Sets may overlap (two roles on
one core is how a small machine is shared).

A process is pinned as a whole: Linux affinity belongs to each thread, and threads started later
inherit their creator's, so `pin_from_env` pins every thread the actor process has when it starts.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping, Sequence

import structlog

log = structlog.get_logger(__name__)

ROLES = ("rollout", "workflow", "trainer")
POOL_PREFIX = "pool:"  # `--cpus pool:NAME=CPUS`: the key of a pool's set
ENV = "POLYRL_CPU_SET"  # set per actor by the fleet, read by the actor's __init__


class CpuSetError(ValueError):
    """A `--cpus ROLE=LIST` item is malformed, names a CPU this process cannot use, or does not fit
    the job's pools."""


def cpu_set_key(role: str, pool: str | None) -> str:
    """The `--cpus` key whose set pins an actor of `role`: its pool's when it runs on one."""
    return f"{POOL_PREFIX}{pool}" if pool else role


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
    """`["rollout=0", "trainer=1", "pool:shared=2-3"]` -> {role or `pool:NAME`: CPUs}; each error
    names the item and what is wrong. Whether a pool exists is the job's to say (`check_pools`)."""
    sets: dict[str, frozenset[int]] = {}
    for item in items:
        role, sep, text = item.partition("=")
        role = role.strip()
        if not sep:
            raise CpuSetError(f"--cpus {item}: expected ROLE=CPUS, e.g. trainer=1 or rollout=0-3")
        if role not in ROLES and not (role.startswith(POOL_PREFIX) and role[len(POOL_PREFIX) :]):
            raise CpuSetError(
                f"--cpus {item}: unknown role {role!r} (roles: {', '.join(ROLES)}; "
                f"{POOL_PREFIX}NAME for the roles on device pool NAME)"
            )
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


def check_pools(
    cpu_sets: Mapping[str, frozenset[int]],
    pools: Collection[str],
    placed: Sequence[tuple[str, str, str | None]],
) -> None:
    """That the sets fit the job: `pools` are its pool names, `placed` has (policy, role, pool or
    None) for every policy's rollout and trainer. A `pool:NAME` must be one of the pools; `ROLE=CPUS`
    must pin at least one actor, i.e. some policy runs that role on pods of its own (a pooled role's
    actors take their pool's set). CpuSetError names the `--cpus` item and the pool."""
    for key, cpus in cpu_sets.items():
        item = f"--cpus {key}={format_cpus(cpus)}"
        if key.startswith(POOL_PREFIX):
            name = key[len(POOL_PREFIX) :]
            if name not in pools:
                known = ", ".join(sorted(pools)) if pools else "it defines none"
                raise CpuSetError(f"{item}: the job has no pool {name!r} (spec.pools: {known})")
            continue
        of_role = [(policy, pool) for policy, role, pool in placed if role == key]
        if of_role and all(pool for _, pool in of_role):
            where = ", ".join(f"policy {policy!r} on pool {pool!r}" for policy, pool in of_role)
            pools_used = sorted({pool for _, pool in of_role if pool})
            hint = " ".join(f"--cpus {POOL_PREFIX}{pool}=CPUS" for pool in pools_used)
            raise CpuSetError(
                f"{item}: every {key} runs on a device pool ({where}), whose cores the roles on it "
                f"share: pin the pool instead, {hint}"
            )


def role_env(cpu_sets: Mapping[str, frozenset[int]], key: str) -> dict[str, str]:
    """The env var that pins an actor whose set is `key` (`cpu_set_key`), or nothing when unpinned."""
    cpus = cpu_sets.get(key)
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
