"""Device pools in the runtime, without Ray: the placement resources a pool pod's Ray node offers
(`node_resources`) and a one-machine cluster offers (`placement_resources`), the GPUs a pooled actor
asks Ray for, `polyrl-runtime worker --role pool` refusing a pool the job lacks, and `--cpus
pool:NAME` checked against the job's pools."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator import pod_contract as contract
from polyrl_operator.api import Placement, RLJob
from polyrl_runtime.config import node_resources, placement_resources
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.coordinator.placement import ray_gpus
from polyrl_runtime.cpusets import ENV, CpuSetError, check_pools, cpu_set_key, parse_cpu_sets
from polyrl_runtime.local.run import role_pools
from polyrl_runtime.pods.entry import run_worker
from polyrl_testenv.operator_fixtures import pooled_cpu_job

DATA = Path(__file__).parent / "data"
BASE = yaml.safe_load((DATA / "selfplay-tiny.yaml").read_text())


def _policy(name: str, rollout_pool: str | None, trainer_pool: str | None, **trainer: Any) -> dict[str, Any]:
    """A torch-engine policy whose rollout and trainer run on the given pools (None: pods of their own)."""
    p = copy.deepcopy(BASE["spec"]["policies"][0])
    p["name"] = name
    if rollout_pool:
        p["rollout"] = {"engine": "torch", "pool": rollout_pool}
    if trainer_pool:
        p["trainer"] = {"backend": "deepspeed", "pool": trainer_pool}
    p["trainer"].update(trainer)
    return p


def _job(pools: list[dict[str, Any]], *policies: dict[str, Any]) -> RLJob:
    doc = copy.deepcopy(BASE)
    doc["spec"]["pools"] = pools or None
    doc["spec"]["policies"] = list(policies)
    return RLJob.model_validate(doc)


# `shared` (3 pods, trainers on the first 2): policy a colocated with 2 ranks per pod, b's rollout
# alone (its trainer has a pod of its own); `gpu` (4 GPUs per pod): c colocated, one rank per GPU.
JOB = _job(
    [
        {"name": "shared", "replicas": {"min": 2, "max": 3}, "gpus": 0},
        {"name": "gpu", "replicas": {"min": 1, "max": 1}, "gpus": 4},
    ],
    _policy("a", "shared", "shared", ranksPerPod=2),
    _policy("b", "shared", None, ranksPerPod=3),
    _policy("c", "gpu", "gpu"),
    _policy("d", None, None),
)


@pytest.mark.parametrize(
    ("role", "policy", "pool", "index", "offered"),
    [
        ("workflow", None, None, 0, {"polyrl/workflow": 1}),
        ("rollout", "d", None, 0, {"polyrl/d/rollout": 1}),
        ("trainer", "d", None, 0, {"polyrl/d/trainer": 1}),
        ("trainer", "b", None, 5, {"polyrl/b/trainer": 3}),
        # pool pods below replicas.min host the pooled trainers' ranks, the rest only engines
        ("pool", None, "shared", 0, {"polyrl/a/rollout": 1, "polyrl/a/trainer": 2, "polyrl/b/rollout": 1}),
        ("pool", None, "shared", 1, {"polyrl/a/rollout": 1, "polyrl/a/trainer": 2, "polyrl/b/rollout": 1}),
        ("pool", None, "shared", 2, {"polyrl/a/rollout": 1, "polyrl/b/rollout": 1}),
        ("pool", None, "gpu", 0, {"polyrl/c/rollout": 1, "polyrl/c/trainer": 4}),
    ],
)
def test_each_pod_offers_the_units_of_the_roles_placed_on_it(
    role: str, policy: str | None, pool: str | None, index: int, offered: dict[str, float]
) -> None:
    assert node_resources(JOB, role, policy, pool, index) == offered


def test_a_pool_pod_with_no_role_past_min_offers_nothing() -> None:
    job = _job([{"name": "t", "replicas": {"min": 1, "max": 2}, "gpus": 0}], _policy("a", None, "t"))
    assert node_resources(job, "pool", None, "t", 0) == {"polyrl/a/trainer": 1}
    assert node_resources(job, "pool", None, "t", 1) == {}


def test_unknown_names_are_refused() -> None:
    with pytest.raises(KeyError, match="no pool 'nope'"):
        node_resources(JOB, "pool", None, "nope", 0)
    with pytest.raises(ValueError, match="no rollout pod for policy 'zz'"):
        node_resources(JOB, "rollout", "zz", None, 0)


def test_a_one_machine_cluster_offers_what_the_pods_at_min_offer() -> None:
    expected = {
        "polyrl/workflow": 1,
        "polyrl/a/rollout": 2,  # one engine per pool pod at min
        "polyrl/a/trainer": 4,  # 2 pods x 2 ranks
        "polyrl/b/rollout": 2,
        "polyrl/b/trainer": 3,  # its own pod (replicas 1) x 3 ranks
        "polyrl/c/rollout": 1,
        "polyrl/c/trainer": 4,  # one rank per GPU
        "polyrl/d/rollout": 1,
        "polyrl/d/trainer": 1,
    }
    assert placement_resources(JOB) == expected
    # the same as the sum of what the job's pods at their minimum counts offer
    pods = [("workflow", None, None, 0), ("rollout", "d", None, 0), ("trainer", "d", None, 0)]
    pods += [("trainer", "b", None, 0), ("pool", None, "gpu", 0)]
    pods += [("pool", None, "shared", i) for i in range(2)]
    total: dict[str, float] = {}
    for pod in pods:
        for key, units in node_resources(JOB, *pod).items():
            total[key] = total.get(key, 0) + units
    assert total == expected


@pytest.mark.parametrize(
    ("placement", "own", "gpus"),
    [
        (Placement(None, 2, None, 1, 1), 2, 2),  # a dedicated engine: all of its pod's GPUs
        (Placement(None, 2, None, 1, 1, 2), 1, 1),  # a dedicated trainer rank: one of them
        (Placement(None, 0, None, 1, 1), 0, 0),
        (Placement("p", 4, None, 1, 1), 4, 0),  # pooled: none from Ray, it sees the pod's
        (Placement("p", 4, None, 1, 1, 4), 1, 0),
        (Placement("p", 0, None, 1, 1), 0, 0),
    ],
)
def test_pooled_actors_ask_ray_for_no_gpu(placement: Placement, own: int, gpus: int) -> None:
    assert ray_gpus(placement, own) == gpus


def test_a_pooled_actor_takes_its_pools_cpu_set_and_sees_the_pods_gpus() -> None:
    sets = {"rollout": frozenset({0}), "trainer": frozenset({1}), "pool:gpu": frozenset({2, 3})}
    fleet = Fleet(JOB, "objectstore", cpu_sets=sets)
    policies = {p.name: p for p in JOB.spec.policies}
    pooled = fleet._env("trainer", JOB.spec.trainer_placement(policies["c"]))
    assert pooled == {ENV: "2-3", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
    own = fleet._env("trainer", JOB.spec.trainer_placement(policies["d"]))
    assert own == {ENV: "1"}
    # Nothing else of the driver's environment: the actor has its node's (in a pod, its role's env),
    # and an actor with nothing to add has no runtime_env at all (no setup_worker.py interpreter).
    assert fleet._env("rollout", JOB.spec.rollout_placement(policies["a"])) == {}
    assert fleet._runtime_env("rollout", JOB.spec.rollout_placement(policies["a"])) == {}
    assert fleet._runtime_env("workflow") == {}
    assert fleet._runtime_env("trainer", JOB.spec.trainer_placement(policies["d"])) == {
        "runtime_env": {"env_vars": {ENV: "1"}}
    }


# -- polyrl-runtime worker --role pool -------------------------------------------------------------


@pytest.fixture
def job_file(tmp_path: Path) -> str:
    path = tmp_path / "job.json"
    path.write_text(JOB.model_dump_json(by_alias=True))
    return str(path)


@pytest.mark.parametrize(
    ("worker", "message"),
    [
        (
            {"role": "pool", "pool": "nope"},
            "--pool=nope: the job has no pool 'nope' (spec.pools: gpu, shared)",
        ),
        ({"role": "pool", "env": "other"}, f"{contract.ENV_POOL}=other: the job has no pool 'other'"),
        ({"role": "pool"}, "--role pool needs --pool NAME (or POLYRL_POOL); spec.pools: gpu, shared"),
        ({"role": "rollout", "policy": "a"}, "policy 'a' runs its rollout on pool 'shared'"),
        ({"role": "trainer", "policy": "c"}, "(--role pool --pool gpu)"),
        ({"role": "trainer", "policy": "zz"}, "--policy must name one of the job's policies"),
    ],
)
def test_a_worker_refuses_a_pool_or_role_the_job_does_not_place_there(
    job_file: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    worker: dict[str, str],
    message: str,
) -> None:
    """`worker`: run_worker's role, policy and pool, and `env`, the pod's POLYRL_POOL."""
    monkeypatch.setenv(contract.ENV_POOL, worker.get("env", ""))
    monkeypatch.setenv(contract.ENV_COORDINATOR_ADDRESS, "127.0.0.1:1")
    code = run_worker(job_file, role=worker["role"], policy=worker.get("policy"), pool=worker.get("pool"))
    assert code == 2
    assert message in capsys.readouterr().err


# -- --cpus pool:NAME ------------------------------------------------------------------------------


def test_pool_items_parse_and_name_their_key() -> None:
    sets = parse_cpu_sets(["pool:shared=0-1", "workflow=2"], frozenset(range(4)))
    assert sets == {"pool:shared": {0, 1}, "workflow": {2}}
    assert cpu_set_key("trainer", "shared") == "pool:shared" and cpu_set_key("trainer", None) == "trainer"
    with pytest.raises(CpuSetError, match="--cpus pool:=0: unknown role 'pool:'"):
        parse_cpu_sets(["pool:=0"], frozenset(range(4)))
    with pytest.raises(CpuSetError, match="role 'pool:x' is given twice"):
        parse_cpu_sets(["pool:x=0", "pool:x=1"], frozenset(range(4)))


ALL_POOLED = _job(
    [{"name": "shared", "gpus": 0}], _policy("a", "shared", "shared"), _policy("b", "shared", "shared")
)
MIXED = _job([{"name": "shared", "gpus": 0}], _policy("a", "shared", "shared"), _policy("b", None, None))
NO_POOLS = _job([], _policy("a", None, None))


@pytest.mark.parametrize(
    ("job", "items", "error"),
    [
        (ALL_POOLED, ["pool:shared=0-1", "workflow=0"], None),
        (MIXED, ["pool:shared=0", "trainer=1", "rollout=1"], None),  # b's roles have pods of their own
        (
            ALL_POOLED,
            ["pool:other=0"],
            "--cpus pool:other=0: the job has no pool 'other' (spec.pools: shared)",
        ),
        (
            NO_POOLS,
            ["pool:shared=0"],
            "the job has no pool 'shared' (spec.pools: it defines none)",
        ),
        (
            ALL_POOLED,
            ["trainer=1"],
            "--cpus trainer=1: every trainer runs on a device pool (policy 'a' on pool 'shared', policy "
            "'b' on pool 'shared'), whose cores the roles on it share: pin the pool instead, "
            "--cpus pool:shared=CPUS",
        ),
        (NO_POOLS, ["rollout=0", "trainer=1", "workflow=0"], None),
    ],
)
def test_cpu_sets_are_checked_against_the_jobs_pools(job: RLJob, items: list[str], error: str | None) -> None:
    sets = parse_cpu_sets(items, frozenset(range(4)))
    if error is None:
        check_pools(sets, job.spec.pool_names, role_pools(job))
        return
    with pytest.raises(CpuSetError) as err:
        check_pools(sets, job.spec.pool_names, role_pools(job))
    assert error in str(err.value)


def test_auto_picks_shared_memory_for_a_policy_on_one_pod_even_across_pods(tmp_path: Path) -> None:
    """In pods (`same_host=False`) `auto` is the object store, except for a policy whose engine
    and trainer share one pod: its weights go through that pod's shared memory."""
    from polyrl_runtime.coordinator.driver import Driver
    from polyrl_runtime.coordinator.job_state import DriverOptions

    doc = pooled_cpu_job()
    doc["spec"]["pools"][0]["replicas"] = {"min": 1, "max": 1}
    doc["spec"]["weightSync"] = {"transport": "auto"}
    job = RLJob.model_validate(doc)
    driver = Driver(job, DriverOptions(tmp_path, tmp_path / "ckpt", same_host=False))
    assert driver.transports == {"speaker": "shm", "listener": "objectstore"}
    assert driver.fleet.transports == driver.transports
    local = Driver(job, DriverOptions(tmp_path, tmp_path / "ckpt", same_host=True))
    assert set(local.transports.values()) == {"shm"}


def test_auto_picks_device_memory_for_a_policy_colocated_on_a_gpu_pool(tmp_path: Path) -> None:
    """A GPU trainer whose rollout (torch or vLLM) shares its pool of one pod updates its engines
    through CUDA IPC; on a pool of several pods (engines off the trainer's host) through the object
    store: collective would make trainer rank 0 and pod 0's engine two NCCL ranks on one GPU."""
    from polyrl_runtime.coordinator.driver import Driver
    from polyrl_runtime.coordinator.job_state import DriverOptions

    def transports(max_replicas: int, engine: str) -> dict[str, str]:
        doc = pooled_cpu_job()
        doc["spec"]["pools"][0]["gpus"] = 1
        doc["spec"]["pools"][0]["replicas"] = {"min": 1, "max": max_replicas}
        doc["spec"]["policies"][0]["rollout"]["engine"] = engine
        doc["spec"]["weightSync"] = {"transport": "auto"}
        job = RLJob.model_validate(doc)
        return Driver(job, DriverOptions(tmp_path, tmp_path / "ckpt", same_host=False)).transports

    assert transports(1, "torch") == {"speaker": "cudaipc", "listener": "objectstore"}
    assert transports(3, "torch") == {"speaker": "objectstore", "listener": "objectstore"}
    assert transports(1, "vllm") == {"speaker": "cudaipc", "listener": "objectstore"}
    assert transports(3, "vllm") == {"speaker": "objectstore", "listener": "objectstore"}
