"""The vLLM engine itself, on a GPU machine with the `gpu` extra installed (skipped elsewhere).

A tiny random Llama is written with transformers and served by vLLM; the trainer side is the job's
real collective sender. The sender here runs gloo (a CPU process): NCCL cannot join two processes
on one GPU, and a test machine may have one. What runs on CPU is in test_vllm_api.py,
test_vllm_worker.py and test_vllm_contract.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("the vLLM engine needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm", reason="the vLLM engine needs the gpu extra (pip install polyrl-runtime[gpu])")

from polyrl_runtime.algorithms.losses import TokenBatch, sequence_logprobs  # noqa: E402
from polyrl_runtime.engines.api import SamplingParams  # noqa: E402
from polyrl_runtime.engines.vllm_engine import VllmEngine  # noqa: E402
from polyrl_runtime.weights import make_sender  # noqa: E402
from polyrl_runtime.weights.api import WeightSyncError  # noqa: E402

VOCAB = 512
ALLOWED = tuple(range(10, 200))  # no EOS: generations run to max_new_tokens


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config)  # float32
    model.eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path, model


def _engine(path: Path, **kw: Any) -> VllmEngine:
    extra = {"skip_tokenizer_init": True, "gpu_memory_utilization": 0.3, "enforce_eager": True}
    return VllmEngine(
        "e0",
        "p",
        f"file://{path}",
        transport="collective",
        transport_kwargs={"timeout_s": kw.pop("timeout_s", 60.0)},
        dtype="float32",
        engine_args={**extra, **kw.pop("engine_args", {})},
        **kw,
    )


@pytest.fixture(scope="module")
def engine(hf_model: tuple[Path, Any]) -> Iterator[VllmEngine]:
    eng = _engine(hf_model[0])
    yield eng
    eng._llm.shutdown()


def _weights(model: Any, scale: float) -> dict[str, torch.Tensor]:
    """What a trainer publishes: the model's named parameters (here perturbed to tell versions apart)."""
    g = torch.Generator().manual_seed(int(scale * 1000))
    return {
        n: (p.detach() + scale * torch.randn(p.shape, generator=g)).contiguous()
        for n, p in model.named_parameters()
    }


async def _sync(eng: VllmEngine, sender: Any, version: int, weights: dict[str, torch.Tensor]) -> Any:
    manifest = sender.publish(version, weights)
    report = await eng.receive_weights(manifest)
    sender.wait()
    return report


def _recompute(
    model: Any, prompt: list[int], ids: np.ndarray, temperature: float, allowed: tuple[int, ...]
) -> np.ndarray:
    batch = TokenBatch.build(
        [np.asarray(prompt, dtype=np.int32)], [ids], [np.asarray(allowed, dtype=np.int32)]
    )
    with torch.no_grad():
        return sequence_logprobs(model, batch, temperature)[0, : len(ids)].numpy()


def test_generation_is_constrained_and_reports_vllms_finish_reason(engine: VllmEngine) -> None:
    g = asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=6, allowed_ids=(100, 101))))
    assert set(g.token_ids.tolist()) <= {100, 101} and len(g.token_ids) == 6
    assert len(g.logprobs) == 6 and (g.logprobs <= 0).all()
    assert g.finish_reason == "length"
    assert (g.versions == engine.weight_version()).all()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_behaviour_logprobs_equal_the_trainers_recompute(
    engine: VllmEngine, hf_model: tuple[Path, Any], temperature: float
) -> None:
    prompt = [1, 5, 9, 14]
    params = SamplingParams(temperature=temperature, max_new_tokens=24, allowed_ids=ALLOWED[:50], seed=7)
    g = asyncio.run(engine.generate(prompt, params))
    want = _recompute(hf_model[1], prompt, g.token_ids, temperature, ALLOWED[:50])
    np.testing.assert_allclose(g.logprobs, want, atol=2e-3, rtol=1e-3)


def test_a_weight_update_lands_mid_generation_and_each_token_records_its_version(
    hf_model: tuple[Path, Any],
) -> None:
    path, model = hf_model
    eng = _engine(path, inflight="keep")
    sender = make_sender("collective", "p", 1 << 20, num_receivers=1, backend="gloo", host="127.0.0.1")
    new = _weights(model, 0.05)

    async def go() -> Any:
        await _sync(eng, sender, 0, _weights(model, 0.0))
        task = asyncio.create_task(
            eng.generate([1, 2], SamplingParams(max_new_tokens=3000, allowed_ids=ALLOWED))
        )
        await asyncio.sleep(0.3)
        start = time.perf_counter()
        report = await _sync(eng, sender, 1, new)
        print(
            f"sync of {report.nbytes / 1e6:.1f} MB: {time.perf_counter() - start:.3f} s, pause {report.pause_s:.3f} s"
        )
        return await task, report

    try:
        g, report = asyncio.run(go())
    finally:
        sender.close()
        eng._llm.shutdown()
    assert report.applied and eng.weight_version() == 1
    versions = g.versions.tolist()
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions), versions[:5]
    # Tokens after the update come from the new weights (their KV recomputed by them too).
    first_new = versions.index(1)
    target = type(model)(model.config).float().eval()
    target.load_state_dict(new)
    prompt_then = [1, 2, *g.token_ids[:first_new].tolist()]
    tail = g.token_ids[first_new : first_new + 16]
    want = _recompute(target, prompt_then, tail, 1.0, ALLOWED)
    np.testing.assert_allclose(g.logprobs[first_new : first_new + 16], want, atol=2e-3, rtol=1e-3)


def test_a_failed_sync_leaves_the_old_version_serving(hf_model: tuple[Path, Any]) -> None:
    path, model = hf_model
    eng = _engine(path, timeout_s=5.0)
    sender = make_sender("collective", "p", 1 << 20, num_receivers=1, backend="gloo", host="127.0.0.1")

    async def go() -> None:
        await _sync(eng, sender, 0, _weights(model, 0.0))
        before = await eng.generate(
            [1, 2, 3], SamplingParams(temperature=0, max_new_tokens=8, allowed_ids=ALLOWED)
        )
        from dataclasses import replace

        assert sender.latest is not None
        nobody = replace(sender.latest, version=1, handle=replace(sender.latest.handle, generation=99))
        with pytest.raises(WeightSyncError):
            await eng.receive_weights(nobody)  # no sender in that group: times out before any load
        assert eng.weight_version() == 0
        after = await eng.generate(
            [1, 2, 3], SamplingParams(temperature=0, max_new_tokens=8, allowed_ids=ALLOWED)
        )
        assert after.token_ids.tolist() == before.token_ids.tolist()

    try:
        asyncio.run(go())
    finally:
        sender.close()
        eng._llm.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_gpu_and_wake_up_serves_the_same_tokens(
    hf_model: tuple[Path, Any], level: int, record_property: Any
) -> None:
    """vLLM's sleep mode around what a training phase would be: device memory freed (measured on the
    worker's GPU), the same seeded tokens after `wake_up`; after level 2 once an update reloaded the
    weights."""
    path, model = hf_model
    eng = _engine(path, sleep_mode=True)
    sender = make_sender("collective", "p", 1 << 20, num_receivers=1, backend="gloo", host="127.0.0.1")
    params = SamplingParams(temperature=0.8, max_new_tokens=16, allowed_ids=ALLOWED, seed=3)

    async def go() -> None:
        await _sync(eng, sender, 0, _weights(model, 0.0))
        before = await eng.generate([1, 2, 3], params)
        report = await eng.sleep(level)
        assert report.freed_bytes > 0
        waiting = asyncio.create_task(eng.generate([1, 2, 3], params))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # held while asleep
        woken = await eng.wake_up()
        assert woken.needs_weights == (level == 2)
        if level == 2:  # the same weights again, as the next version (a collective sender keeps no copy)
            assert eng.weight_version() == -1
            assert (await _sync(eng, sender, 1, _weights(model, 0.0))).applied
            assert eng.weight_version() == 1
        assert (await waiting).token_ids.tolist() == before.token_ids.tolist()
        record_property("level", level)
        record_property("sleep_s", round(report.seconds, 3))
        record_property("wake_s", round(woken.seconds, 3))
        record_property("freed_bytes", report.freed_bytes)
        record_property("restored_bytes", woken.restored_bytes)

    try:
        asyncio.run(go())
    finally:
        sender.close()
        eng._llm.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs two GPUs")
def test_tensor_parallel_engine_syncs_and_matches_one_gpu(hf_model: tuple[Path, Any]) -> None:
    path, model = hf_model
    sender = make_sender("collective", "p", 1 << 20, num_receivers=1, backend="gloo", host="127.0.0.1")
    eng = _engine(path, gpus=2)
    params = SamplingParams(temperature=0.8, max_new_tokens=16, allowed_ids=ALLOWED, seed=3)
    new = _weights(model, 0.05)

    async def go() -> Any:
        await _sync(eng, sender, 0, new)
        return await eng.generate([1, 2, 3], params)

    try:
        g = asyncio.run(go())
    finally:
        sender.close()
        eng._llm.shutdown()
    target = type(model)(model.config).float().eval()
    target.load_state_dict(new)
    np.testing.assert_allclose(
        g.logprobs, _recompute(target, [1, 2, 3], g.token_ids, 0.8, ALLOWED), atol=2e-3
    )


def test_two_policies_as_lora_adapters_one_update_pauses_no_request(
    hf_model: tuple[Path, Any], tmp_path: Path
) -> None:
    """One vLLM engine serving two policies as LoRA adapters (`engines/vllm_lora.py`): policy b's
    request generates throughout a's update, and a's tokens afterwards are what peft gives with a's
    adapter on the same base."""
    import copy

    from peft import PeftModel

    from polyrl_operator.api import Lora
    from polyrl_runtime.engines import vllm_lora

    path, model = hf_model
    loras = {"a": Lora(rank=8, alpha=16, target_modules=["q_proj", "v_proj"]), "b": Lora(rank=16, alpha=16)}
    extra = {"skip_tokenizer_init": True, "gpu_memory_utilization": 0.3, "enforce_eager": True}
    eng = VllmEngine(
        "e0", "a", f"file://{path}", transport="shm", dtype="float32", engine_args=extra, adapters=loras
    )
    layout = vllm_lora.meta_layouts(str(path), False, loras)["a"]
    g = torch.Generator().manual_seed(3)
    tensors = {n: 0.3 * torch.randn(s, generator=g) for n, s in layout.shapes().items()}
    sender = make_sender("shm", "a", 1 << 20)

    async def go() -> Any:
        long_b = asyncio.create_task(
            eng.generate([1, 2], SamplingParams(max_new_tokens=2000, allowed_ids=ALLOWED, policy="b"))
        )
        await asyncio.sleep(0.3)
        tokens_before = eng.stats().tokens
        report = await eng.receive_weights(sender.publish(1, tensors))
        assert report.applied and not long_b.done() and not eng.stats().paused
        a = await eng.generate([1, 2], SamplingParams(max_new_tokens=16, allowed_ids=ALLOWED, policy="a"))
        return a, await long_b, tokens_before

    try:
        a, b, _ = asyncio.run(go())
    finally:
        sender.close()
        eng._llm.shutdown()
    assert a.versions.tolist() == [1] * 16 and set(b.versions.tolist()) == {-1}
    vllm_lora.write_adapter(tmp_path / "a", tensors, layout, loras["a"])
    reference = PeftModel.from_pretrained(copy.deepcopy(model), str(tmp_path / "a")).eval()
    want = _recompute(reference, [1, 2], a.token_ids, 1.0, ALLOWED)
    np.testing.assert_allclose(a.logprobs, want, atol=2e-3, rtol=1e-3)
