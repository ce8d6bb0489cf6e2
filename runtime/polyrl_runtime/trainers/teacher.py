"""The frozen teacher of on-policy distillation (`algorithm.distillation`, algorithms/distill.py) in
a trainer rank: the teacher policy's model, loaded the way its engines load it (its URI and dtype; a
built-in model from the teacher policy's seed, so that it holds the weights its engines serve), never
trained, scoring the student's sampled tokens once per step before the first update."""

from __future__ import annotations

from typing import Any

import torch

from polyrl_operator.api import Policy
from polyrl_runtime.algorithms.distill import distillation_term, reverse_kl_sum, with_distillation
from polyrl_runtime.algorithms.losses import TokenBatch, sequence_logprobs
from polyrl_runtime.experience.types import Sample
from polyrl_runtime.models import ModelLoadError, load_model, load_tokenizer, policy_seed, vocabulary_mismatch
from polyrl_runtime.trainers.step_inputs import token_batch


class TeacherMismatchError(ModelLoadError):
    """The teacher's tokenizer cannot score the student's token ids: a model error of the spec, which
    fails the job at start naming the policies (not retried: the same spec fails the same way)."""


class Teacher:
    def __init__(
        self, teacher: Policy, student: Policy, *, job_seed: int, cuda: bool, device: torch.device
    ) -> None:
        distillation = student.algorithm.distillation
        if distillation is None or distillation.teacher != teacher.name:
            raise ValueError(f"policy {student.name} does not distil from {teacher.name}")
        reason = vocabulary_mismatch(
            load_tokenizer(student.model.uri, trust_remote_code=student.model.trust_remote_code),
            load_tokenizer(teacher.model.uri, trust_remote_code=teacher.model.trust_remote_code),
        )
        if reason is not None:
            raise TeacherMismatchError(
                f"policy {student.name}: algorithm.distillation.teacher {teacher.name!r} cannot score its "
                f"tokens: the tokenizers of {student.model.uri} and {teacher.model.uri} differ: {reason}"
            )
        self.name = teacher.name
        self.coef = distillation.coef
        model = load_model(
            teacher.model.uri,
            seed=policy_seed(job_seed, teacher.name),
            dtype=teacher.model.dtype,
            trust_remote_code=teacher.model.trust_remote_code,
            cuda=cuda,
        )
        self.model: Any = model.to(device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    def logprobs(self, tb: TokenBatch, temperature: float) -> torch.Tensor:
        """[B, R] the teacher's logprobs of the rows' tokens (each row at its own temperature)."""
        with torch.no_grad():
            return sequence_logprobs(self.model, tb, temperature)

    def distil(
        self,
        samples: list[Sample],
        micro_rows: list[list[int]],
        advantages: list[torch.Tensor],
        student: list[torch.Tensor],
        temperature: float,
    ) -> tuple[list[torch.Tensor], float, int]:
        """Each micro-batch's advantages with the distillation term added (`student`: its proximal
        logprobs, [rows, R], an empty tensor for an empty micro-batch), the summed reverse KL and
        the trained tokens it is over."""
        out: list[torch.Tensor] = []
        kl, tokens = 0.0, 0
        for rows, adv, own in zip(micro_rows, advantages, student, strict=True):
            if not rows:
                out.append(adv)
                continue
            tb = token_batch(samples, rows)[0]
            teacher = self.logprobs(tb, temperature).to(own.device)
            mask = tb.response_mask.to(own.device)
            out.append(
                with_distillation(adv.to(own.device), distillation_term(teacher, own, mask, self.coef), mask)
            )
            kl += reverse_kl_sum(teacher, own, mask)
            tokens += int(mask.sum())
        return out, kl, tokens
