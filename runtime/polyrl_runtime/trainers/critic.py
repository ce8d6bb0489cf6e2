"""PPO's value model (`algorithm.critic`) on a policy's trainer ranks: the values, the GAE
advantages and value targets of a step, the critic's own optimizer steps, its checkpoint.

The value model is a backbone (the critic's `model`, else the policy's, loaded again as a copy of
its own: never the trained policy's module) with a linear head hidden -> 1 whose weight and bias
start at 0, so every first value is 0 and GAE's first advantages are the plain returns. The value of
response position t is the head's output at the hidden state that predicts token t (the position of
its logits, `TokenBatch.gather_index`): the value of the state before the token. The backbone's own
output head takes no part and, unless tied to the input embeddings, is frozen.

Optimizer: a DeepSpeed engine of its own, built from the policy's DeepSpeed config (its ZeRO stage,
gradient clipping, precision, micro-batch size) in the policy's process group, beside the policy's
engine in the same process. So the critic is partitioned, its gradients averaged over the ranks and
clipped, and its state checkpointed exactly as the policy's are, with no second code path for each
ZeRO stage. (torch AdamW with hand all-reduced gradients would keep a whole copy of the optimizer
state on every rank and need its own clipping and checkpoint format.) Its learning rate is
`critic.lr`, constant. Its optimizer steps are guarded like the policy's (trainers/nonfinite.py).

A step (algorithms/gae.py for the formulas): before any update every micro-batch's values are scored
once (the old values V_old); each trained token's reward is the row's signal (ppo's: the raw reward)
at its last trained token, plus -klCoef * kl_t at each token under klIn reward (the KL against the
proximal log-probabilities, as algorithms/kl_reward.py takes it); GAE gives advantages and returns;
the advantages are normalised over the step's trained tokens on every rank as advantageNorm says
(`kl_reward.token_advantages`) and the policy's loss takes them per token. The critic then makes the
policy's passes over the same mini-batches, one optimizer step per mini-batch per epoch, on the
clipped value loss averaged over the mini-batch's trained tokens of every rank.

Checkpoint: DeepSpeed's, in `critic/` of the rank's trainer checkpoint directory, under the same tag
(a policy checkpointed before it had a critic has none: the critic then starts as built).

A LoRA policy's critic is instead a value adapter and head on the policy's own base, behind the same
engine interface (trainers/value_adapter.py); the steps above are the same.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from polyrl_operator.api import Policy
from polyrl_operator.api.algorithm import Critic as CriticSpec
from polyrl_runtime.algorithms.gae import gae, token_rewards, value_loss
from polyrl_runtime.algorithms.kl_reward import AgentStats, token_advantages, token_kl
from polyrl_runtime.algorithms.losses import LossConfig, TokenBatch
from polyrl_runtime.experience.types import Sample
from polyrl_runtime.models import is_hf, resolve_dtype
from polyrl_runtime.trainers.build import (
    enable_gradient_checkpointing,
    hf_zero3_config,
    load_policy_model,
    set_learning_rate,
)
from polyrl_runtime.trainers.deepspeed_import import import_deepspeed
from polyrl_runtime.trainers.nonfinite import StepGuard
from polyrl_runtime.trainers.process_group import allreduce
from polyrl_runtime.trainers.step_inputs import (
    PAD_ROW,
    Allreduce,
    Scorer,
    StepInputs,
    ValueTargets,
    mini_batch_counts,
    token_batch,
)
from polyrl_runtime.trainers.value_adapter import ValueAdapterEngine
from polyrl_runtime.trainers.value_head import ValueHead, head_values, hidden_size

log = structlog.get_logger(__name__)

CRITIC_DIR = "critic"  # the critic's part of a rank's trainer checkpoint directory


class ValueModel(torch.nn.Module):
    """A backbone and its value head: [B, R] the value before each response token."""

    def __init__(self, backbone: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = ValueHead(hidden_size(backbone), dtype)

    def forward(
        self, ids: torch.Tensor, mask: torch.Tensor, gather_index: torch.Tensor, response_mask: torch.Tensor
    ) -> torch.Tensor:
        return head_values(
            self.backbone, self.head, ids, mask, gather_index=gather_index, response_mask=response_mask
        )


def freeze_output_head(backbone: torch.nn.Module) -> None:
    """The backbone's logits head is unused by the value model: no gradient, no optimizer state for
    it, unless it is the input embedding too (tied weights, which the values do use)."""
    get_out = getattr(backbone, "get_output_embeddings", None)
    get_in = getattr(backbone, "get_input_embeddings", None)
    head = get_out() if callable(get_out) else None
    embed = get_in() if callable(get_in) else None
    if not isinstance(head, torch.nn.Module):
        return
    tied = embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", 0)
    if not tied:
        head.requires_grad_(False)


def critic_policy(policy: Policy) -> Policy:
    """The policy as the critic's backbone is loaded: with the critic's model when it names one."""
    spec = policy.algorithm.critic
    assert spec is not None
    return policy if spec.model is None else policy.model_copy(update={"model": spec.model})


@dataclass(frozen=True)
class ValueReport:
    """The critic's part of a step: the mean of its optimizer steps' value losses (this rank's share
    of each: summed over the ranks it is theirs) and the fraction of its trained tokens whose clipped
    term was the larger."""

    loss: float
    clip_frac: float
    skipped: int = 0  # its optimizer steps skipped for a non-finite loss or gradient


@dataclass(frozen=True)
class Whitening:
    """How a step's advantages are normalised over every rank's trained tokens (kl_reward.token_advantages)."""

    norm: str
    algorithm: str
    global_std: float | None
    allreduce: Allreduce
    agent_stats: AgentStats


class Critic:
    """A rank's value model and its DeepSpeed engine (see the module docstring). Build it on every
    rank of the policy at once, after the policy's engine (ZeRO-3 partitions collectively)."""

    def __init__(
        self,
        spec: CriticSpec,
        engine: Any,
        optimizer: Any,
        guard: StepGuard,
        hf_config: Any,
        *,
        world: int,
        micro_batch_size: int,
    ) -> None:
        self.spec, self.engine, self.optimizer, self.guard = spec, engine, optimizer, guard
        self.hf_config = hf_config  # transformers' HfDeepSpeedConfig under ZeRO-3: outlives the model
        self.world, self.micro_batch_size = world, micro_batch_size
        self.clip = spec.value_clip or None  # 0: unclipped
        self._gas = 1
        # A value adapter computes only while it is the active one (trainers/value_adapter.py).
        self._active: Callable[[], contextlib.AbstractContextManager[Any]] = getattr(
            engine, "active", contextlib.nullcontext
        )

    @classmethod
    def build(
        cls,
        policy: Policy,
        config: dict[str, Any],
        *,
        seed: int,
        cuda: bool,
        device: torch.device,
        world: int,
        rank: int = 0,
        policy_model: torch.nn.Module | None = None,
    ) -> Critic:
        """`config`: the policy's DeepSpeed config (trainers/build.py `deepspeed_config`);
        `policy_model`: the policy's trained module, which a LoRA policy's critic is an adapter on
        (trainers/value_adapter.py)."""
        spec = policy.algorithm.critic
        if spec is None:
            raise ValueError(f"policy {policy.name}: algorithm.critic is not set")
        reduce = functools.partial(allreduce, world=world, cuda=cuda)
        if policy.algorithm.lora is not None:
            if policy_model is None:
                raise ValueError(f"policy {policy.name}: a LoRA policy's critic needs the policy's model")
            adapter = ValueAdapterEngine(
                policy_model, policy, seed=seed, device=device, rank=rank, world=world
            )
            guard = StepGuard.of(adapter, adapter.optimizer, {}, watch_gradients=False, allreduce=reduce)
            return cls(
                spec,
                adapter,
                adapter.optimizer,
                guard,
                None,
                world=world,
                micro_batch_size=policy.trainer.micro_batch_size,
            )
        deepspeed = import_deepspeed()
        source = critic_policy(policy)
        dtype = resolve_dtype(source.model.dtype, cuda=cuda)
        hf_config = hf_zero3_config(source, config)
        backbone = load_policy_model(source, seed, cuda)
        if policy.trainer.gradient_checkpointing:
            enable_gradient_checkpointing(backbone, source)
        freeze_output_head(backbone)
        model = ValueModel(backbone, dtype)
        zero3 = int(config["zero_optimization"]["stage"]) == 3
        if zero3 and not is_hf(source.model.uri):
            deepspeed.zero.Init(module=model, config_dict_or_path=config, dtype=dtype)
        elif not zero3:
            model.to(device)
        # (ZeRO-3, Hugging Face: the backbone was partitioned as it loaded; the engine converts the head.)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        set_learning_rate(engine.optimizer, spec.lr)
        guard = StepGuard.of(engine, optimizer, config, watch_gradients=True, allreduce=reduce)
        log.info("critic.ready", policy=policy.name, uri=source.model.uri, zero=policy.trainer.zero_stage)
        return cls(
            spec,
            engine,
            optimizer,
            guard,
            hf_config,
            world=world,
            micro_batch_size=policy.trainer.micro_batch_size,
        )

    @property
    def device(self) -> torch.device:
        device: torch.device = next(self.engine.module.parameters()).device
        return device

    def warming_up(self, step: int) -> bool:
        """Whether training step `step` (from 1) trains the critic alone (`critic.warmupSteps`)."""
        return step <= self.spec.warmup_steps

    def values(self, tb: TokenBatch) -> torch.Tensor:
        """[B, R] the value before each response token (0 where not trained), with gradient."""
        d = self.device
        with self._active():
            out: torch.Tensor = self.engine(
                tb.input_ids.to(d), tb.attention_mask.to(d), tb.gather_index.to(d), tb.response_mask.to(d)
            )
        return out

    def advantages(
        self,
        scorer: Scorer,
        samples: list[Sample],
        micro_rows: list[list[int]],
        *,
        prox: list[torch.Tensor | None],
        refs: list[torch.Tensor | None],
        signals: torch.Tensor,
        cfg: LossConfig,
        whitening: Whitening,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], ValueTargets]:
        """Each micro-batch's [rows, R] GAE advantages (normalised), its reference logprobs (`refs`,
        or under klIn reward those scored here) and the critic's targets: values and returns before
        any update. A collective (the values' forwards under ZeRO-3, the normalisation): every rank
        calls it, with its empty micro-batches too."""
        shaped = cfg.kl_in == "reward"
        advs: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        agents: list[list[str]] = []
        old_values: list[torch.Tensor | None] = []
        returns: list[torch.Tensor | None] = []
        refs = list(refs)
        with torch.no_grad():
            for k, rows in enumerate(micro_rows):
                if not rows:
                    self.values(PAD_ROW)  # the forward every rank runs (ZeRO-3's gathers)
                    advs.append(torch.zeros(0, 0))
                    masks.append(torch.zeros(0, 0))
                    agents.append([])
                    old_values.append(None)
                    returns.append(None)
                    continue
                tb = token_batch(samples, rows)[0]
                mask = tb.response_mask
                v = self.values(tb).cpu()
                shaping = None
                if shaped:
                    ref = scorer.reference(tb)
                    if ref is None:  # the API refuses klIn reward without klCoef > 0, which builds one
                        raise ValueError("algorithm.klIn reward needs klCoef > 0")
                    refs[k] = ref
                    old = prox[k]
                    old = scorer.logprobs(tb) if old is None else old
                    shaping = -cfg.kl_coef * token_kl(ref, old, cfg.kl_estimator).cpu()
                reward = token_rewards(signals[rows], mask, shaping)
                adv, ret = gae(reward, v, mask, self.spec.gamma, self.spec.gae_lambda)
                advs.append(adv)
                masks.append(mask)
                agents.append([samples[i].agent for i in rows])
                old_values.append(v)
                returns.append(ret)
        w = whitening
        whitened = token_advantages(
            advs,
            masks,
            agents,
            w.norm,
            algorithm=w.algorithm,
            allreduce=w.allreduce,
            agent_stats=w.agent_stats,
            global_std=w.global_std,
        )
        return whitened, refs, ValueTargets(old_values, returns)

    def _set_gas(self, gas: int) -> None:
        if gas != self._gas:
            self.engine.set_train_batch_size(self.micro_batch_size * gas * self.world)
            self._gas = gas

    def _loss(self, inputs: StepInputs, k: int) -> tuple[torch.Tensor, float, int]:
        """Micro-batch `k`'s value loss summed over its trained tokens, its clipped fraction and
        its trained tokens; an empty one's zero-weighted forward keeps the ranks' collectives aligned."""
        rows = inputs.layout.micro_rows[k]
        targets = inputs.value_targets
        assert targets is not None
        old, ret = targets.old_values[k], targets.returns[k]
        if not rows or old is None or ret is None:
            return self.values(PAD_ROW).sum() * 0.0, 0.0, 0
        tb = token_batch(inputs.samples, rows)[0]
        v = self.values(tb)
        d = v.device
        mask = tb.response_mask.to(d)
        loss_sum, frac = value_loss(v, old.to(d), ret.to(d), mask, self.clip)
        return loss_sum, frac, int(mask.sum())

    def train(self, inputs: StepInputs, epochs: int, allreduce: Allreduce) -> ValueReport:
        """`epochs` passes over the step's mini-batches, one optimizer step per mini-batch per pass,
        each on the mean value loss over the mini-batch's trained tokens of every rank (DeepSpeed's
        division by the accumulation count and averaging over ranks undone, as the policy's are)."""
        counts = mini_batch_counts(inputs.samples, inputs.layout.micro_rows, inputs.minis)
        tokens = allreduce(counts[0::2])
        self._set_gas(inputs.layout.per_mini)
        guard = self.guard
        guard.begin()
        mark: Callable[[bool], None] | None = getattr(self.engine, "set_gradient_accumulation_boundary", None)
        total, clipped, seen = 0.0, 0.0, 0
        for _ in range(epochs):
            for mini, n in zip(inputs.minis, tokens, strict=True):
                denom = max(n, 1.0)
                scale = self.world * len(mini) / denom
                for pos, k in enumerate(mini):
                    if mark is not None:
                        mark(pos == len(mini) - 1)
                    with self._active():  # from the forward through the backward
                        loss_sum, frac, t = self._loss(inputs, k)
                        self.engine.backward(loss_sum * scale)
                    value = float(loss_sum.detach())
                    total += value / denom
                    clipped += frac * t
                    seen += t
                    guard.loss(value)
                    guard.step(trains=n > 0)
        guard.log_skips(model="critic")
        steps = max(epochs * len(inputs.minis), 1)
        return ValueReport(loss=total / steps, clip_frac=clipped / max(seen, 1), skipped=guard.skipped)

    def save(self, local: Path, tag: str) -> None:
        """Into `critic/` of the rank's (local, staged) trainer checkpoint directory."""
        self.engine.save_checkpoint(str(local / CRITIC_DIR), tag=tag, client_state={})

    def load(self, local: Path, tag: str) -> None:
        """From `save`'s directory; a checkpoint of the policy from before it had a critic has none,
        and the critic stays as built (a warning says so)."""
        directory = local / CRITIC_DIR
        if not (directory / tag).is_dir():
            log.warning(
                "critic.checkpoint_missing", directory=str(directory), tag=tag, why="the critic starts fresh"
            )
            return
        path, _ = self.engine.load_checkpoint(str(directory), tag=tag)
        if path is None:
            raise RuntimeError(f"the critic's checkpoint {directory / tag} could not be loaded")
