"""On-policy distillation's per-token signal (algorithms/distill.py) against its formula."""

from __future__ import annotations

import pytest
import torch

from polyrl_runtime.algorithms.distill import distillation_term, reverse_kl_sum, with_distillation
from polyrl_runtime.algorithms.losses import LossConfig, policy_loss

TEACHER = torch.tensor([[-0.5, -2.0, -1.0], [-0.1, -0.3, 0.0]])
STUDENT = torch.tensor([[-1.0, -1.0, -3.0], [-0.2, -0.3, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])


def test_the_term_is_the_negative_reverse_kl_per_trained_token() -> None:
    term = distillation_term(TEACHER, STUDENT, MASK, coef=2.0)
    assert term.tolist() == [pytest.approx([1.0, -2.0, 0.0]), pytest.approx([0.2, 0.0, 0.0])]
    assert reverse_kl_sum(TEACHER, STUDENT, MASK) == pytest.approx(-0.5 + 1.0 - 0.1 + 0.0)


def test_the_term_adds_to_row_or_token_advantages() -> None:
    term = distillation_term(TEACHER, STUDENT, MASK, coef=1.0)
    rows = with_distillation(torch.tensor([1.0, -1.0]), term, MASK)
    assert rows.tolist() == [pytest.approx([1.5, 0.0, 0.0]), pytest.approx([-0.9, -1.0, 0.0])]
    tokens = with_distillation(torch.ones(2, 3), term, MASK)
    assert tokens.tolist() == [pytest.approx([1.5, 0.0, 0.0]), pytest.approx([1.1, 1.0, 0.0])]


def test_its_gradient_moves_each_token_toward_the_teacher() -> None:
    """With no reward signal, a token the teacher likes more than the student gets a positive
    advantage (its logprob is pushed up), one it likes less a negative one."""
    logp = STUDENT.clone().requires_grad_()
    adv = with_distillation(torch.zeros(2), distillation_term(TEACHER, STUDENT, MASK, 1.0), MASK)
    loss, _ = policy_loss(logp, STUDENT, STUDENT, adv, MASK, cfg=LossConfig(is_correction="none"))
    loss.backward()
    assert logp.grad is not None
    # d loss / d logp = -A_t at ratio 1: -(teacher - student)
    assert logp.grad.tolist() == [pytest.approx([-0.5, 1.0, 0.0]), pytest.approx([-0.1, 0.0, 0.0])]
