"""One rank per device: `trainer.ranksPerPod` (one per GPU by default), the units of the trainer
resource a pod offers, each rank's node-local index, and two ranks of one pod on CPU with gloo built
by `Fleet.new_trainers`: the Hugging Face model partitioned between them under ZeRO-3, a DeepSpeed
step with world 2, and a whole job through the driver."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.config import node_resources
from polyrl_runtime.coordinator.fleet import Fleet
from polyrl_runtime.local.run import local_resources
from polyrl_runtime.trainers.api import node_local_ranks
from polyrl_runtime.trainers.deepspeed_trainer import DeepSpeedTrainer

sys.path.insert(0, str(Path(__file__).parent.parent / "coordinator"))
from driver_harness import make_job, policy, run


@pytest.mark.parametrize(
    ("fields", "ranks"),
    [
        ({}, 1),  # gpus defaults to 1
        ({"gpus": 0}, 1),
        ({"gpus": 8}, 8),
        ({"gpus": 8, "ranksPerPod": 8}, 8),
        ({"gpus": 0, "ranksPerPod": 2}, 2),
    ],
)
def test_ranks_per_pod(fields: dict[str, Any], ranks: int) -> None:
    p = policy()
    p["trainer"] = {"backend": "deepspeed", **fields}  # without the test job's gpus: 0
    job = make_job(policies=[p])
    assert job.spec.trainer_placement(job.spec.policies[0]).ranks_per_pod == ranks


def test_ranks_per_pod_must_equal_gpus_on_gpu() -> None:
    with pytest.raises(ValueError, match="ranksPerPod: must equal gpus when gpus > 0"):
        make_job(policies=[policy(trainer={"gpus": 2, "ranksPerPod": 1})])


def test_a_trainer_pod_offers_one_unit_per_rank() -> None:
    job = make_job(
        policies=[
            policy("a", trainer={"gpus": 0, "ranksPerPod": 2, "replicas": 3}),
            policy("b", trainer={"gpus": 0}),
        ]
    )
    assert node_resources(job, "trainer", "a", None, 0) == {"polyrl/a/trainer": 2}
    assert node_resources(job, "trainer", "b", None, 0) == {"polyrl/b/trainer": 1}
    assert node_resources(job, "rollout", "a", None, 0) == {"polyrl/a/rollout": 1}
    assert node_resources(job, "workflow", None, None, 0) == {"polyrl/workflow": 1}
    res = local_resources(job)
    assert res["polyrl/a/trainer"] == 6 and res["polyrl/b/trainer"] == 1


@pytest.mark.parametrize(
    ("nodes", "local"),
    [
        ([], []),
        (["n0"], [0]),
        (["n0", "n0", "n1", "n1"], [0, 1, 0, 1]),  # the planned layout
        (["n0", "n1", "n0", "n1"], [0, 0, 1, 1]),  # Ray's choice: ranks 0 and 2 share a pod
        (["n1", "n1", "n1"], [0, 1, 2]),
    ],
)
def test_a_ranks_device_index_is_its_index_on_its_node(nodes: list[str], local: list[int]) -> None:
    assert node_local_ranks(nodes) == local


# -- two ranks of one pod on a local Ray -----------------------------------------------------------


@pytest.fixture
def ray_here(ray_session: Any) -> Iterator[Any]:
    # The helpers below run inside the rank actors: ship them by value, this module is not
    # importable there.
    pickler: Any = ray.cloudpickle
    pickler.register_pickle_by_value(sys.modules[__name__])
    yield ray_session
    pickler.unregister_pickle_by_value(sys.modules[__name__])


def _identity(trainer: DeepSpeedTrainer) -> tuple[int, int, int, str]:
    import os

    return trainer.rank, trainer.local_rank, trainer.world, os.environ["LOCAL_RANK"]


def _shards(trainer: DeepSpeedTrainer) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model)."""
    params = list(trainer.engine.module.parameters())
    assert all(p.numel() == 0 for p in params)
    return sum(p.ds_tensor.numel() for p in params), sum(p.ds_numel for p in params)


def _step(trainer: DeepSpeedTrainer) -> dict[str, torch.Tensor]:
    """One DeepSpeed step on this rank's own rows; returns the whole model after it."""
    engine = trainer.engine
    ids = (torch.arange(trainer.rank * 40, trainer.rank * 40 + 16).reshape(2, 8) % 300).to(engine.device)
    logits = engine(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )
    engine.backward(loss)
    engine.step()
    return _whole(trainer)


def _whole(trainer: DeepSpeedTrainer) -> dict[str, torch.Tensor]:
    import deepspeed

    module = trainer.engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        return {n: p.detach().float().cpu() for n, p in module.named_parameters()}


def _gpus(n: int) -> Any:
    return pytest.mark.skipif(
        torch.cuda.device_count() < n, reason=f"needs {n} CUDA GPU(s) (NCCL, one rank per device)"
    )


@pytest.mark.parametrize(
    ("model", "trainer"),
    [
        pytest.param({"dtype": "float32"}, {"gpus": 0, "ranksPerPod": 2}, id="cpu-gloo"),
        # One rank per GPU with NCCL, the model in bfloat16 and partitioned at construction.
        pytest.param({"dtype": "bfloat16"}, {"gpus": 1}, id="gpu-1-bf16", marks=[pytest.mark.gpu, _gpus(1)]),
        pytest.param(
            {"dtype": "bfloat16"}, {"gpus": 2}, id="gpu-2-nccl-bf16", marks=[pytest.mark.gpu, _gpus(2)]
        ),
    ],
)
def test_two_ranks_of_one_pod_partition_the_model_and_step_together(
    ray_here: Any, tiny_qwen2_dir: Path, model: dict[str, Any], trainer: dict[str, Any]
) -> None:
    p = policy(
        model={"uri": f"file://{tiny_qwen2_dir}", **model},
        trainer={**trainer, "zeroStage": 3, "microBatchSize": 2},
    )
    job = make_job(policies=[p])
    spec: Policy = job.spec.policies[0]
    fleet = Fleet(job, "objectstore", place_by_resource=False)
    clients = fleet.new_trainers(spec, buffer=None)  # these ranks pull nothing
    ranks: list[Any] = [c.handle for c in clients]  # `__ray_call__` runs the helpers below in them
    n = job.spec.trainer_placement(spec).ranks_per_pod
    try:
        assert len(ranks) == n
        addr, port = ray.get(clients[0].address())
        local = node_local_ranks(ray.get([c.node_id() for c in clients]))
        ray.get([c.setup(addr, port, i) for c, i in zip(clients, local, strict=True)])
        identity = ray.get([r.__ray_call__.remote(_identity) for r in ranks])
        # LOCAL_RANK names the device in the rank's view (Ray shows each GPU rank only its own GPU).
        assert identity == [(i, i, n, "0") for i in range(n)]
        shards = ray.get([r.__ray_call__.remote(_shards) for r in ranks])
        held, whole = zip(*shards, strict=True)
        assert len(set(whole)) == 1 and sum(held) >= whole[0]
        assert all(h <= whole[0] // n + 64 for h in held)  # each rank its share, never more
        before = ray.get([r.__ray_call__.remote(_whole) for r in ranks])[0]
        after = ray.get([r.__ray_call__.remote(_step) for r in ranks])
        assert all(a.keys() == before.keys() for a in after)
        for other in after[1:]:  # one optimizer step over every rank's rows: the same model on each
            for name in after[0]:
                torch.testing.assert_close(after[0][name], other[name], msg=name)
        assert sum(not torch.equal(before[k], after[0][k]) for k in before) > len(before) // 2
    finally:
        fleet.close()


@pytest.mark.slow
def test_a_job_trains_with_two_ranks_in_one_trainer_pod(ray_here: Any, tmp_path: Path) -> None:
    p = policy(trainer={"gpus": 0, "ranksPerPod": 2, "zeroStage": 2, "microBatchSize": 4})
    job = make_job(
        mode="sync", maxStaleness=0, training={"totalSteps": 2, "episodesPerStep": 8}, policies=[p]
    )
    driver, summary = run(job, tmp_path)
    try:
        assert summary.state == "done", summary.message
        assert len(driver.runs["agent"].ranks) == 2
        assert all(r.samples == 16 for r in summary.records)  # 8 episodes x 2 turns, over two ranks
        assert all(r.grad_norm > 0 for r in summary.records)
    finally:
        driver.close()
