"""The torch engine in-process (no Ray): constrained decoding, stops, batching, and weight updates
that land between two tokens of an unfinished generation (partial rollouts keep per-token versions).
The engine decodes with a KV cache; its behaviour logprobs must be what the trainer computes for the
same tokens with a full forward pass, also across weight updates."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from polyrl_runtime.algorithms.losses import TokenBatch, sequence_logprobs
from polyrl_runtime.engines.api import Generation, SamplingParams
from polyrl_runtime.engines.sampling import constrained_logprobs, inverse_cdf, sample_batch
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.engines.torch_request import TorchRequest
from polyrl_runtime.models.tiny import build_tiny
from polyrl_runtime.weights import make_sender


def _engine(**kw: object) -> TorchEngine:
    return TorchEngine("e0", "p", "builtin://tiny", transport="shm", seed=3, **kw)  # type: ignore[arg-type]


def test_constrained_decoding_length_and_stop() -> None:
    eng = _engine()

    async def go() -> None:
        g = await eng.generate([1, 10, 11], SamplingParams(max_new_tokens=7, allowed_ids=(30, 31, 32)))
        assert len(g.token_ids) == 7 and set(g.token_ids.tolist()) <= {30, 31, 32}
        assert g.finish_reason == "length" and len(g.logprobs) == len(g.versions) == 7
        assert (g.logprobs <= 0).all()
        # only the stop token allowed: it is produced first and ends the generation
        s = await eng.generate([1, 10], SamplingParams(max_new_tokens=9, allowed_ids=(2,), stop_ids=(2,)))
        assert s.token_ids.tolist() == [2] and s.finish_reason == "stop"
        greedy = [
            await eng.generate([1, 12, 13], SamplingParams(temperature=0, max_new_tokens=4)) for _ in range(2)
        ]
        assert greedy[0].token_ids.tolist() == greedy[1].token_ids.tolist()
        with pytest.raises(ValueError, match="empty prompt"):
            await eng.generate([], SamplingParams())

    asyncio.run(go())


def test_concurrent_requests_share_forward_passes() -> None:
    eng = _engine()

    async def go() -> None:
        outs = await asyncio.gather(
            *(eng.generate([1, 10 + i % 5], SamplingParams(max_new_tokens=1 + i % 3)) for i in range(40))
        )
        assert [len(o.token_ids) for o in outs] == [1 + i % 3 for i in range(40)]

    asyncio.run(go())
    st = eng.stats()
    assert st.requests == 40 and st.tokens == sum(1 + i % 3 for i in range(40)) and st.in_flight == 0
    # continuous batching: far fewer forward passes than tokens
    assert st.extra["forward_passes"] < st.tokens / 4


def test_weight_update_lands_mid_generation_and_versions_are_recorded() -> None:
    eng = _engine()
    sender = make_sender("shm", "p", 1 << 20)
    try:
        v0 = sender.publish(0, dict(eng.target.named_tensors()))
        other = build_tiny("tiny", 64, seed=99)
        v1_tensors = {k: p.detach().clone() for k, p in other.named_parameters()}

        async def go() -> list[int]:
            assert (await eng.receive_weights(v0)).applied
            task = asyncio.create_task(eng.generate([1, 10], SamplingParams(max_new_tokens=30)))
            while not eng._active or len(eng._active[0].tokens) < 3:
                await asyncio.sleep(0.001)
            await eng.pause()
            v1 = sender.publish(1, v1_tensors)
            assert (await eng.receive_weights(v1)).applied
            await eng.resume()
            return (await task).versions.tolist()

        versions = asyncio.run(go())
    finally:
        sender.close()
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert eng.weight_version() == 1


def _trainer_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], gens: list[Generation], allowed: list[tuple[int, ...]]
) -> list[np.ndarray]:
    """What the trainer computes for these tokens: one full forward, no cache."""
    batch = TokenBatch.build(
        [np.asarray(p, dtype=np.int32) for p in prompts],
        [g.token_ids for g in gens],
        [np.asarray(a, dtype=np.int32) for a in allowed],
    )
    with torch.no_grad():
        lp = sequence_logprobs(model, batch).numpy()
    return [lp[i, : len(g.token_ids)] for i, g in enumerate(gens)]


def test_cached_logprobs_match_the_trainers_full_forward() -> None:
    eng = _engine()
    prompts = [[1, *range(10, 10 + n)] for n in (0, 3, 9, 1, 20, 5)]
    allowed = [(), (30, 31, 32), (), (2, 40), (), (5, 6)]
    lengths = [12, 3, 30, 7, 40, 1]

    async def go() -> list[Generation]:
        first = [
            eng.generate(p, SamplingParams(max_new_tokens=n, allowed_ids=a))
            for p, a, n in zip(prompts[:3], allowed[:3], lengths[:3], strict=True)
        ]
        tasks = [asyncio.create_task(c) for c in first]
        while not eng._active or len(eng._active[0].tokens) < 2:  # later requests join a running batch
            await asyncio.sleep(0.001)
        rest = [
            eng.generate(p, SamplingParams(max_new_tokens=n, allowed_ids=a))
            for p, a, n in zip(prompts[3:], allowed[3:], lengths[3:], strict=True)
        ]
        return list(await asyncio.gather(*tasks, *rest))

    gens = asyncio.run(go())
    assert [len(g.token_ids) for g in gens] == lengths
    for got, want in zip(gens, _trainer_logprobs(eng.model, prompts, gens, allowed), strict=True):
        np.testing.assert_allclose(got.logprobs, want, rtol=1e-4, atol=1e-5)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch() -> None:
    params = SamplingParams(max_new_tokens=12, seed=11)

    async def alone() -> list[int]:
        return [int(t) for t in (await _engine().generate([1, 14, 15], params)).token_ids]

    async def batched() -> list[int]:
        eng = _engine()
        others = [eng.generate([1, 20 + i] * (1 + i), SamplingParams(max_new_tokens=5 + i)) for i in range(6)]
        outs = await asyncio.gather(*others, eng.generate([1, 14, 15], params))
        return [int(t) for t in outs[-1].token_ids]

    assert asyncio.run(alone()) == asyncio.run(alone()) == asyncio.run(batched())


def _generate_across_updates(
    eng: TorchEngine,
    prompts: list[list[int]],
    max_new_tokens: int,
    updates: list[tuple[int, int, torch.nn.Module]],
) -> list[Generation]:
    """Generate `prompts` while applying each (tokens, version, model) update through `shm` once the
    first request has that many tokens, and at least one more than at the update before (however
    late this loop wakes, every version serves a token): the engine pauses, receives the version and
    resumes."""
    sender = make_sender("shm", "p", 1 << 20)

    async def go() -> list[Generation]:
        params = SamplingParams(max_new_tokens=max_new_tokens)
        tasks = [asyncio.create_task(eng.generate(p, params)) for p in prompts]
        before = 0  # the first request's tokens at the previous update
        for tokens, version, model in updates:
            while not eng._active or len(eng._active[0].tokens) < max(tokens, before + 1):
                if all(t.done() for t in tasks):
                    raise AssertionError(f"the requests finished before version {version} was sent")
                await asyncio.sleep(0.001)
            before = len(eng._active[0].tokens)
            await eng.pause()
            tensors = {k: p.detach().clone() for k, p in model.named_parameters()}
            assert (await eng.receive_weights(sender.publish(version, tensors))).applied
            await eng.resume()
        return list(await asyncio.gather(*tasks))

    try:
        return asyncio.run(go())
    finally:
        sender.close()


def test_tokens_after_a_weight_update_are_computed_with_the_new_weights() -> None:
    # In-flight requests' cached keys/values were computed with the old weights: the engine must
    # recompute them, so each token's logprob is the full forward of the weights of its version.
    eng = _engine()
    old = build_tiny("tiny", 64, seed=3).eval()  # the engine's initial weights (same seed)
    new = build_tiny("tiny", 64, seed=99).eval()
    prompts = [[1, 10], [1, 11, 12, 13]]
    gens = _generate_across_updates(eng, prompts, 20, [(4, 1, new)])
    allowed: list[tuple[int, ...]] = [(), ()]
    by_old = _trainer_logprobs(old, prompts, gens, allowed)
    by_new = _trainer_logprobs(new, prompts, gens, allowed)
    for g, lo, ln in zip(gens, by_old, by_new, strict=True):
        v = g.versions
        assert (v == -1).any() and (v == 1).any()
        np.testing.assert_allclose(g.logprobs[v == -1], lo[v == -1], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(g.logprobs[v == 1], ln[v == 1], rtol=1e-4, atol=1e-5)


def test_batched_sampling_logprobs_follow_the_single_row_convention() -> None:
    eng = _engine()
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        SamplingParams(allowed_ids=(3, 7, 9)),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=0, allowed_ids=(1, 2)),
        SamplingParams(top_p=0.5, seed=4),
    ]

    async def requests() -> list[TorchRequest]:
        loop = asyncio.get_running_loop()
        return [TorchRequest([1], p, loop.create_future()) for p in params]

    batch = asyncio.run(requests())
    tokens, logprobs = sample_batch(batch, logits, eng._rng)
    assert tokens[0] in (3, 7, 9) and tokens[2] in (1, 2)
    for i, p in enumerate(params):
        allowed = torch.tensor(p.allowed_ids, dtype=torch.long) if p.allowed_ids else None
        want = constrained_logprobs(logits[i], p.temperature, allowed)[tokens[i]]
        assert logprobs[i] == pytest.approx(float(want), abs=1e-6)


def test_generate_many_streams_each_answer_as_it_finishes() -> None:
    eng = _engine()
    prompts = [[1, *range(10, 10 + n)] for n in (4, 0, 9, 2)]
    lengths = [30, 2, 12, 1]
    requests = [(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, lengths, strict=True)]

    async def go() -> list[list[tuple[int, Generation | BaseException]]]:
        return [item async for item in eng.generate_many([*requests, ([], SamplingParams())])]

    items = asyncio.run(go())
    order = [i for item in items for i, _ in item]
    assert sorted(order) == [0, 1, 2, 3, 4] and order.index(0) > order.index(2) > order.index(3)
    answers = dict(a for item in items for a in item)
    assert isinstance(answers.pop(4), ValueError)  # a bad request fails alone, the others go on
    gens = [answers[i] for i in range(4)]
    assert all(isinstance(g, Generation) for g in gens)
    assert [len(g.token_ids) for g in gens if isinstance(g, Generation)] == lengths
    want = _trainer_logprobs(eng.model, prompts, gens, [()] * 4)  # type: ignore[arg-type]
    for got, w in zip(gens, want, strict=True):
        assert isinstance(got, Generation)
        np.testing.assert_allclose(got.logprobs, w, rtol=1e-4, atol=1e-5)


def test_repeated_updates_swap_weights_and_each_token_uses_its_versions_weights() -> None:
    # The engine's target swaps its parameters to views of alternating staging buffers; three
    # updates mid-generation reuse a buffer that served before. Each token must still be exactly
    # what its version's weights give (the KV cache is recomputed after every update).
    eng = _engine()
    assert eng.target.swappable
    models = {-1: build_tiny("tiny", 64, seed=3).eval()}
    for v, seed in ((1, 99), (2, 5), (3, 3)):
        models[v] = build_tiny("tiny", 64, seed=seed).eval()
    prompts = [[1, 10], [1, 11, 12, 13]]
    gens = _generate_across_updates(eng, prompts, 24, [(5 * v, v, models[v]) for v in (1, 2, 3)])
    allowed: list[tuple[int, ...]] = [(), ()]
    seen = set()
    for v, m in models.items():
        expected = _trainer_logprobs(m, prompts, gens, allowed)
        for g, lp in zip(gens, expected, strict=True):
            mask = g.versions == v
            seen.update(g.versions.tolist())
            np.testing.assert_allclose(g.logprobs[mask], lp[mask], rtol=1e-4, atol=1e-5)
    assert seen == {-1, 1, 2, 3}
    assert all(torch.equal(p, models[3].get_parameter(k)) for k, p in eng.model.named_parameters())


def test_seeded_rows_draw_from_their_distribution_and_only_allowed_ids() -> None:
    probs = torch.tensor([0.0, 0.5, 0.3, 0.0, 0.2])  # ids 0 and 3 are not allowed (probability 0)
    lp = probs.log().expand(4000, -1)

    async def requests() -> list[TorchRequest]:
        loop = asyncio.get_running_loop()
        return [TorchRequest([1], SamplingParams(seed=i), loop.create_future()) for i in range(4000)]

    rows = asyncio.run(requests())
    for r in rows:
        r.generator = torch.Generator().manual_seed(r.params.seed or 0)
    drawn = torch.tensor(inverse_cdf(lp, rows))
    counts = torch.bincount(drawn, minlength=5).float() / len(rows)
    assert counts[0] == 0 and counts[3] == 0
    torch.testing.assert_close(counts, probs, atol=0.03, rtol=0)  # 4000 draws: sd below 0.008
    # The same seeds give the same tokens in any grouping of the rows.
    again = asyncio.run(requests())[:7]
    for r in again:
        r.generator = torch.Generator().manual_seed(r.params.seed or 0)
    assert inverse_cdf(lp[:7], again) == drawn[:7].tolist()
