"""polyrl's policy loss against TRL's GRPO loss (`trl.GRPOTrainer._compute_loss`, TRL >= 1.16) on
the same model and the same inputs, value and gradient.

Both sides load one tiny Hugging Face Qwen2 (tests/runtime/conftest.py `tiny_qwen2_dir`) the same
way, each its own copy; TRL's is a real `GRPOTrainer` built offline on CPU, whose `_compute_loss`
runs the model itself (TRL's fused LM head), polyrl's scores it with `sequence_logprobs_and_entropy`.
Fixed prompts and completions (one row with context tokens: TRL's `tool_mask`, polyrl's loss mask),
fixed advantages, and fixed log-ratios around the current weights' log-probabilities give the
proximal (TRL's `old_per_token_logps`), behaviour (TRL's vLLM `sampling_per_token_logps`) and
reference log-probabilities. Every comparison is float32 (both score the logits in float32).

Compared (TRL setting <-> polyrl field), each exact:
- loss_type grpo <-> lossAggregation seq-mean-token-mean; dapo <-> token-mean (TRL divides by the
  generation batch's token count, as polyrl by the step's); bnpo <-> token-mean within one micro-batch
  only (bnpo divides each micro-batch by its own token count: a test shows the two differ over two
  micro-batches of unequal token counts); dr_grpo <-> seq-mean-token-sum / max_completion_length.
  grpo, dapo and dr_grpo are also compared over two accumulated micro-batches.
- epsilon / epsilon_high <-> clipEps / clipEpsHigh; delta (two-sided clipping) <-> dualClip: for
  delta > 1 + epsilon_high both bound a negative-advantage token's loss by -delta * A.
- importance_sampling_level sequence <-> ratioLevel sequence (GSPO), under grpo and under dapo.
- beta with use_bias_correction_kl False <-> klCoef with klEstimator k3 (TRL reads the reference
  log-probabilities from its inputs). TRL's default use_bias_correction_kl True multiplies the KL by
  the differentiable ratio (DeepSeek-V3.2), which polyrl does not: same value on-policy, another
  gradient.
- entropy_coef <-> entropyCoef under dapo / token-mean. TRL's bonus is a token mean whatever the
  loss type; polyrl's follows lossAggregation, so under the seq-mean modes they differ by design.
- on-policy (no old_per_token_logps: TRL takes the detached current ones) <-> prox_logp = the
  detached current logp.
- vLLM importance sampling (vllm_importance_sampling_mode token_truncate, sequence_truncate,
  token_mask, sequence_mask, cap vllm_importance_sampling_clip_max) <-> isCorrection of the same
  name with isCap. TRL computes that ratio in `_generate_and_score_completions`, which generates
  with vLLM and cannot run here; `_trl_is_ratio` transcribes its formula and `_compute_loss` applies
  it (per token, before the KL term, as polyrl does). polyrl's truncation is one-sided (TRL's
  vllm_importance_sampling_clip_min None) and its masks two-sided (clip_min = 1 / isCap).

Not compared (no counterpart): TRL's cispo, sapo, vespo and luspo losses, off_policy_mask_threshold
and top_entropy_quantile; polyrl's k1/k2 estimators, klIn reward and allowed-id restriction.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch
import transformers
import trl

from polyrl_runtime.algorithms.losses import (
    LossConfig,
    TokenBatch,
    aggregation_denominator,
    policy_loss,
    sequence_logprobs_and_entropy,
)

TEMPERATURE = 0.8
MAX_COMPLETION = 8  # TRL's max_completion_length: dr_grpo's constant denominator
PAD = 0  # the tiny tokenizer's <|endoftext|>
PROMPTS = [[5, 17, 42], [8, 9, 10, 11, 12], [5, 17, 42], [8, 9, 10, 11, 12]]
COMPLETIONS = [[30, 31, 32, 33, 34, 35], [40, 41, 42, 43], [50, 51, 52], [60, 61, 62, 63, 64, 65]]
# Row 3's tokens 2 and 3 are context (a tool's output): model input, not trained.
LOSS_MASKS = [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1], [1, 1, 0, 0, 1, 1]]
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -1.5])
# log pi_theta - log pi_proximal per token, 0 at padding; none near a clip boundary (log 0.8, log 1.2,
# log 1.28, log 3). 0.21 is clipped at 1 + 0.2 but not at 1 + 0.28; 1.5 in a row of A < 0 passes the
# dual / two-sided clip at 3. GSPO's row means (0.08, 0.245, 0.417, -0.0675) clip rows 1 and 2.
LOG_RATIO = torch.tensor(
    [
        [0.02, -0.05, 0.21, 0.6, -0.4, 0.1],
        [0.3, -0.12, 1.5, -0.7, 0.0, 0.0],
        [-0.3, 1.5, 0.05, 0.0, 0.0, 0.0],
        [0.1, -0.6, 9.0, -9.0, 0.21, 0.02],
    ]
)
# log pi_proximal - log pi_behaviour; with isCap 2 (log 2 = 0.693) the tokens 0.9, 1.3 (and -1.5 for
# the masks) are corrected; row sums over trained tokens 1.05, -0.9, 0.4, 0.5: rows 0 and 1 leave the
# sequence band, row 0 is truncated.
IS_LOG = torch.tensor(
    [
        [0.1, 0.3, -0.2, 0.9, 0.05, -0.1],
        [-1.5, 0.2, 0.1, 0.3, 0.0, 0.0],
        [0.2, -0.1, 0.3, 0.0, 0.0, 0.0],
        [1.3, -0.5, 5.0, -5.0, 0.1, -0.4],
    ]
)
IS_CAP = 2.0
# log pi_ref - log pi_theta per token.
REF_LOG = torch.tensor(
    [
        [0.1, -0.2, 0.3, -0.4, 0.5, -0.1],
        [0.2, 0.4, -0.3, 0.1, 0.0, 0.0],
        [-0.5, 0.3, 0.2, 0.0, 0.0, 0.0],
        [0.3, -0.3, 0.0, 0.0, 0.1, 0.4],
    ]
)
ALL_ROWS = [[0, 1, 2, 3]]
TWO_MICRO_BATCHES = [[0, 1], [2, 3]]  # 10 and 7 trained tokens, both 6 wide


@dataclass(frozen=True)
class Pair:
    """One loss both libraries implement: TRL's GRPOConfig fields and polyrl's LossConfig; TRL's loss
    is polyrl's times `scale`."""

    trl: dict[str, Any]
    ours: LossConfig
    scale: float = 1.0
    vllm_is: bool = False  # TRL applies its vLLM importance-sampling ratio
    on_policy: bool = False  # no proximal logprobs: both take the detached current ones


def _none(**kw: Any) -> LossConfig:
    return LossConfig(is_correction="none", **kw)


def _is(mode: str, **kw: Any) -> Pair:
    trl_mode = mode.replace("-", "_")
    low = 1 / IS_CAP if mode.endswith("mask") else None
    trl_cfg = {"vllm_importance_sampling_mode": trl_mode, "vllm_importance_sampling_clip_max": IS_CAP}
    return Pair(
        {"loss_type": "dapo", **trl_cfg, "vllm_importance_sampling_clip_min": low, **kw},
        LossConfig(is_correction=mode, is_cap=IS_CAP, kl_coef=kw.get("beta", 0.0)),
        vllm_is=True,
    )


PAIRS = {
    "grpo~seq-mean-token-mean": Pair({"loss_type": "grpo"}, _none(loss_aggregation="seq-mean-token-mean")),
    "dapo~token-mean": Pair({"loss_type": "dapo"}, _none(loss_aggregation="token-mean")),
    "bnpo~token-mean": Pair({"loss_type": "bnpo"}, _none(loss_aggregation="token-mean")),
    "dr_grpo~seq-mean-token-sum": Pair(
        {"loss_type": "dr_grpo"}, _none(loss_aggregation="seq-mean-token-sum"), scale=1 / MAX_COMPLETION
    ),
    "clip-higher": Pair({"loss_type": "dapo", "epsilon_high": 0.28}, _none(clip_eps_high=0.28)),
    "two-sided~dual-clip": Pair({"loss_type": "dapo", "delta": 3.0}, _none(dual_clip=3.0)),
    "gspo-grpo": Pair(
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},
        _none(ratio_level="sequence", loss_aggregation="seq-mean-token-mean"),
    ),
    "gspo-dapo": Pair(
        {"loss_type": "dapo", "importance_sampling_level": "sequence"}, _none(ratio_level="sequence")
    ),
    "kl-k3": Pair({"loss_type": "dapo", "beta": 0.05}, _none(kl_coef=0.05, kl_estimator="k3")),
    "entropy-bonus": Pair({"loss_type": "dapo", "entropy_coef": 0.01}, _none(entropy_coef=0.01)),
    "on-policy": Pair(
        {"loss_type": "grpo", "beta": 0.05},
        _none(loss_aggregation="seq-mean-token-mean", kl_coef=0.05),
        on_policy=True,
    ),
    "is-token-truncate": _is("token-truncate"),
    "is-sequence-truncate": _is("sequence-truncate"),
    "is-token-mask": _is("token-mask"),
    "is-sequence-mask": _is("sequence-mask"),
    "is-token-truncate-with-kl": _is("token-truncate", beta=0.05),
}


def _trl_is_ratio(
    prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, mode: str, *, low: float | None, high: float
) -> torch.Tensor:
    """TRL 1.16's vLLM importance-sampling ratio as `GRPOTrainer._generate_and_score_completions`
    computes it (old_per_token_logps - sampling_per_token_logps), transcribed: that method generates."""
    diff = torch.nan_to_num((prox - behav) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    lo = -math.inf if low is None else low
    return ratio.masked_fill((ratio < lo) | (ratio > high), 0.0)


def _load(model_dir: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()  # the training path; the tiny Qwen2 has no dropout, so scores are deterministic
    return model


def _batch(rows: Sequence[int]) -> TokenBatch:
    return TokenBatch.build(
        [np.array(PROMPTS[i], dtype=np.int32) for i in rows],
        [np.array(COMPLETIONS[i], dtype=np.int32) for i in rows],
        [np.zeros(0, dtype=np.int32) for _ in rows],
        [np.array(LOSS_MASKS[i], dtype=bool) for i in rows],
    )


@pytest.fixture(scope="module")
def base_logp(tiny_qwen2_dir: Path) -> torch.Tensor:
    """[4, 6] the current weights' log-probabilities of the completions (polyrl's scoring, no grad):
    the fixed log-ratios are taken around them."""
    with torch.no_grad():
        return sequence_logprobs_and_entropy(_load(tiny_qwen2_dir), _batch(ALL_ROWS[0]), TEMPERATURE)[0]


@contextmanager
def _rng_kept() -> Iterator[None]:
    """Trainer.__init__ seeds every generator; the suite's other tests keep theirs."""
    state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng():
        yield
    random.setstate(state)
    np.random.set_state(np_state)


def _trl_trainer(model_dir: Path, out: Path, pair: Pair, micro_batches: int) -> Any:
    args = trl.GRPOConfig(
        output_dir=str(out),
        report_to=[],
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=len(PROMPTS) // micro_batches,
        gradient_accumulation_steps=micro_batches,
        num_generations=2,
        max_completion_length=MAX_COMPLETION,
        temperature=TEMPERATURE,
        use_bias_correction_kl=False,
        **pair.trl,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    with _rng_kept():
        trainer = trl.GRPOTrainer(
            model=_load(model_dir),
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args,
            train_dataset=datasets.Dataset.from_dict({"prompt": ["x"] * len(PROMPTS)}),
            processing_class=tokenizer,
        )
    # What Trainer.train sets before each step; vLLM is not installed, so its flag is set here, where
    # `_compute_loss` reads it (it applies the ratio it is given).
    trainer.current_gradient_accumulation_steps = micro_batches
    trainer.use_vllm = pair.vllm_is
    return trainer


@dataclass(frozen=True)
class Inputs:
    """The fixed log-probabilities of all four rows, [4, 6]."""

    prox: torch.Tensor
    behav: torch.Tensor
    ref: torch.Tensor

    @classmethod
    def around(cls, base: torch.Tensor) -> Inputs:
        prox = base - LOG_RATIO
        return cls(prox, prox - IS_LOG, base + REF_LOG)


def _trl_inputs(rows: list[int], pair: Pair, x: Inputs) -> dict[str, torch.Tensor]:
    """TRL's per-micro-batch inputs (`_generate_and_score_completions`' output): prompts left-padded
    and completions right-padded over the whole generation batch, then split by rows."""
    n = len(PROMPTS)
    width, rmax = max(map(len, PROMPTS)), max(map(len, COMPLETIONS))
    prompt_ids = torch.full((n, width), PAD)
    prompt_mask = torch.zeros(n, width, dtype=torch.long)
    completion_ids = torch.full((n, rmax), PAD)
    completion_mask = torch.zeros(n, rmax, dtype=torch.long)
    tool_mask = torch.zeros(n, rmax, dtype=torch.long)
    for i, (p, c, m) in enumerate(zip(PROMPTS, COMPLETIONS, LOSS_MASKS, strict=True)):
        prompt_ids[i, width - len(p) :] = torch.tensor(p)
        prompt_mask[i, width - len(p) :] = 1
        completion_ids[i, : len(c)] = torch.tensor(c)
        completion_mask[i, : len(c)] = 1
        tool_mask[i, : len(c)] = torch.tensor(m)
    mask = completion_mask * tool_mask
    out = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "advantages": ADVANTAGES,
        "ref_per_token_logps": x.ref,
    }
    if not pair.on_policy:
        out["old_per_token_logps"] = x.prox
    if pair.vllm_is:
        cfg = pair.trl
        out["importance_sampling_ratio"] = _trl_is_ratio(
            x.prox,
            x.behav,
            mask.float(),
            cfg["vllm_importance_sampling_mode"],
            low=cfg["vllm_importance_sampling_clip_min"],
            high=cfg["vllm_importance_sampling_clip_max"],
        )
    micro = {k: v[rows] for k, v in out.items()}
    micro["num_items_in_batch"] = mask.sum()  # over the generation batch, as TRL's
    return micro


def _trl_loss(trainer: Any, pair: Pair, micro_batches: list[list[int]], x: Inputs) -> torch.Tensor:
    losses = [trainer._compute_loss(trainer.model, _trl_inputs(rows, pair, x)) for rows in micro_batches]
    total: torch.Tensor = sum(losses[1:], losses[0])
    total.backward()
    return total.detach()


def _our_loss(model: Any, pair: Pair, micro_batches: list[list[int]], x: Inputs) -> torch.Tensor:
    """The step's loss as the trainer forms it: micro-batch numerators over the step's counts."""
    numerators, tokens = [], 0.0
    for rows in micro_batches:
        batch = _batch(rows)
        assert batch.targets.shape[1] == LOG_RATIO.shape[1]  # the fixed tensors' layout
        logp, entropy = sequence_logprobs_and_entropy(model, batch, TEMPERATURE)
        prox = logp.detach() if pair.on_policy else x.prox[rows]
        behav = prox if pair.on_policy else x.behav[rows]
        num, stats = policy_loss(
            logp,
            prox,
            behav,
            ADVANTAGES[rows],
            batch.response_mask,
            cfg=pair.ours,
            ref_logp=x.ref[rows],
            entropy=entropy,
        )
        numerators.append(num)
        tokens += stats.tokens
    sequences = sum(map(len, micro_batches))
    total = sum(numerators[1:], numerators[0]) / aggregation_denominator(
        pair.ours.loss_aggregation, tokens, sequences
    )
    total.backward()
    return total.detach()


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _compare(
    model_dir: Path, out: Path, base: torch.Tensor, pair: Pair, micro_batches: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    x = Inputs.around(base)
    trainer = _trl_trainer(model_dir, out, pair, len(micro_batches))
    theirs = _trl_loss(trainer, pair, micro_batches, x)
    ours_model = _load(model_dir)
    ours = _our_loss(ours_model, pair, micro_batches, x)
    torch.testing.assert_close(theirs, ours * pair.scale, rtol=1e-5, atol=1e-7)
    their_grads, our_grads = _grads(trainer.model), _grads(ours_model)
    assert their_grads.keys() == our_grads.keys() and their_grads
    for name, g in their_grads.items():
        torch.testing.assert_close(g, our_grads[name] * pair.scale, rtol=1e-4, atol=1e-6, msg=name)
    return theirs, ours


def test_the_scores_match_trls(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    """TRL's fused LM head and polyrl's chunked scorer agree on every trained token (left-padded
    prompts on TRL's side: rotary attention depends on relative positions only)."""
    trainer = _trl_trainer(tiny_qwen2_dir, tmp_path, PAIRS["dapo~token-mean"], 1)
    x = _trl_inputs(ALL_ROWS[0], PAIRS["dapo~token-mean"], Inputs.around(torch.zeros(4, 6)))
    ids = torch.cat([x["prompt_ids"], x["completion_ids"]], dim=1)
    attn = torch.cat([x["prompt_mask"], x["completion_mask"]], dim=1)
    with torch.no_grad():
        logp, entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attn, ids.shape[1] - x["prompt_ids"].shape[1], compute_entropy=True
        )
        our_logp, our_entropy = sequence_logprobs_and_entropy(
            _load(tiny_qwen2_dir), _batch(ALL_ROWS[0]), TEMPERATURE
        )
    trained = (x["completion_mask"] * x["tool_mask"]).bool()
    torch.testing.assert_close(logp[trained], our_logp[trained], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[trained], our_entropy[trained], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_one_micro_batch_matches_trl(
    name: str, tiny_qwen2_dir: Path, tmp_path: Path, base_logp: torch.Tensor
) -> None:
    pair = PAIRS[name]
    _compare(tiny_qwen2_dir, tmp_path, base_logp, pair, ALL_ROWS)
    # The fixed ratios make each option act: some tokens clip, some corrections trigger.
    x = Inputs.around(base_logp)
    _, stats = policy_loss(
        base_logp, x.prox, x.behav, ADVANTAGES, _batch(ALL_ROWS[0]).response_mask, cfg=pair.ours
    )
    assert pair.on_policy or stats.clip_frac > 0
    if pair.vllm_is:
        assert stats.is_truncated_frac + stats.is_masked_frac > 0


@pytest.mark.parametrize(
    "name", ["grpo~seq-mean-token-mean", "dapo~token-mean", "dr_grpo~seq-mean-token-sum"]
)
def test_two_accumulated_micro_batches_match_trl(
    name: str, tiny_qwen2_dir: Path, tmp_path: Path, base_logp: torch.Tensor
) -> None:
    _compare(tiny_qwen2_dir, tmp_path, base_logp, PAIRS[name], TWO_MICRO_BATCHES)


def test_bnpo_is_token_mean_only_within_one_micro_batch(
    tiny_qwen2_dir: Path, tmp_path: Path, base_logp: torch.Tensor
) -> None:
    """bnpo normalises each micro-batch by its own token count (10 and 7 here), token-mean (and dapo)
    by the step's: over two micro-batches they differ."""
    with pytest.raises(AssertionError, match="not close"):
        _compare(tiny_qwen2_dir, tmp_path, base_logp, PAIRS["bnpo~token-mean"], TWO_MICRO_BATCHES)
