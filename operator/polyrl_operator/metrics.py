"""Prometheus metrics of the operator, in their own registry (one per operator instance, so tests can
run several operators in one process without clashing on the global registry)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from polyrl_operator.api import PHASES
from polyrl_operator.roles import ROLES


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reconcile_seconds = Histogram(
            "polyrl_reconcile_duration_seconds",
            "Time of one reconcile of one RLJob (observe, plan, apply, status).",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.reconciles = Counter(
            "polyrl_reconciles_total", "Reconciles by result (ok, error, conflict).", ["result"], registry=r
        )
        self.errors = Counter(
            "polyrl_reconcile_errors_total", "Reconcile errors by kind.", ["kind"], registry=r
        )
        self.jobs = Gauge("polyrl_jobs", "RLJobs by phase.", ["phase"], registry=r)
        self.pods = Gauge("polyrl_pods", "Pods of RLJobs by role.", ["role"], registry=r)
        self.scale_decisions = Counter(
            "polyrl_scale_decisions_total",
            "Autoscaler decisions by role and direction.",
            ["role", "direction"],
            registry=r,
        )
        self.api_requests = Counter(
            "polyrl_api_requests_total",
            "Requests the operator sent to the API server (reconciles only; kopf's watches excluded).",
            ["verb"],
            registry=r,
        )
        self.restarts = Counter("polyrl_job_restarts_total", "Training-role restarts decided.", registry=r)
        for phase in PHASES:
            self.jobs.labels(phase).set(0)

    def set_jobs(self, phases: Iterable[str]) -> None:
        counts: dict[str, int] = dict.fromkeys(PHASES, 0)
        for phase in phases:
            counts[phase] = counts.get(phase, 0) + 1
        for phase, n in counts.items():
            self.jobs.labels(phase).set(n)

    def set_pods(self, roles: Iterable[str]) -> None:
        counts: dict[str, int] = {role: 0 for role in ROLES}
        for role in roles:
            counts[role] = counts.get(role, 0) + 1
        for role, n in counts.items():
            self.pods.labels(role).set(n)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
