"""What the pods' processes wait for, and how they say so (`polyrl_runtime.waiting`).

A worker waits for the coordinator's Ray head: each try resolves the head's name again (the test
kubelet's address map changes as pods come and go; in a cluster the Service's DNS record does), so a
Service whose endpoint appears after the worker started is joined as soon as it exists. The
coordinator waits for the job's actors to start, naming the placement resources (worker pods' nodes)
still missing.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import TYPE_CHECKING

from polyrl_operator.api import RLJob
from polyrl_runtime import netmap
from polyrl_runtime.config import placement_resources
from polyrl_runtime.waiting import LOG_EVERY_S, Attempt, Wait, wait_until

if TYPE_CHECKING:
    from polyrl_runtime.coordinator.driver import Driver


def split_address(address: str) -> tuple[str, int] | None:
    """`host:port` as (host, port); None when it is not of that form."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def connect_error(address: str, timeout: float = 2.0) -> str | None:
    """Why a TCP connection to `address` fails now (DNS included); None when it succeeds."""
    parts = split_address(address)
    if parts is None:
        return f"not a host:port address: {address!r}"
    try:
        with socket.create_connection(parts, timeout=timeout):
            return None
    except OSError as e:
        return str(e) or type(e).__name__


async def head_attempt(target: str) -> Attempt[str]:
    """One try to reach the head named `target`: resolved now (the test kubelet's map changes as
    pods come and go; in a cluster the Service's DNS record does), then connected to."""
    try:
        address = netmap.resolve(target)
    except (OSError, ValueError) as e:
        return Attempt(None, f"{target}: cannot read the address map {os.environ.get(netmap.ENV)}: {e}")
    error = await asyncio.to_thread(connect_error, address)
    if error is None:
        return Attempt(address)
    shown = target if address == target else f"{target} (mapped to {address})"
    return Attempt(None, f"{shown}: {error}")


async def wait_for_head(
    target: str,
    *,
    deadline_s: float,
    poll_s: float = 2.0,
    every_s: float = LOG_EVERY_S,
    stop: asyncio.Event | None = None,
) -> str | None:
    """The head's address as reachable now; None if `stop` was set first; WaitTimeout past the deadline."""
    return await wait_until(
        lambda: head_attempt(target),
        what=f"the coordinator's Ray head at {target}",
        deadline_s=deadline_s,
        poll_s=poll_s,
        every_s=every_s,
        stop=stop,
        address=target,
    )


def missing_resources(needed: dict[str, float], present: dict[str, float]) -> dict[str, str]:
    """Placement resources short of what the job needs, as `have/need` (the worker pods not joined)."""
    return {
        name: f"{present.get(name, 0.0):g}/{units:g}"
        for name, units in sorted(needed.items())
        if present.get(name, 0.0) < units
    }


async def watch_start(driver: Driver, job: RLJob, deadline_s: float, poll_s: float = 1.0) -> None:
    """Log while the driver starts (its actors wait for the worker pods' nodes, then load models),
    naming the placement resources still missing; WaitTimeout past the deadline."""
    import ray

    needed = placement_resources(job)
    wait = Wait("the job's actors to start (worker pods joining, models loading)", deadline_s)
    try:
        while driver.state == "starting":
            missing = missing_resources(needed, ray.cluster_resources())  # type: ignore[no-untyped-call]
            detail = (
                f"worker nodes missing: {missing}" if missing else "every worker node joined; actors starting"
            )
            if wait.expired():
                raise wait.timeout(detail)
            wait.tick(detail)
            await asyncio.sleep(poll_s)
    finally:
        # also when cancelled because the run ended between two polls: the start is over either way
        if driver.state != "starting":
            wait.done()
