"""algorithm.klIn reward (algorithms/kl_reward.py) on fixed tensors: each trained token's return is
the reward minus klCoef times the KL still to come in its sequence, the returns are normalised over
the step's trained tokens (every rank's), and the loss then has no KL term (losses.py)."""

from __future__ import annotations

import pytest
import torch

from polyrl_operator.api.algorithm import Algorithm
from polyrl_runtime.algorithms.advantages import EPS, AdvantageStats, agent_stats
from polyrl_runtime.algorithms.kl_reward import (
    at_trained_positions,
    kl_to_go,
    shaped_returns,
    token_advantages,
    token_kl,
    trained_values,
)
from polyrl_runtime.algorithms.losses import LossConfig, kl_penalty, policy_loss

# Row 0: four positions, the second a context token (not trained); row 1: two trained, two padding.
KL = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]])
MASK = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
REWARDS = torch.tensor([1.0, 0.0])
COEF = 0.5


def _no_ranks(values: list[float]) -> list[float]:
    return values


def _agents(values: torch.Tensor, agents: tuple[str, ...]) -> dict[str, AdvantageStats]:
    return agent_stats(values, agents, "reinforce_pp")


def _advantages(
    returns: list[torch.Tensor], masks: list[torch.Tensor], mode: str, **kw: object
) -> list[torch.Tensor]:
    agents = kw.pop("agents", [["a"] * len(m) for m in masks])
    return token_advantages(
        returns,
        masks,
        agents,  # type: ignore[arg-type]
        mode,
        algorithm="reinforce_pp",
        allreduce=kw.pop("allreduce", _no_ranks),  # type: ignore[arg-type]
        agent_stats=_agents,
        global_std=kw.pop("global_std", None),  # type: ignore[arg-type]
    )


def test_the_kl_to_go_sums_the_trained_tokens_from_each_position_on() -> None:
    want = torch.tensor([[0.8, 0.7, 0.7, 0.4], [1.1, 0.6, 0.0, 0.0]])
    assert torch.allclose(kl_to_go(KL, MASK), want)


def test_each_trained_tokens_return_is_the_reward_less_the_weighted_kl_to_go() -> None:
    want = torch.tensor([[1 - 0.4, 0.0, 1 - 0.35, 1 - 0.2], [-0.55, -0.3, 0.0, 0.0]])
    assert torch.allclose(shaped_returns(REWARDS, KL, MASK, COEF), want)


def test_the_token_kl_is_the_estimator_of_ref_minus_proximal_without_gradient() -> None:
    prox = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    kl = token_kl(ref, prox, "k3")
    assert not kl.requires_grad
    d = torch.tensor([[-0.5, 1.0]])
    assert torch.allclose(kl, torch.exp(d) - d - 1)
    assert torch.allclose(token_kl(ref, prox, "k1"), -d)


def test_per_policy_whitens_the_returns_over_every_trained_token() -> None:
    second = torch.tensor([[0.3, -0.2, 0.9]])
    second_mask = torch.tensor([[1.0, 1.0, 0.0]])
    returns = [shaped_returns(REWARDS, KL, MASK, COEF), second]
    values = torch.tensor([0.6, 0.65, 0.8, -0.55, -0.3, 0.3, -0.2])
    assert torch.allclose(trained_values(returns, [MASK, second_mask]), values)
    mean, std = float(values.mean()), float(values.std())  # the unbiased std, as per row
    adv = _advantages(returns, [MASK, second_mask], "per-policy")
    want = at_trained_positions((values - mean) / (std + EPS), [MASK, second_mask])
    for got, w, m in zip(adv, want, [MASK, second_mask], strict=True):
        assert torch.allclose(got, w, atol=1e-6)
        assert bool((got[m == 0] == 0).all())  # context and padding: no advantage
    flat = trained_values(adv, [MASK, second_mask])
    assert float(flat.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(flat.std()) == pytest.approx(1.0, abs=1e-5)


def test_two_ranks_normalise_with_the_statistics_of_both() -> None:
    """Each rank's tokens with the all-reduced sums: the same advantages as one rank with all rows."""
    returns = shaped_returns(REWARDS, KL, MASK, COEF)
    whole = _advantages([returns], [MASK], "per-policy")[0]
    parts = [(returns[:1], MASK[:1]), (returns[1:], MASK[1:])]
    sums = [AdvantageStats.of(trained_values([r], [m])) for r, m in parts]
    for me, (r, m) in enumerate(parts):
        other = sums[1 - me]

        def reduce(v: list[float], o: AdvantageStats = other) -> list[float]:
            return [v[0] + o.count, v[1] + o.total, v[2] + o.total_sq]

        got = _advantages([r], [m], "per-policy", allreduce=reduce)[0]
        assert torch.allclose(got, whole[me : me + 1], atol=1e-6)


def test_per_agent_whitens_each_agents_tokens_with_its_own_statistics() -> None:
    returns = torch.tensor([[1.0, 2.0, 3.0], [10.0, 30.0, 0.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = _advantages([returns], [mask], "per-agent", agents=[["a", "b", "a"]])[0]
    a = torch.tensor([1.0, 2.0, 3.0, 5.0])
    b = torch.tensor([10.0, 30.0])
    want_a = (a - a.mean()) / (a.std() + EPS)
    want_b = (b - b.mean()) / (b.std() + EPS)
    assert torch.allclose(adv[0], want_a[:3], atol=1e-6)
    assert torch.allclose(adv[1, :2], want_b, atol=1e-6) and float(adv[1, 2]) == 0.0
    assert float(adv[2, 0]) == pytest.approx(float(want_a[3]), abs=1e-6)


def test_none_centres_and_global_scales_by_the_jobs_std() -> None:
    returns = shaped_returns(REWARDS, KL, MASK, COEF)
    values = trained_values([returns], [MASK])
    none = trained_values(_advantages([returns], [MASK], "none"), [MASK])
    assert torch.allclose(none, values - values.mean(), atol=1e-6)
    glob = trained_values(_advantages([returns], [MASK], "global", global_std=2.0), [MASK])
    assert torch.allclose(glob, (values - values.mean()) / (2.0 + EPS), atol=1e-6)


def test_an_empty_share_still_takes_part_and_gets_nothing() -> None:
    calls: list[list[float]] = []

    def reduce(v: list[float]) -> list[float]:
        calls.append(v)
        return [4.0, 2.0, 3.0]

    [adv] = _advantages([torch.zeros(0, 0)], [torch.zeros(0, 0)], "per-policy", allreduce=reduce)
    assert calls == [[0.0, 0.0, 0.0]] and adv.shape == (0, 0)


@pytest.mark.parametrize("name", ["grpo", "reinforce_pp_baseline"])
def test_a_grouped_estimator_is_refused(name: str) -> None:
    """reinforce_pp_baseline too: batch-normalised like reinforce_pp, but its signal is group-centred."""
    with pytest.raises(ValueError, match="klIn reward needs an estimator whose signal is the raw reward"):
        token_advantages(
            [KL],
            [MASK],
            [["a", "a"]],
            "per-policy",
            algorithm=name,
            allreduce=_no_ranks,
            agent_stats=_agents,
        )


def test_values_that_do_not_fit_the_masks_are_refused() -> None:
    with pytest.raises(ValueError, match="3 values for 5 trained positions"):
        at_trained_positions(torch.zeros(3), [MASK])


# -- the loss ----------------------------------------------------------------------------------------

LOGP = torch.tensor([[-1.0, -0.5, -2.0, -0.7], [-0.3, -1.2, 0.0, 0.0]])
REF = LOGP - torch.tensor([[0.4, -0.3, 0.2, 0.5], [-0.6, 0.1, 0.0, 0.0]])


def test_per_token_advantages_give_each_token_its_own_gradient() -> None:
    """At logp = proximal = behaviour (ratio 1, weight 1) d loss / d logp_t = -A_t on trained tokens."""
    adv = torch.tensor([[0.5, 9.0, -1.0, 2.0], [-0.25, 1.5, 7.0, 7.0]])
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, LOGP, LOGP, adv, MASK, cfg=LossConfig())
    loss.backward()
    assert logp.grad is not None
    assert torch.allclose(logp.grad, -adv * MASK)
    assert float(loss.detach()) == pytest.approx(float(-(adv * MASK).sum()))


def test_per_row_advantages_are_per_token_ones_repeated() -> None:
    row = torch.tensor([0.7, -1.3])
    by_row, _ = policy_loss(LOGP, LOGP, LOGP, row, MASK, cfg=LossConfig())
    by_token, _ = policy_loss(LOGP, LOGP, LOGP, row[:, None].expand_as(LOGP), MASK, cfg=LossConfig())
    assert float(by_row) == pytest.approx(float(by_token))


def test_advantages_of_another_shape_are_refused() -> None:
    with pytest.raises(ValueError, match=r"advantages of shape \(2, 3\)"):
        policy_loss(LOGP, LOGP, LOGP, torch.zeros(2, 3), MASK, cfg=LossConfig())
    with pytest.raises(ValueError, match=r"advantages of shape \(3,\)"):
        policy_loss(LOGP, LOGP, LOGP, torch.zeros(3), MASK, cfg=LossConfig())


def test_kl_in_reward_leaves_the_kl_out_of_the_loss_and_reports_it() -> None:
    adv = torch.tensor([[0.5, 9.0, -1.0, 2.0], [-0.25, 1.5, 7.0, 7.0]])
    losses, grads, kls = {}, {}, {}
    for where in ("loss", "reward", "off"):
        cfg = LossConfig(kl_coef=0.0 if where == "off" else 0.3, kl_in="reward" if where == "off" else where)
        logp = LOGP.clone().requires_grad_(True)
        loss, stats = policy_loss(logp, LOGP, LOGP, adv, MASK, cfg=cfg, ref_logp=REF)
        loss.backward()
        assert logp.grad is not None
        losses[where], grads[where], kls[where] = float(loss.detach()), logp.grad, stats.kl
    want_kl = float((kl_penalty(REF - LOGP, "k3") * MASK).sum() / MASK.sum())
    assert want_kl > 0.01
    assert kls["loss"] == pytest.approx(want_kl) and kls["reward"] == pytest.approx(want_kl)
    assert losses["reward"] == pytest.approx(losses["off"]) and torch.equal(grads["reward"], grads["off"])
    assert losses["loss"] == pytest.approx(losses["off"] + 0.3 * want_kl * float(MASK.sum()), rel=1e-5)
    assert not torch.allclose(grads["loss"], grads["off"])


def test_an_unknown_kl_in_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown klIn 'advantage'"):
        policy_loss(LOGP, LOGP, LOGP, torch.zeros(2), MASK, cfg=LossConfig(kl_in="advantage"))


def test_the_api_field_reaches_the_loss_config() -> None:
    algo = Algorithm.model_validate({"name": "ppo", "groupSize": 1, "klCoef": 0.1, "klIn": "reward"})
    assert LossConfig.of(algo).kl_in == "reward"
    assert LossConfig.of(Algorithm()).kl_in == "loss"
    for bad, message in (
        ({"name": "reinforce_pp", "klIn": "reward"}, "reward needs klCoef > 0"),
        ({"name": "rloo", "klCoef": 0.1, "klIn": "reward"}, "reward is for reinforce_pp and ppo"),
        (
            {"name": "reinforce_pp_baseline", "klCoef": 0.1, "klIn": "reward"},
            "reward is for reinforce_pp and",
        ),
        ({"name": "reinforce_pp_baseline", "groupSize": 1}, "must be at least 2 for grpo, dr_grpo, rloo and"),
    ):
        with pytest.raises(ValueError, match=message):
            Algorithm.model_validate(bad)
