"""The loss's options against their published formulas on fixed tensors: DAPO's clip-higher
(asymmetric bounds), dual-clip PPO's bound on negative advantages, and the KL estimators k1, k2, k3
(Schulman's, with d = log ref - log pi)."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl_operator.api.algorithm import Algorithm
from polyrl_runtime.algorithms.losses import LossConfig, kl_penalty, policy_loss

# Three tokens of one sequence: ratios exp(+0.5), exp(-0.5), exp(+2.0) against the proximal policy.
PROX = torch.zeros(1, 3)
LOGP = torch.tensor([[0.5, -0.5, 2.0]])
MASK = torch.ones(1, 3)


def _per_token(adv: float, cfg: LossConfig) -> list[float]:
    out = []
    for j in range(3):  # one token at a time: the loss is a sum over tokens
        m = torch.zeros(1, 3)
        m[0, j] = 1
        loss, _ = policy_loss(LOGP, PROX, PROX, torch.tensor([adv]), m, cfg=cfg)
        out.append(float(loss))
    return out


def _ppo_clip(r: float, a: float, low: float, high: float) -> float:
    return -min(r * a, min(max(r, 1 - low), 1 + high) * a)


def test_clip_higher_widens_only_the_upper_bound() -> None:
    ratios = [math.exp(v) for v in (0.5, -0.5, 2.0)]
    cfg = LossConfig(clip_eps=0.2, clip_eps_high=0.28)
    for a in (1.0, -1.0):
        want = [_ppo_clip(r, a, 0.2, 0.28) for r in ratios]
        assert _per_token(a, cfg) == pytest.approx(want, rel=1e-6)
    # The symmetric default clips a positive advantage's ratio at 1.2, clip-higher at 1.28.
    assert _per_token(1.0, LossConfig(clip_eps=0.2))[0] == pytest.approx(-1.2)
    assert _per_token(1.0, cfg)[0] == pytest.approx(-1.28)


def test_dual_clip_bounds_what_a_negative_advantage_can_cost() -> None:
    a, c = -2.0, 3.0
    plain = _per_token(a, LossConfig(clip_eps=0.2))
    dual = _per_token(a, LossConfig(clip_eps=0.2, dual_clip=c))
    # ratio e^2 = 7.39: PPO's clip leaves -min(7.39 a, 1.2 a) = 14.8; dual clip caps it at -c a = 6.
    assert plain[2] == pytest.approx(-math.exp(2.0) * a, rel=1e-6)
    assert dual[2] == pytest.approx(-c * a)
    assert dual[:2] == pytest.approx(plain[:2])  # below the bound nothing changes
    assert _per_token(2.0, LossConfig(dual_clip=c)) == _per_token(2.0, LossConfig())  # positive: none


@pytest.mark.parametrize(
    ("name", "formula"),
    [("k1", lambda d: -d), ("k2", lambda d: 0.5 * d * d), ("k3", lambda d: math.exp(d) - d - 1)],
)
def test_each_kl_estimator_is_its_formula(name: str, formula: object) -> None:
    d = torch.tensor([-1.0, -0.1, 0.0, 0.3, 2.0], dtype=torch.float64)
    assert callable(formula)
    assert kl_penalty(d, name).tolist() == pytest.approx([formula(float(x)) for x in d])


def test_the_kl_estimator_reaches_the_loss() -> None:
    ref = torch.tensor([[0.2, 0.0, 1.0]])
    for name in ("k1", "k2", "k3"):
        cfg = LossConfig(kl_coef=1.0, kl_estimator=name)
        _, stats = policy_loss(LOGP, LOGP, LOGP, torch.zeros(1), MASK, cfg=cfg, ref_logp=ref)
        assert stats.kl == pytest.approx(float(kl_penalty(ref - LOGP, name).mean()), rel=1e-6)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(torch.zeros(1), "k4")


def test_the_config_is_the_policys_algorithm() -> None:
    algo = Algorithm.model_validate(
        {"clipEps": 0.1, "clipEpsHigh": 0.3, "dualClip": 3.0, "klEstimator": "k2"}
    )
    cfg = LossConfig.of(algo)
    assert (cfg.clip_eps, cfg.clip_eps_high, cfg.dual_clip, cfg.kl_estimator) == (0.1, 0.3, 3.0, "k2")
