"""The advantage estimators against their published formulas on fixed rewards: the worker's
group-relative signal (GRPO and Dr. GRPO: r - mean; RLOO: r - the mean of the others), then the
trainer's advantage (GRPO, RLOO: scaled by the RMS of the signals that carry a gradient; Dr. GRPO:
not scaled; REINFORCE++ and PPO: (r - batch mean) / batch std; REINFORCE++-baseline: the same of
r - group mean); and the table every other module asks instead of the name."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from polyrl_operator.api.algorithm import GROUPED_ALGORITHMS, AlgorithmName
from polyrl_runtime.algorithms.advantages import EPS, advantages, scale_stats
from polyrl_runtime.algorithms.estimators import ESTIMATORS, estimator, normalisation, update_schedule
from polyrl_runtime.workflows.groups import group_relative

GROUPS = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 2.0, 2.0]]


def _signals(name: str) -> torch.Tensor:
    """Each group's rewards through the worker's signal of estimator `name`."""
    e = estimator(name)
    sizes = {"a": 4} if e.grouped else {}
    loo = frozenset({"a"}) if e.baseline == "leave_one_out" else frozenset()
    out = [r["a"] for g in GROUPS for r in group_relative([{"a": v} for v in g], sizes, None, loo)]
    return torch.tensor(out, dtype=torch.float64)


def _by_hand(name: str) -> torch.Tensor:
    rewards = torch.tensor(GROUPS, dtype=torch.float64)
    n = rewards.shape[1]
    mean = rewards.mean(dim=1, keepdim=True)
    if name == "reinforce_pp_baseline":  # (r - group mean), normalised over the whole batch
        centred = (rewards - mean).flatten()
        return (centred - centred.mean()) / (centred.std() + EPS)
    if name in ("grpo", "dr_grpo"):
        signal = (rewards - mean).flatten()
    elif name == "rloo":  # r_i - sum_{j != i} r_j / (n - 1)
        signal = (rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)).flatten()
    else:
        flat = rewards.flatten()
        return (flat - flat.mean()) / (flat.std() + EPS)  # REINFORCE++ / PPO: batch-normalised
    if name == "dr_grpo":
        return signal  # Dr. GRPO: no standard deviation
    informative = signal[signal != 0]
    return signal / (informative.square().mean().sqrt() + EPS)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_each_estimator_gives_its_published_advantages(name: str) -> None:
    signals = _signals(name)
    norm = normalisation(name, None)
    adv = advantages(signals, norm, scale_stats(signals, name), algorithm=name)
    torch.testing.assert_close(adv, _by_hand(name))


def test_rloo_is_grpo_scaled_by_n_over_n_minus_one() -> None:
    torch.testing.assert_close(_signals("rloo"), _signals("grpo") * 4 / 3)


def test_reinforce_pp_baselines_scale_counts_a_tied_groups_zeros() -> None:
    """Unlike GRPO's scale (the RMS of the signals that carry a gradient), REINFORCE++-baseline's is
    the std over every sample of the batch: the tied group's zeros shrink it, as published."""
    signals = _signals("reinforce_pp_baseline")
    assert torch.equal(signals, _signals("grpo"))  # the worker's signal is GRPO's
    informative = signals[signals != 0]
    assert scale_stats(signals, "reinforce_pp_baseline").std < float(informative.square().mean().sqrt())


def test_a_member_alone_in_its_rloo_sub_group_has_no_signal() -> None:
    out = group_relative([{"a": 1.0}, {"a": 0.0}, {"a": 5.0}], {"a": 2}, None, frozenset({"a"}))
    assert [r["a"] for r in out] == [1.0, -1.0, 0.0]


def test_the_table_has_one_estimator_per_api_name_and_agrees_on_which_are_grouped() -> None:
    assert set(ESTIMATORS) == set(get_args(AlgorithmName))
    assert {n for n, e in ESTIMATORS.items() if e.grouped} == set(GROUPED_ALGORITHMS)
    # ppo alone steps once per micro-batch unless told otherwise; every one makes a single pass.
    assert {n: e.default_mini_batches for n, e in ESTIMATORS.items()} == {
        "grpo": 1,
        "dr_grpo": 1,
        "rloo": 1,
        "reinforce_pp": 1,
        "reinforce_pp_baseline": 1,
        "ppo": None,
    }
    assert {e.default_epochs for e in ESTIMATORS.values()} == {1}


@pytest.mark.parametrize(
    ("name", "mini_batches", "epochs", "want"),
    [
        ("grpo", None, None, (1, 1)),
        ("ppo", None, None, (None, 1)),
        ("grpo", 4, None, (4, 1)),
        ("ppo", 2, 3, (2, 3)),
        ("reinforce_pp", None, 2, (1, 2)),
    ],
)
def test_an_unset_update_schedule_is_the_estimators_and_a_set_one_wins(
    name: str, mini_batches: int | None, epochs: int | None, want: tuple[int | None, int]
) -> None:
    assert update_schedule(name, mini_batches, epochs) == want


def test_an_unset_advantage_norm_is_the_estimators_and_a_set_one_wins() -> None:
    assert normalisation("dr_grpo", None) == "none" and normalisation("grpo", None) == "per-policy"
    assert normalisation("dr_grpo", "per-policy") == "per-policy"
    with pytest.raises(ValueError, match=r"unknown algorithm 'dpo' \(known: grpo, dr_grpo"):
        estimator("dpo")


def test_per_group_divides_each_groups_signal_by_its_own_std() -> None:
    """GRPO's original normalisation (advantageNorm per-group): (r - mean_g) / (std_g + eps), with the
    population std of the group's rewards; a group of equal rewards keeps 0; the trainer then leaves
    the signals as they are."""
    from polyrl_runtime.workflows.groups import GROUP_STD_EPS

    out = [
        r["a"]
        for g in GROUPS
        for r in group_relative([{"a": v} for v in g], {"a": 4}, None, frozenset(), frozenset({"a"}))
    ]
    rewards = torch.tensor(GROUPS, dtype=torch.float64)
    mean, std = rewards.mean(dim=1, keepdim=True), rewards.std(dim=1, unbiased=False, keepdim=True)
    want = ((rewards - mean) / (std + GROUP_STD_EPS)).flatten()
    signals = torch.tensor(out, dtype=torch.float64)
    torch.testing.assert_close(signals, want)
    adv = advantages(signals, "per-group", scale_stats(signals, "grpo"), algorithm="grpo")
    torch.testing.assert_close(adv, want)


def test_per_group_is_refused_without_groups() -> None:
    from pydantic import ValidationError

    from polyrl_operator.api.algorithm import Algorithm

    assert (
        Algorithm.model_validate({"name": "grpo", "advantageNorm": "per-group"}).advantage_norm == "per-group"
    )
    with pytest.raises(ValidationError, match="per-group needs groups"):
        Algorithm.model_validate({"name": "reinforce_pp", "advantageNorm": "per-group"})
