"""A frozen policy on the base of a LoRA policy (the same pool, model and dtype), through the driver
and real actors: the two share one engine, which serves the LoRA speaker its adapter and the frozen
listener the base as loaded. The listener has no adapter, no trainer and no weight sync; the base it
is served never changes while the speaker's adapter does; its turns are dropped as policy_frozen."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from driver_harness import make_job, new_driver, policy, still_running, until

from polyrl_operator.api import Lora
from polyrl_runtime.coordinator.slots import EngineSlot
from polyrl_runtime.engines.api import Generation, SamplingParams
from polyrl_runtime.models import model_dir
from polyrl_runtime.models.lora_layout import adapter_layout
from polyrl_testenv.models import greedy_reply

LORA = {"rank": 4, "alpha": 8, "targetModules": ["q_proj", "v_proj"]}
HF = {"uri": "builtin://tiny-qwen2", "dtype": "float32"}
PROMPT = [5, 17, 42, 9]
REPLY = 6


def _job() -> Any:
    speaker = policy("speaker", model=HF)
    speaker["algorithm"] = {"name": "grpo", "groupSize": 8, "lr": 1.0e-2, "lora": LORA}
    speaker["rollout"] = {"engine": "torch", "pool": "shared"}
    listener = policy("listener", model=HF, frozen=True)
    listener["rollout"] = {"engine": "torch", "pool": "shared"}
    del listener["trainer"]
    return make_job(
        mode="sync",
        maxStaleness=0,
        training={"totalSteps": 3, "episodesPerStep": 16, "seed": 3},
        workflow={
            "entrypoint": "polyrl_runtime.workflows.guessing:Guessing",
            "args": {"agents": ["speaker", "listener"], "symbols": 4, "shift": 1, "reply_tokens": 3},
        },
        # The frozen member first: the group's engine is still the speaker's rollout.
        policies=[listener, speaker],
        pools=[{"name": "shared", "gpus": 0}],
    )


Probe = tuple[dict[str, int], Generation, Generation]


@pytest.mark.slow
def test_a_frozen_policy_is_served_the_base_by_the_engine_of_a_lora_policy(
    ray_local: Any, tmp_path: Path
) -> None:
    job = _job()
    (base_group,) = job.spec.shared_bases()
    assert (base_group.policies, base_group.frozen) == (("listener", "speaker"), ("listener",))
    driver = new_driver(job, tmp_path)

    async def probe(engine: EngineSlot) -> Probe:
        greedy = {
            p: SamplingParams(temperature=0, max_new_tokens=REPLY, policy=p) for p in ("listener", "speaker")
        }
        stats = await engine.actor.stats()
        listener = await engine.actor.generate(PROMPT, greedy["listener"])
        speaker = await engine.actor.generate(PROMPT, greedy["speaker"])
        return dict(stats.adapters), listener, speaker

    async def go() -> tuple[Any, EngineSlot, list[Probe]]:
        task = asyncio.ensure_future(driver.run())
        await until(task, lambda: driver.state == "running", "the job to start")
        (engine,) = driver.fleet.engines["listener"].values()
        probes = [await probe(engine)]
        for version in (1, 2):  # the speaker's adapter versions, as the engine serves them
            while (await engine.actor.stats()).adapters["speaker"] < version:
                still_running(task, f"the speaker's version {version} on the engine")
                await asyncio.sleep(0.05)
            probes.append(await probe(engine))
        return await task, engine, probes

    summary, engine, probes = asyncio.run(go())
    assert summary.state == "done", summary.message

    # One engine, the speaker's rollout, serves both; the listener has no engine of its own.
    (speakers,) = driver.fleet.engines["speaker"].values()
    assert speakers is engine and engine.shared_by == ("listener", "speaker") and engine.policy == "speaker"
    assert driver.fleet.shared_trainers == {}  # one trained member: a trainer of its own

    # The engine holds the speaker's adapter alone; the listener's replies are the base model's,
    # the same at every adapter version, at the base's version as loaded (-1).
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir("builtin://tiny-qwen2")), dtype=torch.float32
    ).eval()
    expected = greedy_reply(base, PROMPT, REPLY)
    assert [adapters for adapters, _, _ in probes] == [
        {"speaker": a} for a in (probes[0][0]["speaker"], 1, 2)
    ]
    first = probes[0][1]
    for adapters, listener, speaker in probes:
        assert listener.token_ids.tolist() == expected and (listener.versions == -1).all()
        np.testing.assert_allclose(listener.logprobs, first.logprobs, atol=1e-4, rtol=0)
        # The speaker's requests run its adapter: the version the probe saw, or one the job published
        # since (it trains on while the probe runs), never the base's.
        assert (speaker.versions >= max(adapters["speaker"], 0)).all()

    # The listener: no trainer, no sync, no steps; its turns reached the buffer and were dropped.
    listener_run, speaker_run = driver.runs["listener"], driver.runs["speaker"]
    assert listener_run.ranks == [] and listener_run.sync is None and listener_run.trainer_state == "frozen"
    assert sorted((r.policy, r.step) for r in summary.records) == [("speaker", s) for s in (1, 2, 3)]
    assert summary.dropped["listener"]["policy_frozen"] > 0
    assert summary.buffers["listener"]["consumed"] == 0
    # Status: the listener's engine serves it version 0 (the base), the speaker's adapter version 3.
    listener_status, speaker_status = driver.snapshot().policies
    assert [e.version for e in listener_status.engines] == [0]
    assert [e.version for e in speaker_status.engines] == [3]
    # The speaker's updates moved its adapter alone, to the one engine.
    sync = speaker_run.sync
    assert sync is not None and sync._last is not None and sync._last.manifest.version == 3
    (report,) = sync._last.reports.values()
    assert report.applied and report.nbytes == adapter_layout(
        base, "speaker", Lora.model_validate(LORA)
    ).nbytes(4)
