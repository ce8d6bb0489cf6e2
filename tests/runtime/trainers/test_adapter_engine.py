"""Several policies' adapters on one base held once: each policy's step, schedule and checkpoint are
its own, and the base and the other adapters stay bit-exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.trainers.adapter_engine import AdapterEngine, SharedBase
from polyrl_runtime.trainers.build import set_learning_rate
from polyrl_runtime.trainers.lora import LoraError
from polyrl_runtime.trainers.publish import adapter_tensors

CPU = torch.device("cpu")


def _policy(name: str, uri: str, micro: int = 2, **lora: Any) -> Policy:
    return Policy.model_validate(
        {
            "name": name,
            "model": {"uri": uri, "dtype": "float32"},
            "algorithm": {"lr": 1e-2, "lora": {"rank": 4, "alpha": 8, **lora}},
            "trainer": {"microBatchSize": micro},
        }
    )


def _shared(model_dir: Path) -> tuple[SharedBase, dict[str, AdapterEngine]]:
    uri = f"file://{model_dir}"
    policies = [
        _policy("solver", uri),
        _policy("verifier", uri, rank=8, alpha=16, targetModules=["q_proj", "v_proj"]),
    ]
    torch.manual_seed(0)
    shared = SharedBase.build(policies, seed=0, cuda=False, device=CPU)
    return shared, {p.name: AdapterEngine(shared, p) for p in policies}


def _step(shared: SharedBase, engine: AdapterEngine, seed: int = 1) -> None:
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(seed))
    with shared.active(engine.policy):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_the_base_is_held_once_with_one_adapter_per_policy(tiny_qwen2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    shared, _ = _shared(tiny_qwen2_dir)
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32)
    base = sum(p.numel() for n, p in shared.model.named_parameters() if ".lora_" not in n)
    assert base == sum(p.numel() for p in plain.parameters())
    solver = shared.adapter_parameters("solver")
    verifier = shared.adapter_parameters("verifier")
    assert solver and verifier and not {n for n, _ in solver} & {n for n, _ in verifier}
    assert all("q_proj" in n or "v_proj" in n for n, _ in verifier)  # its own target modules
    assert {p.shape[0] for n, p in verifier if ".lora_A." in n} == {8}  # and its own rank
    assert {p.shape[0] for n, p in solver if ".lora_A." in n} == {4}


def test_a_policys_step_changes_its_adapter_and_nothing_else(tiny_qwen2_dir: Path) -> None:
    shared, engines = _shared(tiny_qwen2_dir)
    before = _snapshot(shared.model)
    _step(shared, engines["solver"])
    after = _snapshot(shared.model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(".lora_" in n and ".solver." in n for n in changed)
    assert engines["solver"].get_global_grad_norm() is not None
    with shared.active("verifier"):  # the other policy's adapter is the one trained now
        assert all(p.requires_grad for _, p in shared.adapter_parameters("verifier"))
        assert not any(p.requires_grad for _, p in shared.adapter_parameters("solver"))


def test_each_policy_has_its_own_learning_rate_and_optimizer_state(tiny_qwen2_dir: Path) -> None:
    shared, engines = _shared(tiny_qwen2_dir)
    set_learning_rate(engines["solver"].optimizer, 0.5)
    set_learning_rate(engines["verifier"].optimizer, 0.0)
    _step(shared, engines["verifier"])
    assert engines["verifier"].optimizer.param_groups[0]["lr"] == 0.0
    assert engines["solver"].optimizer.param_groups[0]["lr"] == 0.5
    assert not engines["solver"].optimizer.state  # the solver has taken no step
    assert len(engines["verifier"].optimizer.state) == len(shared.adapter_parameters("verifier"))


def test_gradients_accumulate_until_the_batch_is_complete(tiny_qwen2_dir: Path) -> None:
    shared, engines = _shared(tiny_qwen2_dir)
    solver = engines["solver"]
    solver.set_train_batch_size(2 * 3)  # micro-batches of 2: three of them per optimizer step
    before = solver.adapter_state()
    _step(shared, solver, seed=1)
    _step(shared, solver, seed=2)
    assert all(torch.equal(before[n], t) for n, t in solver.adapter_state().items())
    _step(shared, solver, seed=3)
    assert any(not torch.equal(before[n], t) for n, t in solver.adapter_state().items())


def test_gradients_are_clipped_to_max_grad_norm(tiny_qwen2_dir: Path) -> None:
    moved = {}
    for clip in (0.0, 1e-12):  # 0: no clipping
        shared, engines = _shared(tiny_qwen2_dir)
        solver = engines["solver"]
        solver.max_grad_norm = clip
        before = solver.adapter_state()
        _step(shared, solver)
        moved[clip] = max(float((t - before[n]).abs().max()) for n, t in solver.adapter_state().items())
        norm = solver.get_global_grad_norm()
        assert norm is not None and norm > 1e-6  # the norm reported is the one before clipping
    # AdamW's step is about lr whatever the gradients' scale, unless they are far below its epsilon
    assert moved[0.0] > 1e-3 and moved[1e-12] < moved[0.0] / 100


def test_a_policys_checkpoint_restores_into_a_fresh_shared_base(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    shared, engines = _shared(tiny_qwen2_dir)
    _step(shared, engines["solver"])
    engines["solver"].save_checkpoint(str(tmp_path), tag="step-1", client_state={"version": 1})
    saved = engines["solver"].adapter_state()
    _step(shared, engines["solver"], seed=5)  # moves on after the checkpoint

    _, fresh_engines = _shared(tiny_qwen2_dir)
    verifier_before = fresh_engines["verifier"].adapter_state()
    path, client = fresh_engines["solver"].load_checkpoint(str(tmp_path), tag="step-1")
    assert client == {"version": 1} and path.endswith("adapter-rank0.pt")
    restored = fresh_engines["solver"].adapter_state()
    assert restored.keys() == saved.keys()
    assert all(torch.equal(saved[n], restored[n]) for n in saved)
    assert fresh_engines["solver"].optimizer.state  # AdamW's moments came back too
    after = fresh_engines["verifier"].adapter_state()
    assert all(torch.equal(verifier_before[n], after[n]) for n in after)


def test_a_checkpoint_of_another_adapter_shape_is_refused_naming_the_policy(
    tiny_qwen2_dir: Path, tmp_path: Path
) -> None:
    _, engines = _shared(tiny_qwen2_dir)
    engines["solver"].save_checkpoint(str(tmp_path), tag="t", client_state={})
    uri = f"file://{tiny_qwen2_dir}"
    other = SharedBase.build(
        [_policy("solver", uri, targetModules=["q_proj"])], seed=0, cuda=False, device=CPU
    )
    with pytest.raises(LoraError, match=r"policy solver: the adapter checkpoint .* does not match"):
        AdapterEngine(other, other.policies["solver"]).load_checkpoint(str(tmp_path), tag="t")
    with pytest.raises(FileNotFoundError, match="policy solver: no adapter checkpoint"):
        engines["solver"].load_checkpoint(str(tmp_path), tag="absent")


def test_the_published_adapter_is_the_active_policys(tiny_qwen2_dir: Path) -> None:
    shared, engines = _shared(tiny_qwen2_dir)
    _step(shared, engines["verifier"])
    with shared.active("verifier"):
        published = adapter_tensors(shared.model)
    own = engines["verifier"].adapter_state()
    assert len(published) == len(own)
    assert sorted(t.shape for t in published.values()) == sorted(t.shape for t in own.values())
    assert all(".verifier." not in n for n in published)  # under the names the engine loads


def test_policies_that_cannot_share_a_base_are_refused_with_the_field_named(tiny_qwen2_dir: Path) -> None:
    uri = f"file://{tiny_qwen2_dir}"
    plain = Policy.model_validate({"name": "judge", "model": {"uri": uri, "dtype": "float32"}})
    with pytest.raises(LoraError, match=r"policy judge: sharing a base model needs algorithm\.lora"):
        SharedBase.build([_policy("solver", uri), plain], seed=0, cuda=False, device=CPU)
    bf16 = _policy("verifier", uri).model_copy(deep=True)
    bf16.model.dtype = "bfloat16"
    with pytest.raises(LoraError, match=r"policy verifier: model .* differs from policy solver's"):
        SharedBase.build([_policy("solver", uri), bf16], seed=0, cuda=False, device=CPU)
    shared, _ = _shared(tiny_qwen2_dir)
    with pytest.raises(KeyError, match="no adapter for policy 'judge'"), shared.active("judge"):
        pass
