"""algorithm.miniBatches and algorithm.epochs in a DeepSpeed rank's step (CPU, gloo, world 1): a step
takes epochs x miniBatches optimizer steps (unset: the estimator's, one per batch, ppo one per
micro-batch), every one against the proximal logprobs scored once before the first; each step's loss
is its mini-batch's numerators over that mini-batch's count; one step (miniBatches 1, epochs 1)
has the gradient of the whole batch with pi_prox = pi; every step ends at its last pass whatever the
micro-batch count of the step before; a mini-batch no rank has a row of takes no optimizer step."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.algorithms.losses import policy_loss, sequence_logprobs, sequence_logprobs_and_entropy
from polyrl_runtime.experience import SampleBatch
from polyrl_runtime.experience.state import Lease
from polyrl_runtime.experience.types import Sample
from polyrl_runtime.trainers import deepspeed_trainer, step_inputs
from polyrl_runtime.trainers.batching import share_micro_batches, step_layout
from polyrl_runtime.trainers.deepspeed_trainer import DeepSpeedTrainer
from polyrl_runtime.trainers.step_inputs import token_batch
from polyrl_testenv.trainer_rank import in_process_rank

RESPONSE_LENGTHS = [1, 2, 6, 3]
SIGNALS = [1.0, -1.0, 0.5, -0.5]


def _batch(lengths: list[int] = RESPONSE_LENGTHS) -> SampleBatch:
    samples = [
        Sample(
            sample_id=f"s{i}",
            episode_id=f"e{i}",
            policy="agent",
            agent="agent",
            turn_index=0,
            reward=SIGNALS[i % len(SIGNALS)],
            prompt_ids=np.array([1, 5, 9], dtype=np.int32),
            response_ids=(np.arange(n, dtype=np.int32) % 7) + 2,
            logprobs=np.full(n, -2.0, dtype=np.float32),
            versions=np.zeros(n, dtype=np.int32),
        )
        for i, n in enumerate(lengths)
    ]
    return SampleBatch.from_samples("agent", samples)


class _Leases:
    def __init__(self, *batches: SampleBatch) -> None:
        self.batches = list(batches)

    def pull(self, policy: str, consumer: str, max_samples: int, timeout: float) -> Lease:
        return Lease(len(self.batches), "agent", consumer, self.batches.pop(0))


def _rank(model_dir: Path, micro: int, **algorithm: Any) -> DeepSpeedTrainer:
    policy = Policy.model_validate(
        {
            "name": "agent",
            "model": {"uri": f"file://{model_dir}", "dtype": "float32"},
            # No gradient clipping: the gradient the optimizer is handed is the loss's own.
            "algorithm": {"lr": 1e-2, "maxGradNorm": 0.0, **algorithm},
            "rollout": {"engine": "torch", "gpus": 0},
            "trainer": {"gpus": 0, "zeroStage": 0, "microBatchSize": micro},
        }
    )
    return in_process_rank(policy)


def _optimizer(rank: DeepSpeedTrainer) -> torch.optim.Optimizer:
    opt: Any = rank.engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


@pytest.fixture
def no_ray(gloo: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(deepspeed_trainer, "ray", SimpleNamespace(get=lambda ref: ref))
    yield


def _applied_gradients(
    rank: DeepSpeedTrainer, monkeypatch: pytest.MonkeyPatch
) -> list[dict[str, torch.Tensor]]:
    """Each real optimizer step's gradients, as the optimizer is handed them, as they come."""
    opt = _optimizer(rank)
    names = {id(p): n for n, p in rank.engine.module.named_parameters()}
    seen: list[dict[str, torch.Tensor]] = []
    real = type(opt).step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if self is opt:
            seen.append(
                {
                    names[id(p)]: p.grad.detach().clone()
                    for g in self.param_groups
                    for p in g["params"]
                    if p.grad is not None
                }
            )
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(opt), "step", step)
    return seen


def _recorded_losses(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each pass's (logp, proximal logp) as `policy_loss` receives them."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append((args[0].detach().clone(), args[1].detach().clone()))
        return policy_loss(*args, **kwargs)

    monkeypatch.setattr(deepspeed_trainer, "policy_loss", recording)
    return calls


def _counting_proximal(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real: Callable[..., torch.Tensor] = step_inputs.Scorer.logprobs

    def counted(self: step_inputs.Scorer, tb: Any) -> torch.Tensor:
        calls.append(int(tb.targets.shape[0]))
        return real(self, tb)

    monkeypatch.setattr(step_inputs.Scorer, "logprobs", counted)
    return calls


@pytest.mark.parametrize(
    ("name", "mini", "epochs", "micro", "n_micro", "steps"),
    [
        ("grpo", None, None, 2, 2, 1),  # unset: one per batch, two micro-batches accumulated
        ("grpo", 2, None, 2, 2, 2),
        ("grpo", 2, 2, 2, 2, 4),
        ("grpo", 4, None, 4, 1, 4),  # one micro-batch of four rows split into four
        ("dr_grpo", 1, 3, 4, 1, 3),
        ("rloo", 2, None, 1, 4, 2),  # two micro-batches each
        ("reinforce_pp", None, 2, 4, 1, 2),
        ("ppo", None, None, 1, 4, 4),  # unset: one per micro-batch, as ever
        ("ppo", None, None, 4, 1, 1),
        ("ppo", 1, None, 2, 2, 1),  # one mini-batch: its micro-batches accumulated
        ("ppo", None, 2, 2, 2, 4),
    ],
)
def test_a_step_takes_epochs_times_mini_batches_optimizer_steps_against_one_proximal_scoring(
    no_ray: None,
    tiny_qwen2_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    name: str,
    mini: int | None,
    epochs: int | None,
    micro: int,
    n_micro: int,
    steps: int,
) -> None:
    fields = {"name": name, "groupSize": 2, "miniBatches": mini, "epochs": epochs}
    rank = _rank(tiny_qwen2_dir, micro, **{k: v for k, v in fields.items() if v is not None})
    batch = _batch()
    samples = batch.samples()
    groups = share_micro_batches(batch, micro, None, rank.mini_batches)
    layout = step_layout(groups, n_micro, rank.mini_batches)
    with torch.no_grad():  # what the step's proximal logprobs must be: the weights it began with
        initial = {tuple(r): sequence_logprobs(rank.engine, token_batch(samples, r)[0], 1.0) for r in groups}
    applied = _applied_gradients(rank, monkeypatch)
    losses = _recorded_losses(monkeypatch)
    proximal = _counting_proximal(monkeypatch)
    global_steps = rank.engine.global_steps
    rank.buffer = _Leases(batch)  # type: ignore[assignment]

    result = rank.train_step(1, len(RESPONSE_LENGTHS), n_micro)

    assert len(applied) == steps and rank.engine.global_steps == global_steps + steps
    assert rank._guard is not None and rank._guard.steps == steps and result.skipped_nonfinite == 0
    assert len(losses) == (rank.epochs * len(groups))  # every non-empty micro-batch once per epoch
    if steps == 1:  # pi_prox = pi: nothing scored beforehand, ratio 1
        assert proximal == [] and all(torch.equal(logp, prox) for logp, prox in losses)
        assert result.clip_frac == 0.0
        return
    # Scored once, before the first update, for every micro-batch; each pass is clipped around it.
    assert sorted(proximal) == sorted(len(r) for r in groups)
    for _, prox in losses:
        assert any(p.shape == prox.shape and torch.allclose(p, prox, atol=1e-6) for p in initial.values())
    assert not all(torch.allclose(logp, prox, atol=1e-6) for logp, prox in losses)  # the weights moved
    assert layout.minis * rank.epochs == steps


@pytest.mark.parametrize(
    ("mini", "epochs", "micro", "n_micro"),
    [
        (None, None, 4, 1),  # today's single step, unset
        (1, 1, 2, 2),  # explicitly one mini-batch of two accumulated micro-batches
        (2, 1, 2, 2),  # the first of two: its own rows over its own token count
        (2, 2, 1, 4),
    ],
)
def test_the_first_optimizer_steps_gradient_is_its_mini_batchs_mean_loss(
    no_ray: None,
    tiny_qwen2_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    mini: int | None,
    epochs: int | None,
    micro: int,
    n_micro: int,
) -> None:
    fields = {"name": "grpo", "advantageNorm": "none", "miniBatches": mini, "epochs": epochs}
    rank = _rank(tiny_qwen2_dir, micro, **{k: v for k, v in fields.items() if v is not None})
    batch = _batch()
    samples = batch.samples()
    layout = step_layout(
        share_micro_batches(batch, micro, None, rank.mini_batches), n_micro, rank.mini_batches
    )
    rows = sorted(i for k in layout.mini_batches()[0] for i in layout.micro_rows[k])
    if mini is None or mini == 1:
        assert rows == list(range(len(RESPONSE_LENGTHS)))  # one step: the whole batch
    # The gradient of the mini-batch's token-mean loss at ratio 1 (advantageNorm none: A = signal).
    module = rank.engine.module
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    tb, behav = token_batch(samples, rows)
    logp, entropy = sequence_logprobs_and_entropy(module, tb, 1.0)
    adv = torch.tensor([SIGNALS[i] for i in rows])
    num, _ = policy_loss(
        logp, logp.detach(), behav, adv, tb.response_mask, cfg=rank.loss_cfg, entropy=entropy
    )
    tokens = sum(RESPONSE_LENGTHS[i] for i in rows)
    want = torch.autograd.grad(num / tokens, [p for _, p in params], allow_unused=True)
    applied = _applied_gradients(rank, monkeypatch)
    rank.buffer = _Leases(batch)  # type: ignore[assignment]

    rank.train_step(1, len(RESPONSE_LENGTHS), n_micro)

    first = applied[0]
    assert any(float(g.abs().max()) > 1e-6 for g in want if g is not None)
    for (n, _), g in zip(params, want, strict=True):
        expected = torch.zeros_like(first[n]) if g is None else g
        assert torch.allclose(first[n], expected, rtol=1e-4, atol=1e-7), n


def test_every_step_ends_at_its_last_pass_whatever_the_micro_batch_count_before(
    no_ray: None, tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed counts passes across steps: a step of two micro-batches after one of three would
    otherwise reach its boundary after its first pass and leave the second's gradient behind."""
    rank = _rank(tiny_qwen2_dir, 1)
    passes: list[int] = []  # backwards of the step so far, at each backward
    at_step: list[int] = []  # backwards of the step so far, at each optimizer step
    backward = rank.engine.backward
    real_step = type(_optimizer(rank)).step

    def counted(loss: torch.Tensor) -> Any:
        passes[-1] += 1
        return backward(loss)

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        at_step.append(passes[-1])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(rank.engine, "backward", counted)
    monkeypatch.setattr(type(_optimizer(rank)), "step", step)
    counts = [3, 2, 3, 1]
    rank.buffer = _Leases(*(_batch(RESPONSE_LENGTHS[:n]) for n in counts))  # type: ignore[assignment]
    for step_no, n in enumerate(counts, start=1):
        passes.append(0)
        rank.train_step(step_no, n, n)
        assert at_step[-1] == n and len(at_step) == step_no, (step_no, at_step)


def test_a_mini_batch_no_rank_has_rows_of_takes_no_optimizer_step(
    no_ray: None, tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two rows, four mini-batches: two have rows, two are empty; their boundaries run (collectives
    aligned) without an optimizer step, which would move the weights by Adam's momentum alone."""
    rank = _rank(tiny_qwen2_dir, 4, miniBatches=4)
    applied = _applied_gradients(rank, monkeypatch)
    rank.buffer = _Leases(_batch(RESPONSE_LENGTHS[:2]))  # type: ignore[assignment]
    result = rank.train_step(1, 2, 1)
    assert len(applied) == 2 and result.skipped_nonfinite == 0
    assert rank._guard is not None and rank._guard.steps == 4
    counted = {float(s["step"]) for s in _optimizer(rank).state.values()}
    assert counted == {2.0}
