"""Several policies as LoRA adapters on one torch engine (`engines/adapters.py`), checked against peft
holding the same adapters: a batch that mixes policies gives each request what peft gives with its
policy's adapter; updating one adapter mid-generation changes that policy's requests only; requests
and updates for a policy the engine does not serve are refused by name. Snapshots of past versions
(`engines/torch_snapshots.py`): a request naming one gets what peft gives with that version's adapter,
beside requests of the current version in the same batches; at most `keep` are held, and an evicted
one's requests fail by name."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict

from polyrl_operator.api import Lora
from polyrl_runtime.algorithms.losses import TokenBatch, sequence_logprobs
from polyrl_runtime.engines import hf_cache, torch_engine
from polyrl_runtime.engines.adapters import UnknownAdapterError
from polyrl_runtime.engines.api import Generation, SamplingParams, UnknownSnapshotError
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.models import ModelLoadError
from polyrl_runtime.weights import make_sender
from polyrl_runtime.weights.api import WeightMismatchError
from polyrl_testenv.models import greedy_reply, join_midway, lively_qwen2

PREFIX = "base_model.model."
LORAS = {
    "solver": Lora(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]),
    "verifier": Lora(rank=8, alpha=12, target_modules=["all-linear"]),
}
PROMPTS = [[5 + (i * 37 + n) % 300 for i in range(n)] for n in (1, 3, 9, 20, 6, 14)]
POLICIES = ["solver", "verifier"] * 3


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lively_qwen2(tiny_qwen2_dir, tmp_path_factory.mktemp("adapters") / "base", seed=1)


def _peft(model_dir: Path, seed: int) -> PeftModel:
    """The base with both policies' adapters, every adapter tensor drawn at random (peft starts B at 0)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = None
    for name, lora in LORAS.items():
        targets = "all-linear" if lora.target_modules == ["all-linear"] else list(lora.target_modules)
        config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets)
        if model is None:
            model = get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    assert model is not None
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if ".lora_" in key:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def _tensors(model: PeftModel, adapter: str) -> dict[str, torch.Tensor]:
    state = get_peft_model_state_dict(model, adapter_name=adapter)
    return {k.removeprefix(PREFIX): v.detach().clone() for k, v in state.items()}


def _engine(model_dir: Path) -> TorchEngine:
    return TorchEngine(
        "e0",
        "solver+verifier",
        f"file://{model_dir}",
        transport="shm",
        seed=3,
        dtype="float32",
        adapters=LORAS,
    )


async def _load(eng: TorchEngine, model: PeftModel, versions: dict[str, int]) -> None:
    for policy, version in versions.items():
        sender = make_sender("shm", policy, 1 << 20)
        try:
            assert (await eng.receive_weights(sender.publish(version, _tensors(model, policy)))).applied
        finally:
            sender.close()


def _as(model: PeftModel, adapter: str) -> PeftModel:
    model.set_adapter(adapter)
    return model


def test_a_mixed_batch_gives_each_policy_what_peft_gives_with_its_adapter(model_dir: Path) -> None:
    eng, reference = _engine(model_dir), _peft(model_dir, seed=0)
    lengths = [25, 8, 30, 5, 17, 12]

    async def go() -> tuple[list[Generation], list[Generation]]:
        await _load(eng, reference, {"solver": 1, "verifier": 3})
        greedy = [
            (p, SamplingParams(temperature=0, max_new_tokens=n, policy=policy))
            for p, n, policy in zip(PROMPTS, lengths, POLICIES, strict=True)
        ]
        sampled = [
            (p, SamplingParams(max_new_tokens=12, seed=i, policy=POLICIES[i])) for i, p in enumerate(PROMPTS)
        ]
        return await join_midway(eng, greedy), await join_midway(eng, sampled)

    greedy, sampled = asyncio.run(go())
    version = {"solver": 1, "verifier": 3}
    for p, n, policy, g in zip(PROMPTS, lengths, POLICIES, greedy, strict=True):
        assert g.token_ids.tolist() == greedy_reply(_as(reference, policy), p, n), policy
        assert (g.versions == version[policy]).all()
    assert eng.stats().adapters == version and eng.weight_version() == 1
    for policy in LORAS:  # behaviour logprobs: what the trainer recomputes with the policy's adapter
        rows = [i for i, name in enumerate(POLICIES) if name == policy]
        batch = TokenBatch.build(
            [np.asarray(PROMPTS[i], dtype=np.int32) for i in rows],
            [sampled[i].token_ids for i in rows],
            [np.zeros(0, dtype=np.int32)] * len(rows),
        )
        with torch.no_grad():
            recomputed = sequence_logprobs(_as(reference, policy), batch, 1.0).numpy()
        for k, i in enumerate(rows):
            n = len(sampled[i].token_ids)
            np.testing.assert_allclose(sampled[i].logprobs, recomputed[k, :n], atol=1e-4, rtol=0)


def test_updating_one_adapter_mid_generation_changes_only_that_policys_requests(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng, old, new = _engine(model_dir), _peft(model_dir, seed=0), _peft(model_dir, seed=1)
    prefilled: list[list[int]] = []
    prefill = hf_cache.prefill

    def recording(model: Any, seqs: list[list[int]], pad_id: int) -> Any:
        prefilled.extend(seqs)
        return prefill(model, seqs, pad_id)

    monkeypatch.setattr(torch_engine, "prefill", recording)
    prompts = PROMPTS[1:5]
    policies = POLICIES[1:5]

    async def go() -> list[Generation]:
        await _load(eng, old, {"solver": 1, "verifier": 1})
        prefilled.clear()
        tasks = [
            asyncio.create_task(
                eng.generate(p, SamplingParams(temperature=0, max_new_tokens=24, policy=policy))
            )
            for p, policy in zip(prompts, policies, strict=True)
        ]
        while not eng._active or min(len(r.tokens) for r in eng._active) < 6:
            await asyncio.sleep(0.001)
        await _load(eng, new, {"solver": 2})  # no pause: the verifier's requests keep going
        return list(await asyncio.gather(*tasks))

    gens = asyncio.run(go())
    for p, policy, g in zip(prompts, policies, gens, strict=True):
        started = [s for s in prefilled if s[: len(p)] == p]
        tokens, v = g.token_ids.tolist(), g.versions
        if policy == "verifier":  # untouched: one prefill, one version, the tokens of an undisturbed run
            assert len(started) == 1 and (v == 1).all()
            assert tokens == greedy_reply(_as(old, "verifier"), p, 24)
            continue
        switch = int((v == 1).sum())
        assert 6 <= switch < len(v) and (v[switch:] == 2).all()
        assert len(started) == 2  # its cache rows were computed again under the new adapter
        assert tokens[:switch] == greedy_reply(_as(old, "solver"), p, switch)
        assert tokens[switch:] == greedy_reply(_as(new, "solver"), p + tokens[:switch], len(tokens) - switch)
    assert eng.stats().adapters == {"solver": 2, "verifier": 1}


def test_unknown_policies_and_mismatched_versions_are_refused_by_name(model_dir: Path) -> None:
    eng, reference = _engine(model_dir), _peft(model_dir, seed=0)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_new_tokens=6, policy="solver")

    async def go() -> None:
        # An adapter before its first version serves what the base model gives (B is zero).
        assert (await eng.generate(PROMPTS[2], params)).token_ids.tolist() == greedy_reply(
            base, PROMPTS[2], 6
        )
        with pytest.raises(
            UnknownAdapterError,
            match="serves the adapters of solver, verifier: it holds none for policy 'critic'",
        ):
            await eng.generate(PROMPTS[2], SamplingParams(policy="critic"))
        sender = make_sender("shm", "critic", 1 << 20)
        try:
            with pytest.raises(UnknownAdapterError, match="policy 'critic'"):
                await eng.receive_weights(sender.publish(1, _tensors(reference, "solver")))
        finally:
            sender.close()
        await _load(eng, reference, {"solver": 1})
        sender = make_sender("shm", "solver", 1 << 20)
        try:  # the verifier's tensors (another layout) as the solver's next version: refused whole
            with pytest.raises(
                WeightMismatchError, match="policy solver version 2: weight update rejected at tensor"
            ):
                await eng.receive_weights(sender.publish(2, _tensors(reference, "verifier")))
        finally:
            sender.close()
        assert eng.stats().adapters["solver"] == 1
        got = await eng.generate(PROMPTS[2], params)
        assert got.token_ids.tolist() == greedy_reply(_as(reference, "solver"), PROMPTS[2], 6)

    asyncio.run(go())


def test_adapters_need_a_hugging_face_model_and_a_plain_engine_serves_its_own_policy_only() -> None:
    with pytest.raises(ModelLoadError, match="as LoRA adapters, which needs a Hugging Face model"):
        TorchEngine("e0", "solver", "builtin://tiny", adapters=LORAS)
    plain = TorchEngine("e1", "solver", "builtin://tiny")

    async def go() -> None:
        assert (
            len((await plain.generate([3, 4], SamplingParams(max_new_tokens=2, policy="solver"))).token_ids)
            == 2
        )
        with pytest.raises(ValueError, match="engine e1 serves policy solver, not verifier"):
            await plain.generate([3, 4], SamplingParams(policy="verifier"))

    asyncio.run(go())


def test_an_engine_of_adapters_sleeps_at_level_one_only(model_dir: Path) -> None:
    """Its trainers publish adapters alone: a base dropped at level 2 would never come back."""
    eng = _engine(model_dir)

    async def go() -> None:
        with pytest.raises(ValueError, match="serves LoRA adapters on a base no update resends"):
            await eng.sleep(2)
        assert (await eng.sleep(1)).level == 1
        await eng.wake_up()
        params = SamplingParams(temperature=0, max_new_tokens=3, policy="verifier")
        assert len((await eng.generate(PROMPTS[1], params)).token_ids) == 3

    asyncio.run(go())


def test_the_other_policys_requests_keep_generating_while_an_adapter_version_arrives(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transfer that takes a while (a version fetched over the network) holds no request: the
    verifier's request gains tokens while the solver's version is on its way, and the solver's own
    request goes on under its old adapter until the version is applied."""
    eng, reference = _engine(model_dir), _peft(model_dir, seed=0)
    receive = eng._weight_receiver.receive
    progress: dict[str, int] = {}

    def slow_receive(manifest: Any, target: Any) -> Any:
        before = {r.params.policy: len(r.tokens) for r in eng._active}
        time.sleep(0.3)  # the fetch, before the version is applied under the serving lock
        progress.update({r.params.policy: len(r.tokens) - before[r.params.policy] for r in eng._active})
        return receive(manifest, target)

    async def go() -> list[Generation]:
        await _load(eng, reference, {"solver": 1, "verifier": 1})
        monkeypatch.setattr(eng._weight_receiver, "receive", slow_receive)
        params = {p: SamplingParams(temperature=0, max_new_tokens=1500, policy=p) for p in LORAS}
        tasks = [asyncio.create_task(eng.generate(PROMPTS[1], params[p])) for p in LORAS]
        while len(eng._active) < 2 or min(len(r.tokens) for r in eng._active) < 2:
            await asyncio.sleep(0.001)
        await _load(eng, _peft(model_dir, seed=1), {"solver": 2})
        return list(await asyncio.gather(*tasks))

    solver, verifier = asyncio.run(go())
    assert progress["verifier"] > 0 and progress["solver"] > 0, progress
    assert (verifier.versions == 1).all() and solver.versions[-1] == 2


def test_a_frozen_policy_of_the_base_is_served_the_base_alone_beside_the_adapters(model_dir: Path) -> None:
    """`base_policies`: a frozen policy's rows, in the same batches as the adapters' rows, get the
    base model's replies at the base's version (-1: as loaded, never updated, what a frozen policy's
    own engine labels its tokens with), before and after the adapters' updates; it has no
    adapter in the engine's stats and a version naming it is refused."""
    eng = TorchEngine(
        "e0",
        "solver",
        f"file://{model_dir}",
        transport="shm",
        seed=3,
        dtype="float32",
        adapters=LORAS,
        base_policies=("judge",),
    )
    first, second = _peft(model_dir, seed=0), _peft(model_dir, seed=1)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    policies = ["judge", "solver", "judge", "verifier", "judge", "solver"]

    async def mixed() -> list[Generation]:
        batch = [
            (p, SamplingParams(temperature=0, max_new_tokens=10, policy=policy))
            for p, policy in zip(PROMPTS, policies, strict=True)
        ]
        return await join_midway(eng, batch)

    async def go() -> list[tuple[dict[str, int], list[Generation]]]:
        out = []
        for model, versions in ((first, {"solver": 1, "verifier": 1}), (second, {"solver": 2})):
            await _load(eng, model, versions)
            out.append((dict(eng.stats().adapters), await mixed()))
        sender = make_sender("shm", "judge", 1 << 20)
        try:
            with pytest.raises(UnknownAdapterError, match="it holds none for policy 'judge'"):
                await eng.receive_weights(sender.publish(1, _tensors(first, "solver")))
        finally:
            sender.close()
        return out

    rounds = asyncio.run(go())
    assert [adapters for adapters, _ in rounds] == [
        {"solver": 1, "verifier": 1},
        {"solver": 2, "verifier": 1},
    ]
    for (_, gens), model in zip(rounds, (first, second), strict=True):
        for p, policy, g in zip(PROMPTS, policies, gens, strict=True):
            if policy == "judge":  # the base as loaded, unchanged by the adapters' versions
                assert g.token_ids.tolist() == greedy_reply(base, p, 10)
                assert (g.versions == -1).all()
            elif policy == "solver":
                assert g.token_ids.tolist() == greedy_reply(_as(model, "solver"), p, 10)
    assert eng.weight_version() == 1  # the oldest adapter's: the judge has none
    with pytest.raises(ValueError, match="policy solver is given an adapter and the base alone"):
        TorchEngine("e1", "solver", f"file://{model_dir}", adapters=LORAS, base_policies=("solver", "judge"))
    with pytest.raises(ValueError, match="served the base alone need a shared base's adapters"):
        TorchEngine("e2", "judge", f"file://{model_dir}", base_policies=("judge",))


# -- snapshots of past versions (engines/torch_snapshots.py) -----------------------------------


def _greedy(n: int, snapshot: int | None, policy: str = "solver") -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, policy=policy, snapshot=snapshot)


def test_a_snapshot_serves_its_version_beside_the_current_one(model_dir: Path) -> None:
    eng, first, second = _engine(model_dir), _peft(model_dir, seed=0), _peft(model_dir, seed=1)
    snapshots = [None, 1, None, 1, 1, None]

    async def go() -> list[object]:
        await _load(eng, first, {"solver": 1, "verifier": 1})
        report = await eng.snapshot("solver", 2)
        assert (report.version, report.held, report.evicted) == (1, (1,), ())
        assert report.nbytes == eng.adapters.bank.nbytes("solver")  # type: ignore[union-attr]
        assert (await eng.snapshot("solver", 2)).held == (1,)  # the same version again: nothing to do
        await _load(eng, second, {"solver": 2})
        return await join_midway(eng, [(p, _greedy(12, s)) for p, s in zip(PROMPTS, snapshots, strict=True)])

    gens = asyncio.run(go())
    for p, s, g in zip(PROMPTS, snapshots, gens, strict=True):
        version, model = (1, first) if s == 1 else (2, second)
        assert g.token_ids.tolist() == greedy_reply(_as(model, "solver"), p, 12), s  # type: ignore[attr-defined]
        assert (g.versions == version).all()  # type: ignore[attr-defined]
    st = eng.stats()
    assert st.adapters == {"solver": 2, "verifier": 1} and st.snapshots == {"solver": [1]}


def test_keep_evicts_the_oldest_and_fails_its_requests_by_name(model_dir: Path) -> None:
    eng, first, second = _engine(model_dir), _peft(model_dir, seed=0), _peft(model_dir, seed=1)

    async def go() -> None:
        await _load(eng, first, {"solver": 1, "verifier": 1})
        await eng.snapshot("solver", 1)
        await _load(eng, second, {"solver": 2})
        playing = asyncio.create_task(eng.generate(PROMPTS[3], _greedy(200, 1)))
        current = asyncio.create_task(eng.generate(PROMPTS[2], _greedy(30, None, "verifier")))
        while not eng._active or min(len(r.tokens) for r in eng._active) < 3:
            await asyncio.sleep(0.001)
        report = await eng.snapshot("solver", 1)
        assert (report.version, report.held, report.evicted) == (2, (2,), (1,))
        with pytest.raises(
            UnknownSnapshotError, match=r"no snapshot of policy 'solver' at version 1 \(it holds: 2\)"
        ):
            await playing
        g = await asyncio.wait_for(current, 60)  # the other rows of the batch went on
        assert g.token_ids.tolist() == greedy_reply(_as(first, "verifier"), PROMPTS[2], 30)
        with pytest.raises(UnknownSnapshotError, match="at version 1"):
            await eng.generate(PROMPTS[0], _greedy(4, 1))  # refused before it joins a batch
        again = await eng.generate(PROMPTS[0], _greedy(6, 2))
        assert again.token_ids.tolist() == greedy_reply(_as(second, "solver"), PROMPTS[0], 6)
        await asyncio.sleep(0.01)
        st = eng.stats()
        assert st.snapshots == {"solver": [2]} and st.aborted == 0 and st.in_flight == 0

    asyncio.run(go())


def test_what_cannot_hold_a_snapshot_is_refused_by_name(model_dir: Path) -> None:
    eng = _engine(model_dir)

    async def go() -> None:
        with pytest.raises(UnknownAdapterError, match="it holds none for policy 'judge'"):
            await eng.snapshot("judge", 2)
        with pytest.raises(ValueError, match="keep must be at least 1, got 0"):
            await eng.snapshot("solver", 0)
        with pytest.raises(UnknownSnapshotError, match=r"version 0 \(it holds: none\)"):
            await eng.generate(PROMPTS[0], _greedy(4, 0))

    asyncio.run(go())
    with pytest.raises(ValueError, match="snapshot must be a weight version >= 0, got -1"):
        SamplingParams(snapshot=-1)
    assert set(LORAS) == {"solver", "verifier"}


def test_an_engine_that_joins_serves_copies_of_anothers_snapshots_bit_for_bit(model_dir: Path) -> None:
    old, new = _engine(model_dir), _engine(model_dir)
    first, second, third = (_peft(model_dir, seed=s) for s in (0, 1, 2))
    snapshots = [1, 2, None, 1, 2, None]

    async def go() -> list[object]:
        await _load(old, first, {"solver": 1, "verifier": 1})
        await old.snapshot("solver", 3)
        await _load(old, second, {"solver": 2})
        await old.snapshot("solver", 3)
        with pytest.raises(UnknownSnapshotError, match="at version 7"):
            await old.snapshot_state("solver", [7])
        states = await old.snapshot_state("solver", [1, 2])
        await _load(new, third, {"solver": 3, "verifier": 1})  # the joined engine's current version
        report = await new.load_snapshots("solver", states, 3)
        assert (report.held, report.evicted, report.nbytes) == (
            (1, 2),
            (),
            2 * new.adapters.bank.nbytes("solver"),
        )  # type: ignore[union-attr]
        assert (await new.load_snapshots("solver", states, 3)).held == (1, 2)  # held already: nothing to do
        return await join_midway(new, [(p, _greedy(12, s)) for p, s in zip(PROMPTS, snapshots, strict=True)])

    gens = asyncio.run(go())
    for p, s, g in zip(PROMPTS, snapshots, gens, strict=True):
        model = {1: first, 2: second, None: third}[s]
        assert g.token_ids.tolist() == greedy_reply(_as(model, "solver"), p, 12), s  # type: ignore[attr-defined]
    # keep bounds the copies too: the oldest goes, and a copy older than all kept is not taken
    report = asyncio.run(new.load_snapshots("solver", {0: states_of(old, 1)}, 2))
    assert report.held == (1, 2) and report.evicted == ()
    report = asyncio.run(new.load_snapshots("solver", {5: states_of(old, 1)}, 2))
    assert report.held == (2, 5) and report.evicted == (1,)
    assert new.stats().snapshots == {"solver": [2, 5]}


def states_of(eng: TorchEngine, version: int) -> dict[str, torch.Tensor]:
    return asyncio.run(eng.snapshot_state("solver", [version]))[version]
