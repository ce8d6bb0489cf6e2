"""docs/install.md against the code: the metrics table lists exactly the operator's metrics with
their labels (and the label values the code uses), and the install commands name real paths."""

from __future__ import annotations

import re

from prometheus_client import Counter, Gauge, Histogram

from polyrl_operator.api import PHASES
from polyrl_operator.metrics import Metrics
from polyrl_testenv.bad_rljobs import REPO

DOC = (REPO / "docs" / "install.md").read_text()
ROWS = re.findall(r"^\| `(polyrl_[a-z_]+)` \| (\w+) \| ([^|]+) \|", DOC, re.M)


def test_metrics_table_is_the_operators_metrics() -> None:
    actual: dict[str, tuple[str, set[str]]] = {}
    for value in vars(Metrics()).values():
        if isinstance(value, Counter | Gauge | Histogram):
            kind = {Counter: "counter", Gauge: "gauge", Histogram: "histogram"}[type(value)]
            name = value._name + ("_total" if kind == "counter" else "")  # the exposed name
            actual[name] = (kind, set(value._labelnames))
    documented = {
        name: (kind, set(re.findall(r"`([a-z_]+)`", re.sub(r"\([^)]*\)", "", labels))))
        for name, kind, labels in ROWS
    }
    assert documented == actual


def test_documented_label_values_are_the_codes() -> None:
    cells = {name: labels for name, _, labels in ROWS}
    phases = re.search(r"\(([^)]*)\)", cells["polyrl_jobs"])
    assert phases and [p.strip() for p in phases[1].split(",")] == list(PHASES)
    metrics = Metrics()
    metrics.set_pods([])
    roles = {
        s.labels["role"] for fam in metrics.registry.collect() for s in fam.samples if "role" in s.labels
    }
    documented = re.search(r"\(([^)]*)\)", cells["polyrl_pods"])
    assert documented and {r.strip() for r in documented[1].split(",")} == roles


def test_install_commands_name_real_paths() -> None:
    for path in re.findall(r"(?:-k|-f|--patch-file) ((?:manifests|charts|crds)/[\w./-]*)", DOC):
        assert (REPO / path).exists(), path
    assert "kubectl apply --server-side -k manifests/base" in DOC
    assert "helm install polyrl charts/polyrl" in DOC
    assert "kubectl apply --server-side -f crds/" in DOC


def test_readme_and_contributing_name_real_files_and_make_targets() -> None:
    makefile = (REPO / "Makefile").read_text()
    for doc in ("README.md", "CONTRIBUTING.md"):
        text = (REPO / doc).read_text()
        for path in re.findall(r"\]\(([\w./-]+)\)", text):  # markdown links to files in the tree
            assert (REPO / path).exists(), f"{doc}: {path}"
        for path in re.findall(r"((?:manifests|docs|benchmarks|charts|hack)/[\w./-]*\w)", text):
            assert (REPO / path).exists(), f"{doc}: {path}"
        for target in re.findall(r"`make (\w+)`|^make (\w+)", text, re.M):
            name = target[0] or target[1]
            assert re.search(rf"^{name}:", makefile, re.M), f"{doc}: make {name}"
