"""Playing Kueue in tests: the status a ClusterQueue with free quota writes when it admits a Workload."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def admission_status(
    cluster_queue: str, podsets: Iterable[tuple[str, int]], flavors: dict[str, str]
) -> dict[str, Any]:
    """`.status` of a Workload admitted to ``cluster_queue``: each (podset, count) gets ``flavors``
    (resource -> ResourceFlavor), and the QuotaReserved and Admitted conditions are true."""
    now = "2026-01-01T00:00:00Z"
    return {
        "admission": {
            "clusterQueue": cluster_queue,
            "podSetAssignments": [{"name": n, "count": c, "flavors": dict(flavors)} for n, c in podsets],
        },
        "conditions": [
            {"type": t, "status": "True", "reason": t, "message": "ok", "lastTransitionTime": now}
            for t in ("QuotaReserved", "Admitted")
        ],
    }
