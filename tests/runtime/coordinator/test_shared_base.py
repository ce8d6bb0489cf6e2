"""Two policies that share a base model as LoRA adapters (their rollouts on one pool, the same model,
`algorithm.lora`), through the driver and real actors: one engine serves both, each trainer publishes
its adapter alone and the engine applies each policy's versions to that policy's adapter. With their
trainers on the pool too, one trainer actor holds the base once for both (trainers/shared_rank.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from driver_harness import cpu_pools_take_turns, make_job, policy, run
from safetensors.torch import load_file

from polyrl_operator.api import Lora
from polyrl_runtime.coordinator.checkpoints.store import TRAINER_TAG, CheckpointStore
from polyrl_runtime.models import model_dir
from polyrl_runtime.models.lora_layout import adapter_layout

LORA = {"rank": 4, "alpha": 8, "targetModules": ["q_proj", "v_proj"]}


def adapters_on_a_pool(mode: str, *, shared_trainer: bool = False, steps: int = 2, **spec: Any) -> Any:
    agents = []
    for name in ("left", "right"):
        p = policy(name, model={"uri": "builtin://tiny-qwen2", "dtype": "float32"})
        p["algorithm"] = {"name": "grpo", "groupSize": 8, "lr": 1.0e-2, "lora": LORA}
        p["rollout"] = {"engine": "torch", "pool": "shared"}
        if shared_trainer:
            p["trainer"] = {"zeroStage": 1, "microBatchSize": 16, "pool": "shared"}
        agents.append(p)
    return make_job(
        mode=mode,
        maxStaleness=1 if mode == "async" else 0,
        training={"totalSteps": steps, "episodesPerStep": 16, "seed": 3},
        workflow={
            "entrypoint": "polyrl_runtime.workflows.guessing:Guessing",
            "args": {"agents": ["left", "right"], "symbols": 4, "shift": 1, "reply_tokens": 3},
        },
        policies=agents,
        pools=[{"name": "shared", "gpus": 0}],
        **spec,
    )


def engine_shared_with_adapters_only(driver: Any, version: int) -> None:
    """One engine serves both policies, and each policy's last update moved its adapter alone."""
    (left,), (right,) = driver.fleet.engines["left"].values(), driver.fleet.engines["right"].values()
    assert left is right and left.shared_by == ("left", "right")
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir("builtin://tiny-qwen2")), dtype=torch.float32
    )
    adapter_bytes = adapter_layout(base, "left", Lora.model_validate(LORA)).nbytes(4)
    for name in ("left", "right"):
        sync = driver.runs[name].sync
        assert sync is not None and sync._last is not None
        assert sync._last.manifest.version == version
        (report,) = sync._last.reports.values()
        assert report.applied and report.nbytes == adapter_bytes  # the adapter's tensors, nothing more
        assert {s.name.removeprefix(".") for s in sync._last.manifest.layout.specs} == set(
            adapter_layout(base, name, Lora.model_validate(LORA)).shapes()
        )


@pytest.mark.slow
def test_one_engine_serves_both_policies_and_receives_adapters_only(ray_local: Any, tmp_path: Path) -> None:
    driver, summary = run(adapters_on_a_pool("sync"), tmp_path)
    assert summary.state == "done", summary.message
    assert driver.fleet.shared_trainers == {}  # trainers of their own: one each
    assert sorted((r.policy, r.step) for r in driver.records) == [
        (p, s) for p in ("left", "right") for s in (1, 2)
    ]
    engine_shared_with_adapters_only(driver, 2)


@pytest.mark.slow
def test_a_shared_trainer_checkpoints_each_policy_and_resumes_from_it(
    ray_local: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With their trainers on the pool too, both policies train (async) through one trainer actor whose
    base moves off and back between the pool's turns (CPU pools scheduled as GPU pools are), the
    engine still receives adapters only, each policy checkpoints and exports its own adapter, and a
    resumed job continues each from its own."""
    cpu_pools_take_turns(monkeypatch)
    ckpt = {"everySteps": 1, "keep": 3}
    driver, first = run(adapters_on_a_pool("async", shared_trainer=True, steps=2, checkpoint=ckpt), tmp_path)
    assert first.state == "done", first.message
    assert driver.fleet.shared_trainers == dict.fromkeys(["left", "right"], ("left", "right"))
    (group,) = driver.fleet._shared_ranks.values()
    assert len(group) == 1  # one rank, one actor, for both policies
    engine_shared_with_adapters_only(driver, 2)
    latest = CheckpointStore(tmp_path / "ckpt", 3).latest()
    assert latest is not None and latest.step == 2
    for name in ("left", "right"):
        (saved,) = (Path(latest.trainer_dir(name)) / TRAINER_TAG).glob("adapter-rank*.pt")
        state = torch.load(saved, weights_only=True)
        assert state["policy"] == name and state["client_state"]["version"] == 2
        assert all(".lora_" in n and f".{name}." in n for n in state["adapter"])
    # Exports are per policy: the base with that policy's adapter merged in, and that adapter alone.
    exported = {}
    for name in ("left", "right"):
        export = tmp_path / "ckpt" / "export" / "step-000002" / name
        assert sorted(p.name for p in (export / "adapter").iterdir() if p.suffix != ".md") == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        exported[name] = load_file(str(export / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(exported["left"][q], exported["right"][q])
    driver, second = run(adapters_on_a_pool("async", shared_trainer=True, steps=3, checkpoint=ckpt), tmp_path)
    assert second.state == "done", second.message
    assert sorted((r.policy, r.step) for r in second.records) == [("left", 3), ("right", 3)]
