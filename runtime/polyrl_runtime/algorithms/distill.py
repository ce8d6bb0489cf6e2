"""On-policy distillation (`algorithm.distillation`; Agarwal et al. 2024, GKD; Thinking Machines
2025): the student samples, a frozen teacher scores the student's own tokens, and each trained token
t gets the negative per-token reverse KL as a dense signal on top of the estimator's advantage A
from the episode's reward:

    A_t = A + coef * (log pi_teacher(y_t) - log pi_student(y_t))

`log pi_student` is the proximal log-probability (the weights the step began with), without
gradient, so the term is a fixed per-token advantage of the step, as the KL-in-the-reward shaping
is. Its mean over a step's trained tokens, log pi_student - log pi_teacher, is the reverse KL the
student is driven down (`distill_kl`)."""

from __future__ import annotations

import torch


def distillation_term(
    teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor, coef: float
) -> torch.Tensor:
    """[B, R] coef * (log teacher - log student) at each trained token, 0 elsewhere (detached)."""
    d = (teacher_logp - student_logp).detach()
    return torch.where(mask > 0, coef * d, torch.zeros_like(d))


def with_distillation(adv: torch.Tensor, term: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] the estimator's advantages (per row [B] or per token [B, R]) plus the distillation
    term, 0 at untrained positions."""
    base = adv[:, None].expand_as(term) if adv.dim() == 1 else adv
    out = base.to(term.dtype) + term
    return torch.where(mask > 0, out, torch.zeros_like(out))


def reverse_kl_sum(teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """The sum over trained tokens of log student - log teacher (the sampled reverse-KL estimate)."""
    d = (student_logp - teacher_logp).detach()
    return float(torch.where(mask > 0, d, torch.zeros_like(d)).sum())
