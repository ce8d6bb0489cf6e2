"""Shared fixtures. The control-plane tier: ``controlplane`` (one per session) and ``namespace``.

The control plane is the genuine Kubernetes CRD server on etcd behind a small shim (see
tests/support/polyrl_testenv). When its binaries are not built the tests that need it are skipped
with a loud reason, never passed.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from polyrl_testenv import ControlPlane, find_binaries

CONTROLPLANE_FIXTURES = frozenset({"controlplane", "namespace"})
RAY_FIXTURES = frozenset({"ray_session"})  # every Ray fixture of the suite builds on it
TRAINING_FIXTURES = frozenset({"gloo"})  # DeepSpeed's process group: engines are built in-process
# The helpers that start `polyrl run` (tests/support/polyrl_testenv/localrun.py): a module that
# imports one runs jobs with their own Ray cluster.
LOCAL_RUN_HELPERS = frozenset({"polyrl_run", "run_to_end", "Background"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Tests carry the markers of what they need, so the tiers select by them (`make check` runs
    # none of controlplane, e2e, gpu, ray, training or slow) even where a test forgot to mark itself.
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        module = vars(getattr(item, "module", None) or object())
        if CONTROLPLANE_FIXTURES & fixtures:
            item.add_marker(pytest.mark.controlplane)
        if RAY_FIXTURES & fixtures or LOCAL_RUN_HELPERS & set(module):
            item.add_marker(pytest.mark.ray)
        if TRAINING_FIXTURES & fixtures:
            item.add_marker(pytest.mark.training)


@pytest.fixture(scope="session")
def controlplane() -> Iterator[ControlPlane]:
    """etcd + apiextensions-apiserver + shim, started once per session; kubeconfig in ``.kubeconfig``."""
    binaries, reason = find_binaries()
    if binaries is None:
        pytest.skip(f"CONTROL PLANE NOT AVAILABLE: {reason} (run hack/controlplane/prepare.sh)")
    plane = ControlPlane.start(binaries)
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def namespace(controlplane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted (with its contents) afterwards."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].rstrip("-")
    name = f"t-{slug}-{uuid.uuid4().hex[:6]}"
    controlplane.create_namespace(name)
    try:
        yield name
    finally:
        controlplane.delete_namespace(name)
