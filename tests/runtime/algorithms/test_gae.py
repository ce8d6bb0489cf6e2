"""GAE and the clipped value loss (algorithms/gae.py) against their formulas on fixed tensors."""

from __future__ import annotations

import pytest
import torch

from polyrl_runtime.algorithms.gae import gae, token_rewards, value_loss


def _reference(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """GAE of one sequence of trained steps, written out term by term."""
    n = len(rewards)
    v = [*values, 0.0]
    deltas = [rewards[t] + gamma * v[t + 1] - v[t] for t in range(n)]
    return [sum((gamma * lam) ** k * deltas[t + k] for k in range(n - t)) for t in range(n)]


def test_the_reward_sits_at_the_last_trained_token_with_shaping_everywhere() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    r = token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask, shaping=torch.full((3, 4), -0.1))
    assert r.tolist() == [
        pytest.approx([-0.1, -0.1, 1.9, 0.0]),
        pytest.approx([-0.1, 0.0, -1.1, 0.0]),
        [0.0, 0.0, 0.0, 0.0],  # a row without trained tokens gets nothing
    ]


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.95), (0.9, 0.5), (0.99, 0.0)])
def test_gae_matches_the_sum_of_discounted_td_errors(gamma: float, lam: float) -> None:
    rewards = [0.0, 0.3, 0.0, 1.0]
    values = [0.5, -0.2, 0.4, 0.1]
    adv, ret = gae(torch.tensor([rewards]), torch.tensor([values]), torch.ones(1, 4), gamma, lam)
    want = _reference(rewards, values, gamma, lam)
    assert adv[0].tolist() == pytest.approx(want, abs=1e-6)
    assert ret[0].tolist() == pytest.approx([a + v for a, v in zip(want, values, strict=True)], abs=1e-6)


def test_untrained_positions_are_passed_over() -> None:
    """A context token between two trained ones is no time step: the result equals the sequence
    without it, and the padding after the last trained token does not enter."""
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0, 0.0]])
    rewards = torch.tensor([[0.0, 9.0, 1.0, 9.0, 9.0]])
    values = torch.tensor([[0.2, 7.0, 0.6, 7.0, 7.0]])
    adv, ret = gae(rewards, values, mask, 0.9, 0.8)
    want = _reference([0.0, 1.0], [0.2, 0.6], 0.9, 0.8)
    assert adv[0].tolist() == pytest.approx([want[0], 0.0, want[1], 0.0, 0.0], abs=1e-6)
    assert ret[0, 1] == 0.0 and ret[0, 2] == pytest.approx(want[1] + 0.6)


def test_lambda_one_gamma_one_gives_return_minus_value() -> None:
    """With gamma = lambda = 1, A_t is the return to go minus V_t: Monte Carlo with a baseline."""
    adv, _ = gae(torch.tensor([[0.0, 0.0, 2.0]]), torch.tensor([[0.5, 1.0, 1.5]]), torch.ones(1, 3), 1.0, 1.0)
    assert adv[0].tolist() == pytest.approx([1.5, 1.0, 0.5])


def test_the_value_loss_is_clipped_around_the_old_values() -> None:
    values = torch.tensor([[1.0, 0.0, 3.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third is not trained
    loss, frac = value_loss(values, old, returns, mask, clip=0.2)
    # token 0: unclipped (1-0)^2 = 1, clipped (0.7-0)^2 = 0.49 -> 1; token 1: both (0-1)^2 = 1 -> 1
    assert float(loss) == pytest.approx(0.5 * (1.0 + 1.0))
    assert frac == 0.0
    loss.backward()
    assert values.grad is not None and values.grad[0].tolist() == pytest.approx([1.0, -1.0, 0.0])
    # The clipped term is larger when the new value moved away from the target past the clip.
    far = torch.tensor([[-1.0]], requires_grad=True)
    loss, frac = value_loss(far, torch.tensor([[0.9]]), torch.tensor([[1.0]]), torch.ones(1, 1), clip=0.2)
    assert float(loss) == pytest.approx(0.5 * 4.0) and frac == 0.0  # unclipped 4 > clipped 0.09
    near = torch.tensor([[1.5]], requires_grad=True)
    loss, frac = value_loss(near, torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), clip=0.2)
    assert float(loss) == pytest.approx(0.5 * 0.64) and frac == 1.0  # clipped (0.2-1)^2 > (1.5-1)^2
    loss.backward()
    assert near.grad is not None and float(near.grad) == 0.0  # the clipped branch has no gradient
    unclipped, frac = value_loss(
        near, torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), clip=None
    )
    assert float(unclipped) == pytest.approx(0.5 * 0.25) and frac == 0.0
