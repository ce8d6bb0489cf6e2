"""Two policies that share a base model as LoRA adapters (their rollouts on one pool, the same model,
`algorithm.lora`), through the driver and real actors: one engine serves both, each trainer publishes
its adapter alone and the engine applies each policy's versions to that policy's adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from driver_harness import make_job, policy, run

from polyrl_operator.api import Lora
from polyrl_runtime.models import model_dir
from polyrl_runtime.models.lora_layout import adapter_layout

LORA = {"rank": 4, "alpha": 8, "targetModules": ["q_proj", "v_proj"]}


def adapters_on_a_pool(mode: str) -> Any:
    agents = []
    for name in ("left", "right"):
        p = policy(name, model={"uri": "builtin://tiny-qwen2", "dtype": "float32"})
        p["algorithm"] = {"name": "grpo", "groupSize": 8, "lr": 1.0e-2, "lora": LORA}
        p["rollout"] = {"engine": "torch", "pool": "shared"}
        agents.append(p)
    return make_job(
        mode=mode,
        maxStaleness=1 if mode == "async" else 0,
        training={"totalSteps": 2, "episodesPerStep": 16, "seed": 3},
        workflow={
            "entrypoint": "polyrl_runtime.workflows.guessing:Guessing",
            "args": {"agents": ["left", "right"], "symbols": 4, "shift": 1, "reply_tokens": 3},
        },
        policies=agents,
        pools=[{"name": "shared", "gpus": 0}],
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_engine_serves_both_policies_and_receives_adapters_only(
    ray_local: Any, tmp_path: Path, mode: str
) -> None:
    driver, summary = run(adapters_on_a_pool(mode), tmp_path)
    assert summary.state == "done", summary.message
    assert sorted((r.policy, r.step) for r in driver.records) == [
        (p, s) for p in ("left", "right") for s in (1, 2)
    ]
    (left,), (right,) = driver.fleet.engines["left"].values(), driver.fleet.engines["right"].values()
    assert left is right and left.shared_by == ("left", "right")
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir("builtin://tiny-qwen2")), dtype=torch.float32
    )
    adapter_bytes = adapter_layout(base, "left", Lora.model_validate(LORA)).nbytes(4)
    for name in ("left", "right"):
        sync = driver.runs[name].sync
        assert sync is not None and sync._last is not None
        assert sync._last.manifest.version == 2
        (report,) = sync._last.reports.values()
        assert report.applied and report.nbytes == adapter_bytes  # the adapter's tensors, nothing more
        assert {s.name.removeprefix(".") for s in sync._last.manifest.layout.specs} == set(
            adapter_layout(base, name, Lora.model_validate(LORA)).shapes()
        )
