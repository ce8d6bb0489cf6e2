"""Address mapping for pods that run as local processes (the e2e tier's test kubelet only).

In a cluster every pod has its own IP, so each listens on the contract's fixed ports (8000, 6379,
...) and reaches the others through Service DNS names. The test kubelet runs all pods on one host:
it gives each pod its own free ports and writes a JSON file, named by `POLYRL_NETMAP`, with

    {"pods": {"<ns>/<pod>": {"8000": 41234, ...}},               # where each pod really listens
     "endpoints": {"<svc>.<ns>.svc:6379": "127.0.0.1:41235", ...}} # what each DNS name:port reaches

Without `POLYRL_NETMAP` (every real pod, `polyrl run`) both functions return their argument
unchanged. The file is re-read on every call: the kubelet rewrites it as pods come and go.
"""

from __future__ import annotations

import json
import os
import random
import socket
from typing import Any

ENV = "POLYRL_NETMAP"


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
    me = f"{os.environ.get('POLYRL_NAMESPACE', '')}/{os.environ.get('POLYRL_POD_NAME', '')}"
    return int(netmap.get("pods", {}).get(me, {}).get(str(port), port))


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(low: int = 20000, high: int = 26999) -> int:
    """A port that is free now, picked below the kernel's ephemeral range.

    Several Ray nodes (and pods) share one host in tests and local runs: a port handed out by
    binding port 0 comes from the ephemeral range, where any process's next outgoing connection may
    take it before our listener binds it (a busy Ray cluster makes many), and a raylet that cannot
    bind its port never starts. Ports below that range (and above Ray's worker ports, 10002-19999)
    are only taken by listeners that, like us, check first. The test kubelet hands pods their
    ports from the range above ours (27000 up to the ephemeral range), so the two never meet."""
    high = min(high, _ephemeral_low() - 1)
    for _ in range(200):
        port = random.randint(low, high) if high > low else 0
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    with socket.socket() as s:  # a crowded range: fall back to any free port
        s.bind(("", 0))
        return int(s.getsockname()[1])
