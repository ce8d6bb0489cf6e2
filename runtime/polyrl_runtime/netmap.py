"""Address mapping for pods that run as local processes (the e2e tier's test kubelet only).

In a cluster every pod has its own IP, so each listens on the contract's fixed ports (8000, 6379,
...) and reaches the others through Service DNS names. The test kubelet runs all pods on one host:
it gives each pod its own free ports and writes a JSON file, named by `POLYRL_NETMAP`, with

    {"pods": {"<ns>/<pod>": {"8000": 41234, ...}},               # where each pod really listens
     "endpoints": {"<svc>.<ns>.svc:6379": "127.0.0.1:41235", ...}} # what each DNS name:port reaches

Without `POLYRL_NETMAP` (every real pod, `polyrl run`) both functions return their argument
unchanged. The file is re-read on every call: the kubelet rewrites it as pods come and go.

`free_port` picks the ports a pod's Ray node and a trainer's rendezvous listen on; on a shared host it
reserves each one host-wide so that processes picking at the same moment never get the same port.
The registry's lock is taken through `waiting.locked`: a process that has to wait for it says so.

`resolve` is cheap and is meant to be called on every connection attempt: the map changes as pods
come and go, and an address resolved once, before its Service had an endpoint, would stay wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyrl_operator import pod_contract as contract
from polyrl_runtime.waiting import locked

ENV = contract.ENV_NETMAP


def _load() -> dict[str, Any] | None:
    path = os.environ.get(ENV)
    if not path:
        return None
    with open(path) as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def resolve(address: str) -> str:
    """`host:port` as this pod reaches it."""
    netmap = _load()
    return address if netmap is None else str(netmap.get("endpoints", {}).get(address, address))


def listen_port(port: int) -> int:
    """The port this pod really listens on for the contract's `port`."""
    netmap = _load()
    if netmap is None:
        return port
    me = f"{os.environ.get(contract.ENV_NAMESPACE, '')}/{os.environ.get(contract.ENV_POD_NAME, '')}"
    return int(netmap.get("pods", {}).get(me, {}).get(str(port), port))


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


REGISTRY_LOCK_S = 120.0
"""A holder keeps the registry's lock for milliseconds; a wait this long means a stuck holder."""

RESERVE_S = 300.0
"""How long a port `free_port` handed out stays reserved for its taker (long enough for a `ray start`
to bind it, even on a loaded machine); after that, a port still in use is skipped for being bound."""


def _registry() -> Path:
    """Host-wide, not per TMPDIR: the test kubelet gives each pod its own TMPDIR (its /tmp emptyDir)."""
    path = os.environ.get("POLYRL_PORT_REGISTRY")
    if path:
        return Path(path)
    root = "/tmp" if os.access("/tmp", os.W_OK) else tempfile.gettempdir()
    return Path(root) / f"polyrl-ports-{os.getuid()}.json"


@contextlib.contextmanager
def _reservations() -> Iterator[dict[int, float]]:
    """This host's live port reservations (port -> expiry), read and written back under an flock
    (the kernel releases it if the holder dies)."""
    path = _registry()
    with open(path, "a+") as f, locked(f, path, what="port registry", deadline_s=REGISTRY_LOCK_S):
        f.seek(0)
        try:
            held = {int(k): float(v) for k, v in json.loads(f.read() or "{}").items()}
        except (ValueError, AttributeError):  # a torn or foreign file: start over
            held = {}
        now = time.time()
        held = {port: until for port, until in held.items() if until > now}
        yield held
        f.seek(0)
        f.truncate()
        f.write(json.dumps(held))
        f.flush()


def _bindable(port: int) -> int | None:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return None
        return int(s.getsockname()[1])


def free_port(low: int = 20000, high: int = 26999, *, hold_s: float = RESERVE_S) -> int:
    """A port that is free now and that no other caller on this host was handed in the last `hold_s`
    seconds, picked below the kernel's ephemeral range.

    Several Ray nodes (and pods) share one host in tests and local runs. A port handed out by binding
    port 0 comes from the ephemeral range, where any process's next outgoing connection may take it
    before our listener binds it (a busy Ray cluster makes many), and a raylet that cannot bind its
    port never starts. Ports below that range (and above Ray's worker ports, 10002-19999) are only
    taken by listeners that, like us, check first. The test kubelet hands pods their ports from the
    range above ours (27000 up to the ephemeral range), so the two never meet.

    "Free now" is not enough: six pods starting at once each pick six ports for their Ray node
    before any of them binds, and two picked the same one (a raylet's node-manager port was another
    node's runtime-env-agent port; that node's raylet died and the job restarted, in CI). So every
    port handed out is recorded in a host-wide registry and not handed out again until it expires."""
    high = min(high, _ephemeral_low() - 1)
    with _reservations() as held:
        for _ in range(200):
            port = random.randint(low, high) if high > low else 0
            if port in held:
                continue
            bound = _bindable(port)
            if bound is not None:
                held[bound] = time.time() + hold_s
                return bound
        for _ in range(200):  # a crowded range: fall back to any free port the registry does not hold
            bound = _bindable(0)
            if bound is not None and bound not in held:
                held[bound] = time.time() + hold_s
                return bound
    raise OSError(f"no free port in {low}-{high} or the ephemeral range that {_registry()} does not hold")
