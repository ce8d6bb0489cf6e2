"""Several LoRA adapters on one base (`engines/lora_bank.py`), checked against peft holding the same
adapters: each row of a mixed batch gets what peft gives with that row's adapter set."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict

from polyrl_runtime.engines.lora_bank import AdapterLoadError, LoraBank

PREFIX = "base_model.model."
# Ranks, scalings and target modules differ between adapters, and "third" adapts only up_proj.
CONFIGS = {
    "solver": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "verifier": LoraConfig(r=8, lora_alpha=12, target_modules="all-linear"),
    "third": LoraConfig(r=2, lora_alpha=2, target_modules=["up_proj"]),
}


def _base(model_dir: Path) -> torch.nn.Module:
    model: torch.nn.Module = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def _peft(model_dir: Path, seed: int = 0) -> PeftModel:
    names = list(CONFIGS)
    model = get_peft_model(_base(model_dir), CONFIGS[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, CONFIGS[name])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if ".lora_" in key:  # peft starts B at zero: draw both, so every adapter changes outputs
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def _tensors(model: PeftModel, adapter: str) -> dict[str, torch.Tensor]:
    state = get_peft_model_state_dict(model, adapter_name=adapter)
    return {k.removeprefix(PREFIX): v.clone() for k, v in state.items()}


def _scaling(adapter: str) -> float:
    cfg = CONFIGS[adapter]
    return float(cfg.lora_alpha) / float(cfg.r)


def _bank(model_dir: Path, reference: PeftModel) -> LoraBank:
    bank = LoraBank(_base(model_dir))
    for adapter in CONFIGS:
        bank.load(adapter, _tensors(reference, adapter), _scaling(adapter))
    return bank


@torch.no_grad()
def _peft_logits(model: PeftModel, ids: torch.Tensor, adapter: str | None) -> torch.Tensor:
    if adapter is None:
        with model.disable_adapter():
            return model(input_ids=ids).logits
    model.set_adapter(adapter)
    return model(input_ids=ids).logits


IDS = torch.tensor([[5, 9, 14, 3, 22, 7], [1, 2, 3, 4, 5, 6], [40, 41, 42, 8, 9, 10], [7, 7, 7, 7, 7, 7]])
ROWS: list[str | None] = ["verifier", "solver", None, "third"]


def _routed_bank(model_dir: Path) -> tuple[LoraBank, torch.Tensor]:
    """A bank of the three adapters routed to `ROWS`, and its logits for `IDS`."""
    bank = _bank(model_dir, _peft(model_dir))
    bank.route(ROWS)
    with torch.no_grad():
        return bank, bank.model(input_ids=IDS).logits


def test_each_row_of_a_mixed_batch_gets_its_own_adapter(tiny_qwen2_dir: Path) -> None:
    reference = _peft(tiny_qwen2_dir)
    bank = _bank(tiny_qwen2_dir, reference)
    bank.route(ROWS)
    with torch.no_grad():
        mixed = bank.model(input_ids=IDS).logits
    for row, adapter in enumerate(ROWS):
        alone = _peft_logits(reference, IDS[row : row + 1], adapter)
        torch.testing.assert_close(mixed[row : row + 1], alone, rtol=1e-5, atol=1e-5)
    base = _peft_logits(reference, IDS, None)
    assert all(not torch.allclose(mixed[r], base[r], atol=1e-3) for r, a in enumerate(ROWS) if a is not None)


def test_a_new_version_of_one_adapter_leaves_the_other_rows_exactly_as_they_were(
    tiny_qwen2_dir: Path,
) -> None:
    bank, before = _routed_bank(tiny_qwen2_dir)
    newer = _peft(tiny_qwen2_dir, seed=1)
    bank.load("solver", _tensors(newer, "solver"), _scaling("solver"))
    with torch.no_grad():
        after = bank.model(input_ids=IDS).logits
    solver = ROWS.index("solver")
    for row in range(len(ROWS)):
        if row != solver:
            assert torch.equal(after[row], before[row])
    torch.testing.assert_close(
        after[solver : solver + 1],
        _peft_logits(newer, IDS[solver : solver + 1], "solver"),
        rtol=1e-5,
        atol=1e-5,
    )


def test_the_base_keeps_its_parameter_names_and_an_adapter_counts_its_own_bytes(tiny_qwen2_dir: Path) -> None:
    reference = _peft(tiny_qwen2_dir)
    names = [n for n, _ in _base(tiny_qwen2_dir).named_parameters()]
    bank = _bank(tiny_qwen2_dir, reference)
    assert [n for n, _ in bank.model.named_parameters()] == names  # the base's weight sync is unchanged
    assert bank.adapters == list(CONFIGS)
    for adapter in CONFIGS:
        tensors = _tensors(reference, adapter)
        assert bank.nbytes(adapter) == sum(t.numel() * t.element_size() for t in tensors.values())
        assert set(bank.layout(adapter)) == {k.rsplit(".lora_", 1)[0] for k in tensors}


def _changed(
    tensors: dict[str, torch.Tensor], key: str, value: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    out = dict(tensors)
    if value is None:
        del out[key]
    else:
        out[key] = value
    return out


Q_A = "model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: _changed(t, Q_B, None),
            "adapter solver: model.layers.0.self_attn.q_proj.lora_B.weight is missing",
        ),
        (
            lambda t: _changed(t, Q_A, t[Q_A][:, :-1]),
            "adapter solver: model.layers.0.self_attn.q_proj: A (4, 95)",
        ),
        (
            lambda t: _changed(t, "model.norm.weight", t[Q_A]),
            "adapter solver: model.norm.weight is not a LoRA",
        ),
        (
            lambda t: (
                _changed(t, "model.layers.0.nope.lora_A.weight", t[Q_A])
                | {"model.layers.0.nope.lora_B.weight": t[Q_B]}
            ),
            "the model has no linear layer model.layers.0.nope",
        ),
        (
            lambda t: {k: v for k, v in t.items() if ".layers.1." not in k},
            "this version's layout differs from its first at model.layers.1.self_attn.q_proj",
        ),
    ],
    ids=["missing-half", "wrong-shape", "not-lora", "unknown-module", "other-layout"],
)
def test_a_version_that_does_not_fit_is_refused_whole(
    tiny_qwen2_dir: Path, edit: object, message: str
) -> None:
    bank, before = _routed_bank(tiny_qwen2_dir)
    newer = _tensors(_peft(tiny_qwen2_dir, seed=1), "solver")
    assert callable(edit)
    with pytest.raises(AdapterLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        bank.load("solver", edit(newer), _scaling("solver"))
    with torch.no_grad():
        assert torch.equal(bank.model(input_ids=IDS).logits, before)


def test_rows_must_name_loaded_adapters_and_match_the_batch(tiny_qwen2_dir: Path) -> None:
    bank = _bank(tiny_qwen2_dir, _peft(tiny_qwen2_dir))
    with pytest.raises(KeyError, match="no adapter named critic is loaded"):
        bank.route(["solver", "critic"])
    bank.route(["solver"])
    with pytest.raises(ValueError, match="4 rows in the batch, but 1 routed to adapters"), torch.no_grad():
        bank.model(input_ids=IDS)


def test_declared_adapters_serve_the_base_until_loaded_and_then_what_loading_gives(
    tiny_qwen2_dir: Path,
) -> None:
    reference = _peft(tiny_qwen2_dir)
    loaded, before = _routed_bank(tiny_qwen2_dir)
    bank = LoraBank(_base(tiny_qwen2_dir))
    layouts = {a: dict(loaded.layout(a)) for a in CONFIGS}
    bank.declare(layouts)
    assert bank.adapters == list(CONFIGS) and all(bank.layout(a) == layouts[a] for a in CONFIGS)
    bank.route(ROWS)
    with torch.no_grad():  # B is zero: every row gets the base's logits
        assert torch.equal(bank.model(input_ids=IDS).logits, _peft_logits(reference, IDS, None))
    for adapter in CONFIGS:
        bank.load(adapter, _tensors(reference, adapter), _scaling(adapter))
    with torch.no_grad():
        assert torch.equal(bank.model(input_ids=IDS).logits, before)
    with pytest.raises(AdapterLoadError, match="adapter solver is already resident"):
        bank.declare({"solver": layouts["solver"]})


def test_a_copy_is_a_frozen_snapshot_of_its_sources_version(tiny_qwen2_dir: Path) -> None:
    """A copy serves what its source served when copied, after the source's next version (its other
    columns of the bank: equal up to the order of the sums); a second copy into it overwrites it; a
    target of another layout is refused."""
    bank, before = _routed_bank(tiny_qwen2_dir)
    solver = ROWS.index("solver")
    bank.copy("solver", "solver@1")
    assert bank.layout("solver@1") == bank.layout("solver") and bank.nbytes("solver@1") == bank.nbytes(
        "solver"
    )
    newer = _peft(tiny_qwen2_dir, seed=1)
    bank.load("solver", _tensors(newer, "solver"), _scaling("solver"))
    with torch.no_grad():
        bank.route(["solver@1", "solver", None, "third"])
        after = bank.model(input_ids=IDS).logits
        bank.route(["solver@1"] * len(ROWS))
        snapshot = bank.model(input_ids=IDS).logits
    close = {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(snapshot[solver], before[solver], **close)  # the solver's first version
    torch.testing.assert_close(after[1], _peft_logits(newer, IDS[1:2], "solver")[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after[1], before[solver], atol=1e-3)  # the solver moved on
    bank.copy("solver", "solver@1")  # overwritten: now the solver's second version
    with torch.no_grad():
        again = bank.model(input_ids=IDS).logits
    torch.testing.assert_close(again[1], after[1], **close)
    with pytest.raises(AdapterLoadError, match="adapter third: its layout differs from solver's"):
        bank.copy("solver", "third")
    with pytest.raises(KeyError, match="no adapter named gone"):
        bank.copy("gone", "solver@2")
