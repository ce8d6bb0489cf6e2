"""Bit-exact tensor deltas (`weights/delta.py`): every round trip equals the new tensor bit for bit, the
bytes follow the changed fraction (at most 1.5x it plus 1% of the tensor), a delta larger than the tensor
is the tensor, and a delta applied to the wrong base or damaged fails naming the tensor."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from polyrl_runtime.weights.delta import DeltaError, TensorDelta, apply_delta, checksum, make_delta


def _changed(base: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    """`base` with `fraction` of its elements (spread at random) set to other values."""
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    flat = new.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[: round(fraction * flat.numel())]
    flat[idx] = flat[idx] + torch.randn(idx.numel(), generator=g).to(flat.dtype) + 1
    return new


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and checksum(a) == checksum(b)
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.1, 1.0])
def test_a_delta_reproduces_the_new_tensor_bit_for_bit(dtype: torch.dtype, fraction: float) -> None:
    base = torch.randn(256, 384, generator=torch.Generator().manual_seed(1)).to(dtype)
    new = _changed(base, fraction)
    delta = make_delta("w", base, new)
    assert delta.changed == int((base.view(-1) != new.view(-1)).sum())
    assert _same_bits(apply_delta(delta, base), new)
    assert delta.full == (fraction == 1.0)  # a delta of everything is larger than the tensor


@pytest.mark.parametrize(("fraction", "bound"), [(0.01, 0.025), (0.1, 0.16)])
def test_the_bytes_follow_the_changed_fraction(fraction: float, bound: float) -> None:
    """At most 1.5x the changed fraction plus 1% of the tensor (bfloat16: 2 bytes an element)."""
    base = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    delta = make_delta("w", base, _changed(base, fraction))
    ratio = delta.nbytes / (base.numel() * base.element_size())
    assert fraction <= ratio <= bound, ratio


def test_bits_differ_where_values_compare_equal() -> None:
    """-0.0 == 0.0 and NaN != NaN as floats; the delta compares bits, so it is exact either way."""
    base = torch.tensor([0.0, float("nan"), 1.0, 2.0])
    new = torch.tensor([-0.0, float("nan"), 1.0, 3.0])
    new_bits = new.view(torch.int32).clone()
    new_bits[1] = new_bits[1] | 1  # a NaN with another payload
    new = new_bits.view(torch.float32)
    delta = make_delta("w", base, new)
    assert delta.changed == 3
    assert _same_bits(apply_delta(delta, base), new)
    assert not make_delta("w", new, new.clone()).full and make_delta("w", new, new.clone()).changed == 0


def test_integer_tensors_and_the_base_left_as_it_was() -> None:
    base = torch.arange(10_000, dtype=torch.int64)
    new = base.clone()
    new[::97] = -1
    delta = make_delta("steps", base, new)
    before = base.clone()
    assert _same_bits(apply_delta(delta, base), new)
    assert torch.equal(base, before)  # a version can still be abandoned whole


def test_a_delta_on_another_base_or_damaged_fails_naming_the_tensor() -> None:
    base = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    new = _changed(base, 0.05)
    delta = make_delta("model.layers.0.mlp.up_proj.weight", base, new)
    other = _changed(base, 0.05, seed=9)  # the receiver holds another version
    with pytest.raises(
        DeltaError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight': the result does not match"
    ):
        apply_delta(delta, other)
    damaged = dataclasses.replace(delta, values=bytes(len(delta.values)))
    with pytest.raises(DeltaError, match="does not match the version's checksum"):
        apply_delta(damaged, base)
    with pytest.raises(DeltaError, match="do not decompress"):
        apply_delta(dataclasses.replace(delta, positions=b"junk"), base)
    with pytest.raises(DeltaError, match="changes announced"):
        apply_delta(dataclasses.replace(delta, changed=delta.changed + 1), base)
    with pytest.raises(DeltaError, match=r"the delta is for \(64, 64\)"):
        apply_delta(delta, base[:32])
    with pytest.raises(DeltaError, match="differ"):
        make_delta("w", base, new.to(torch.bfloat16))
    assert isinstance(delta, TensorDelta)
