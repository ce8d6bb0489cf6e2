"""The torch engine serving a Hugging Face causal LM (the tiny Qwen2, float32, CPU): cached decoding
with continuous batching must give exactly what transformers gives for the whole sequence (greedy
tokens as `model.generate`, behaviour logprobs as the trainer's full forward), also across an
in-flight weight update; stop ids, stop strings and the context limit end replies.

The fixture model's weights are re-drawn with a larger scale: the saved tiny Qwen2 is freshly
initialised (std 0.02), so its greedy replies repeat one token, which would hide ordering or
position mistakes."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from polyrl_runtime.algorithms.losses import TokenBatch, sequence_logprobs
from polyrl_runtime.engines.api import Generation, PromptTooLongError, SamplingParams
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.weights import make_sender
from polyrl_testenv.models import greedy_reply, join_midway

PROMPTS = [[5 + (i * 37 + n) % 300 for i in range(n)] for n in (1, 3, 9, 20, 6, 14)]


def _varied(src: Path, dst: Path, seed: int, *, max_positions: int | None = None) -> Path:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15, generator=gen)
    model.save_pretrained(str(dst))
    for f in src.iterdir():  # the tokenizer files
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, dst / f.name)
    if max_positions is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["max_position_embeddings"] = max_positions
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def model_dirs(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-engine")
    return {
        "a": _varied(tiny_qwen2_dir, root / "a", 1),
        "b": _varied(tiny_qwen2_dir, root / "b", 2),
        "short": _varied(tiny_qwen2_dir, root / "short", 1, max_positions=24),
    }


def _engine(path: Path, **kw: Any) -> TorchEngine:
    return TorchEngine("e0", "solver", f"file://{path}", transport="shm", seed=3, dtype="float32", **kw)


def _hf(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _recomputed(
    model: Any, prompts: list[list[int]], gens: list[Generation], temperature: float
) -> list[Any]:
    batch = TokenBatch.build(
        [np.asarray(p, dtype=np.int32) for p in prompts],
        [g.token_ids for g in gens],
        [np.zeros(0, dtype=np.int32)] * len(gens),
    )
    with torch.no_grad():
        lp = sequence_logprobs(model, batch, temperature).numpy()
    return [lp[i, : len(g.token_ids)] for i, g in enumerate(gens)]


def test_greedy_equals_hf_generate_with_requests_joining_and_leaving(model_dirs: dict[str, Path]) -> None:
    eng = _engine(model_dirs["a"])
    lengths = [25, 8, 30, 5, 17, 12]
    reqs = [
        (p, SamplingParams(temperature=0, max_new_tokens=n)) for p, n in zip(PROMPTS, lengths, strict=True)
    ]
    gens = asyncio.run(join_midway(eng, reqs))
    model = _hf(model_dirs["a"])
    for p, n, g in zip(PROMPTS, lengths, gens, strict=True):
        assert g.token_ids.tolist() == greedy_reply(model, p, n)
        assert g.finish_reason == "length" and (g.versions == -1).all()
    assert len({tuple(g.token_ids.tolist()) for g in gens}) == len(gens)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_a_full_sequence_recompute(
    model_dirs: dict[str, Path], temperature: float
) -> None:
    eng = _engine(model_dirs["a"])
    lengths = [20, 4, 26, 9, 15, 1]
    reqs = [
        (p, SamplingParams(temperature=temperature, max_new_tokens=n, seed=i))
        for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))
    ]
    gens = asyncio.run(join_midway(eng, reqs))
    assert [len(g.token_ids) for g in gens] == lengths
    want = _recomputed(_hf(model_dirs["a"]), PROMPTS, gens, temperature)
    for g, w in zip(gens, want, strict=True):
        np.testing.assert_allclose(g.logprobs, w, atol=1e-4, rtol=0)


def test_each_token_is_fed_once(model_dirs: dict[str, Path]) -> None:
    # Cached decoding: a prefill of the prompt, which also gives the first token, then one
    # single-token step per further token (a full recompute would feed the whole sequence again at
    # every step).
    eng = _engine(model_dirs["a"])
    fed: list[int] = []
    eng.model.register_forward_pre_hook(
        lambda _m, _a, kw: fed.append(int(kw["input_ids"].shape[1])), with_kwargs=True
    )
    prompt = PROMPTS[5]
    gen = asyncio.run(eng.generate(prompt, SamplingParams(temperature=0, max_new_tokens=40)))
    assert gen.token_ids.tolist() == greedy_reply(_hf(model_dirs["a"]), prompt, 40)  # alone: no padding
    assert fed == [len(prompt)] + [1] * 39
    assert eng.stats().extra["forward_passes"] == 40


def _tensors_for(eng: TorchEngine, model: Any) -> dict[str, torch.Tensor]:
    """`model`'s weights under the names the engine's target holds."""
    own = dict(model.named_parameters()) | dict(model.named_buffers())
    return {k: own[k].detach().clone() for k in eng.target.named_tensors()}


def test_weight_update_mid_generation_recomputes_the_cache(model_dirs: dict[str, Path]) -> None:
    eng = _engine(model_dirs["a"])
    new = _hf(model_dirs["b"])
    sender = make_sender("shm", "solver", 1 << 20)
    prompts = [PROMPTS[1], PROMPTS[3]]

    async def go() -> list[Generation]:
        params = SamplingParams(temperature=0, max_new_tokens=24)
        tasks = [asyncio.create_task(eng.generate(p, params)) for p in prompts]
        while not eng._active or len(eng._active[0].tokens) < 6:
            await asyncio.sleep(0.001)
        await eng.pause()
        assert (await eng.receive_weights(sender.publish(1, _tensors_for(eng, new)))).applied
        await eng.resume()
        return list(await asyncio.gather(*tasks))

    try:
        gens = asyncio.run(go())
    finally:
        sender.close()
    old = _hf(model_dirs["a"])
    by_old, by_new = _recomputed(old, prompts, gens, 1e-5), _recomputed(new, prompts, gens, 1e-5)
    for p, g, lo, ln in zip(prompts, gens, by_old, by_new, strict=True):
        v = g.versions
        switch = int((v == -1).sum())
        assert switch >= 6 and (v[switch:] == 1).all() and switch < len(v)
        tokens = g.token_ids.tolist()
        assert tokens[:switch] == greedy_reply(old, p, switch)
        # after the update: what the new weights give for the whole sequence so far
        assert tokens[switch:] == greedy_reply(new, p + tokens[:switch], len(tokens) - switch)
        np.testing.assert_allclose(g.logprobs[:switch], lo[:switch], atol=1e-3, rtol=0)
        np.testing.assert_allclose(g.logprobs[switch:], ln[switch:], atol=1e-3, rtol=0)


def _decode(path: Path, ids: Sequence[int]) -> str:
    return str(
        transformers.AutoTokenizer.from_pretrained(str(path)).decode(list(ids), skip_special_tokens=True)
    )


def test_stop_strings_spanning_several_tokens(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["a"]
    eng = _engine(path)
    prompt = PROMPTS[4]
    free = asyncio.run(eng.generate(prompt, SamplingParams(temperature=0, max_new_tokens=30)))
    assert eng._tokenizer is None  # loaded only for requests with stop strings
    ref = free.token_ids.tolist()
    text = _decode(path, ref)
    stop = text[len(_decode(path, ref[:12])) :][:6]  # six characters from the 13th token on
    assert len(stop) == 6
    end = next(j for j in range(1, 31) if stop in _decode(path, ref[:j]))
    assert stop not in _decode(path, ref[end - 1 : end])  # no single token holds it
    params = SamplingParams(temperature=0, max_new_tokens=30, stop=("never-said", stop))
    got = asyncio.run(eng.generate(prompt, params))
    assert got.token_ids.tolist() == ref[:end]  # the stop string's tokens are kept
    assert got.finish_reason == "stop" and got.stop_str == stop
    assert _decode(path, got.token_ids).endswith(stop) or stop in _decode(path, got.token_ids)


def test_stop_ids_end_the_reply_at_the_first_one(model_dirs: dict[str, Path]) -> None:
    eng = _engine(model_dirs["a"])
    prompt = PROMPTS[2]
    ref = asyncio.run(
        eng.generate(prompt, SamplingParams(temperature=0, max_new_tokens=20))
    ).token_ids.tolist()
    eos = ref[7]
    got = asyncio.run(eng.generate(prompt, SamplingParams(temperature=0, max_new_tokens=20, stop_ids=(eos,))))
    assert got.token_ids.tolist() == ref[: ref.index(eos) + 1]
    assert got.finish_reason == "stop" and got.stop_str == ""


def test_context_limit_from_the_config_and_bad_prompts_fail_alone(model_dirs: dict[str, Path]) -> None:
    eng = _engine(model_dirs["short"])  # max_position_embeddings 24
    assert eng.max_len == 24

    async def go() -> tuple[BaseException | Generation, ...]:
        return tuple(
            await asyncio.gather(
                eng.generate(list(range(3, 27)), SamplingParams(max_new_tokens=4)),
                eng.generate(list(range(3, 23)), SamplingParams(max_new_tokens=50)),
                eng.generate([7, 8], SamplingParams(max_new_tokens=10)),
                eng.generate([7, 320], SamplingParams(max_new_tokens=10)),
                return_exceptions=True,
            )
        )

    too_long, at_limit, other, bad_id = asyncio.run(go())
    assert isinstance(too_long, PromptTooLongError) and isinstance(too_long, ValueError)
    msg = str(too_long)
    assert "solver" in msg and "24 tokens" in msg and "context of 24" in msg
    assert isinstance(at_limit, Generation) and len(at_limit.token_ids) == 4
    assert at_limit.finish_reason == "length"
    assert isinstance(other, Generation) and len(other.token_ids) == 10  # the batch went on
    assert isinstance(bad_id, ValueError) and "solver" in str(bad_id) and "id 320" in str(bad_id)
