"""Where the fleet's actors run: the GPUs each asks Ray for, the environment that leaves a pool
pod's devices visible, which policies' trainer and first engine share a process, and which policies
share one trainer holding their base model once. Pure functions
of the spec and the driver's choices (each policy's transport, the CPU sets of `polyrl run --cpus`),
tested as tables (tests/runtime/test_pools.py, tests/runtime/coordinator/test_fleet.py)."""

from __future__ import annotations

from collections.abc import Mapping

from polyrl_operator.api import Placement, RLJobSpec
from polyrl_runtime.cpusets import cpu_set_key

# Ray sets no CUDA_VISIBLE_DEVICES for an actor it assigns no GPU unless this variable is 1 (then it
# sets it to "", hiding every device): pooled actors see their pod's GPUs only with it off.
KEEP_VISIBLE_DEVICES = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}


def ray_gpus(placement: Placement, own: int) -> int:
    """The GPUs an actor placed by `placement` asks Ray for; `own` is what it takes on a pod of its
    own role (an engine all of the pod's, for tensor parallelism; a trainer rank one).

    On a pool pod the roles placed there share its GPUs, which Ray cannot express: it hands out whole
    devices (or fractions of one device), never all devices to several actors at once. So a pooled
    actor asks for none, and the invariant is: every pooled actor sees every GPU of its pod (Ray
    leaves the pod's CUDA_VISIBLE_DEVICES alone for an actor it assigns none, `KEEP_VISIBLE_DEVICES`);
    an engine runs tensor-parallel over all of them, a trainer rank uses the device of its index among
    its policy's ranks on that node (`trainers.api.node_local_ranks`). How many actors share a pod is
    bounded by the pool's placement resources alone (one engine per pooled rollout, ranks_per_pod
    ranks per pooled trainer), and their memory by the engines' engineArgs (gpu_memory_utilization
    must leave the trainers room). On CPU (gpus 0) every actor asks for none either way."""
    return 0 if placement.pool is not None or placement.gpus == 0 else own


def colocated_policies(
    spec: RLJobSpec, transports: Mapping[str, str], cpu_sets: Mapping[str, frozenset[int]]
) -> frozenset[str]:
    """The policies whose trainer and first engine can share a process (trainers/colocated.py) when
    every actor is on one host: a trainer of one rank and the torch engine, both on CPU and on no
    pool (a pool's turns move each role's memory on its own), weights that travel through memory
    (`objectstore` or `shm`, not a process group's broadcast), and neither role pinned to CPUs of
    its own (`polyrl run --cpus`)."""
    out = []
    for p in spec.policies:
        rollout, trainer = spec.rollout_placement(p), spec.trainer_placement(p)
        if (
            p.rollout.engine == "torch"
            and rollout.pool is None
            and trainer.pool is None
            and rollout.gpus == 0
            and trainer.gpus == 0
            and trainer.trainer_world == 1
            and transports[p.name] in ("objectstore", "shm")
            and not {cpu_set_key("rollout", None), cpu_set_key("trainer", None)} & set(cpu_sets)
        ):
            out.append(p.name)
    return frozenset(out)


def shared_trainers(spec: RLJobSpec) -> dict[str, tuple[str, ...]]:
    """policy -> the policies whose trainer ranks it shares (trainers/shared_rank.py: the base held
    once, one LoRA adapter each), for every policy of a shared base (`spec.shared_bases`) whose
    members' trainers all run on the base's pool with the same ranks per pod and a ZeRO stage below 3
    (the ranks hold the base whole; only the adapters train). Other policies of a shared base keep a
    trainer each, as a policy that shares nothing does. Its frozen members have no trainer, so no
    part of one: a base with a single trained member leaves that member a trainer of its own."""
    out: dict[str, tuple[str, ...]] = {}
    for base in spec.shared_bases():
        members = [spec.policy(name) for name in base.trained]
        layouts = {(t.trainer_world, t.ranks_per_pod) for t in map(spec.trainer_placement, members)}
        if (
            len(members) > 1
            and all(p.trainer.pool == base.pool and p.trainer.zero_stage < 3 for p in members)
            and len(layouts) == 1
        ):
            out.update(dict.fromkeys(base.trained, base.trained))
    return out
