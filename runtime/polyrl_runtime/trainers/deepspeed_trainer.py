"""DeepSpeed trainer rank: ZeRO stage from `trainer.zeroStage`, gloo on CPU, NCCL on GPU.

Each rank is a Ray actor placed on one unit of a `polyrl/<policy>/trainer` resource (a trainer pod
offers one per rank: one per GPU, or `trainer.ranksPerPod` on CPU) and, on GPU, one GPU of its own.
Ranks of one policy form their own process group (rendezvous at rank 0's address); what a rank is
built of (model, reference, optimizer, schedule, DeepSpeed config) is in `trainers/build.py`. A step:
every rank pulls its share of the step's samples from the experience buffer under a lease and
fixes what it trains on before the first update (trainers/step_inputs.py: the advantages, from
all-reduced statistics; the micro-batches and mini-batches, the same counts on every rank, padding
with empty ones; the proximal logprobs). Then it makes `algorithm.epochs` passes over the
mini-batches, one optimizer step per mini-batch per pass (estimators.py: by default one per batch,
ppo one per micro-batch), which every rank skips when any saw a non-finite loss or gradient
(trainers/nonfinite.py). The driver acks the leases after the step, so a rank that dies mid-step
has its samples redelivered.

On a device pool a rank moves its state to host memory between its phases (`offload`, `restore`:
trainers/offload.py); while it is offloaded every call that needs its tensors fails with
`TrainerOffloadedError` (the publishing, checkpoint and offload calls: trainers/rank_state.py).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import ray
import structlog
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.algorithms.advantages import AdvantageStats, agent_stats, scale_stats
from polyrl_runtime.algorithms.estimators import normalisation, update_schedule
from polyrl_runtime.algorithms.losses import (
    LossConfig,
    TokenBatch,
    aggregation_denominator,
    policy_loss,
    sequence_logprobs,
    sequence_logprobs_and_entropy,
)
from polyrl_runtime.cpusets import pin_from_env
from polyrl_runtime.device_memory import HostBuffers, ParkedMemory
from polyrl_runtime.experience.batches import SampleBatch
from polyrl_runtime.experience.client import BufferClient
from polyrl_runtime.models import policy_seed
from polyrl_runtime.netmap import free_port
from polyrl_runtime.trainers.api import StepResult
from polyrl_runtime.trainers.batching import StepLayout, share_micro_batches, step_layout
from polyrl_runtime.trainers.build import (
    Built,
    build_trainer,
    learning_rate,
    set_learning_rate,
)
from polyrl_runtime.trainers.critic import Critic, Whitening
from polyrl_runtime.trainers.nonfinite import StepGuard
from polyrl_runtime.trainers.process_group import (
    allreduce,
    gather_agent_stats,
    join_process_group,
)
from polyrl_runtime.trainers.rank_state import RankState
from polyrl_runtime.trainers.shaping import shape
from polyrl_runtime.trainers.step_inputs import (
    PAD_ROW,
    LossTotals,
    Scorer,
    StepInputs,
    batch_advantages,
    mini_batch_counts,
    score_before_update,
    signals_of,
    token_batch,
)
from polyrl_runtime.trainers.step_result import step_result
from polyrl_runtime.trainers.teacher import Teacher

log = structlog.get_logger(__name__)


class DeepSpeedTrainer(RankState):
    # Whether the rank watches its gradients for non-finite values (trainers/nonfinite.py): DeepSpeed
    # applies the client optimizer unchecked in some configurations.
    watches_gradients = True

    def __init__(
        self,
        name: str,
        policy_json: str,
        job_seed: int,
        *,
        rank: int,
        world: int,
        buffer: BufferClient,
        temperature: float = 1.0,
        total_steps: int = 1,
        gpus: int = 0,
        adapter_only: bool = False,
        teacher_json: str | None = None,
    ) -> None:
        # Cheap on purpose: the model is built in `setup`, once the process group exists (ZeRO-3
        # partitions it collectively as it is constructed).
        pin_from_env()
        torch.set_num_threads(1)
        self.name = name
        self.spec = Policy.model_validate_json(policy_json)
        self.rank = rank
        self.world = world
        self.local_rank = 0  # its index among its policy's ranks on its node, given to `setup`
        self.total_steps = total_steps
        self.buffer = buffer
        self.temperature = temperature
        # Its engines hold the base model and this policy's LoRA adapter among others' (policies that
        # share a base): publish the adapter's tensors only.
        self.adapter_only = adapter_only
        self.adapter_name: str | None = None  # the adapter to publish (None: the model's active one)
        self.algo = self.spec.algorithm
        self.norm = normalisation(self.algo.name, self.algo.advantage_norm)
        self.loss_cfg = LossConfig.of(self.algo)
        # Mini-batches per step (None: one per micro-batch) and passes over them (estimators.py).
        self.mini_batches, self.epochs = update_schedule(
            self.algo.name, self.algo.mini_batches, self.algo.epochs
        )
        self.version = 0
        self.cuda = gpus > 0 and torch.cuda.is_available()  # gpus: its pod's (or pool's)
        self.seed = policy_seed(job_seed, self.spec.name)
        self.model: Any = None  # the engine's module, once `setup` built it
        self.ref: Any = None
        self.engine: Any = None
        self._built: Built | None = None
        self._gas = 0
        self._guard: StepGuard | None = None  # its optimizer steps, once `setup` built the engine
        self.job_seed = job_seed
        # algorithm.distillation's frozen teacher (its policy: `teacher_json`), built in `setup`.
        self._teacher_spec = Policy.model_validate_json(teacher_json) if teacher_json else None
        self.teacher: Teacher | None = None
        self.critic: Critic | None = None  # algorithm.critic's value model (trainers/critic.py), from `setup`
        self.device = torch.device("cpu")
        self._offloaded: ParkedMemory | None = None  # the rank's state while in host memory
        self._host_buffers = HostBuffers()  # pinned once, reused by every offload

    def address(self) -> tuple[str, int]:
        util: Any = ray.util
        return str(util.get_node_ip_address()), free_port()

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def setup(self, master_addr: str, master_port: int, local_rank: int = 0) -> None:
        """Join the policy's process group, then build the model, reference and DeepSpeed engine
        (all ranks at once). `local_rank`: its index among its policy's ranks on its node (the
        driver's `node_local_ranks`; 0 for a rank alone on its node)."""
        self.local_rank = local_rank
        self.device = join_process_group(
            master_addr, master_port, rank=self.rank, world=self.world, local_rank=local_rank, cuda=self.cuda
        )
        self._built = self._build(self.device)
        self.engine, self.ref = self._built.engine, self._built.ref
        self.model = self.engine.module
        self._gas = 1
        # A partial, not the bound `_allreduce`: a guard referring back to its rank would make a
        # cycle, and a dropped rank would outlive its last reference (ZeRO-3: with its
        # HfDeepSpeedConfig, which makes every Hugging Face model loaded meanwhile a partitioned one).
        reduce = functools.partial(allreduce, world=self.world, cuda=self.cuda)
        built = self._built
        self._guard = StepGuard.of(
            self.engine,
            built.optimizer,
            built.config,
            watch_gradients=self.watches_gradients,
            allreduce=reduce,
        )
        if self._teacher_spec is not None:
            self.teacher = Teacher(
                self._teacher_spec, self.spec, job_seed=self.job_seed, cuda=self.cuda, device=self.device
            )
        if self.algo.critic is not None:
            self.critic = Critic.build(
                self.spec,
                built.config,
                seed=self.seed,
                cuda=self.cuda,
                device=self.device,
                world=self.world,
                rank=self.rank,
                policy_model=self.model,
            )
        log.info(
            "trainer.ready",
            policy=self.spec.name,
            rank=self.rank,
            local_rank=self.local_rank,
            world=self.world,
            device=str(self.device),
            zero=self.spec.trainer.zero_stage,
        )

    def _build(self, device: torch.device) -> Built:
        return build_trainer(
            self.spec, seed=self.seed, cuda=self.cuda, device=device, total_steps=self.total_steps
        )

    # -- one step ------------------------------------------------------------------------------

    def _allreduce(self, values: list[float], op: str = "sum") -> list[float]:
        return allreduce(values, world=self.world, cuda=self.cuda, op=op)

    def _agent_stats(self, signals: torch.Tensor, agents: tuple[str, ...]) -> dict[str, AdvantageStats]:
        """Every agent's signal statistics over all ranks (ranks may hold different agents)."""
        return gather_agent_stats(agent_stats(signals, agents, self.algo.name), world=self.world)

    def _set_gas(self, gas: int) -> None:
        if gas != self._gas:
            self.engine.set_train_batch_size(self.spec.trainer.micro_batch_size * gas * self.world)
            self._gas = gas

    def _mark_boundary(self, boundary: bool) -> None:
        """Tell DeepSpeed whether the next pass ends its mini-batch: its own counter of passes runs
        across training steps, and would put the boundary mid-mini-batch once the number of
        micro-batches per mini-batch changes. (The adapter engine restarts its count at each boundary.)"""
        mark = getattr(self.engine, "set_gradient_accumulation_boundary", None)
        if mark is not None:
            mark(boundary)

    def _scorer(self) -> Scorer:
        return Scorer.of(self.engine, self.ref, self.temperature, self.loss_cfg, self.algo.lora is not None)

    def _layout(self, batch: SampleBatch | None, n_micro: int) -> StepLayout:
        """The step's micro-batches and mini-batches, the same counts on every rank (trainers/batching.py)."""
        trainer = self.spec.trainer
        budget = trainer.max_tokens_per_micro_batch
        groups = share_micro_batches(batch, trainer.micro_batch_size, budget, self.mini_batches)
        if budget is not None:  # the count depends on the lengths: every rank runs the largest
            n_micro = int(self._allreduce([float(max(n_micro, len(groups)))], op="max")[0])
        return step_layout(groups, n_micro, self.mini_batches)

    def _forward_loss(
        self,
        tb: TokenBatch,
        behav: torch.Tensor,
        adv: torch.Tensor,
        prox: torch.Tensor | None,
        ref: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """`adv` per row or per token; `prox`: the rows' proximal logprobs (None: the weights now);
        `ref`: the rows' reference logprobs when scored already."""
        # The entropy is always computed (a metric); it enters the loss only with entropyCoef > 0.
        logp, entropy = sequence_logprobs_and_entropy(self.engine, tb, self.temperature)
        device = logp.device
        mask = tb.response_mask.to(device)
        ref = self._scorer().reference(tb) if ref is None else ref.to(device)
        prox_logp = logp.detach() if prox is None else prox.to(device)
        return policy_loss(
            logp,
            prox_logp,
            behav.to(device),
            adv.to(device),
            mask,
            cfg=self.loss_cfg,
            ref_logp=ref,
            entropy=entropy,
        )

    def _pass(self, inputs: StepInputs, k: int, totals: LossTotals) -> torch.Tensor:
        """Micro-batch `k`'s forward: its loss numerator (with gradient), its statistics into `totals`."""
        rows = inputs.layout.micro_rows[k]
        if not rows:
            # Keep collectives aligned across ranks: a zero-weighted forward and backward. A real
            # forward (not a sum of the parameters) because under ZeRO-3 a parameter is an empty
            # shard outside the forward's gather hooks, and its gradient must have the full size.
            return sequence_logprobs(self.engine, PAD_ROW, self.temperature).sum() * 0.0
        tb, behav = token_batch(inputs.samples, rows)
        loss_sum, ls = self._forward_loss(tb, behav, inputs.advantages[k], inputs.prox[k], inputs.refs[k])
        totals.add(ls)
        return loss_sum

    def _inputs(self, batch: SampleBatch | None, n_micro: int, global_std: float | None) -> StepInputs:
        """Everything the step trains on, fixed before its first update (trainers/step_inputs.py);
        collectives, in the same order on every rank."""
        samples = batch.samples() if batch is not None else []
        layout = self._layout(batch, n_micro)
        minis = layout.mini_batches()
        signals = signals_of(batch)
        local = scale_stats(signals, self.algo.name)
        # One all-reduce: the advantage statistics and each mini-batch's token and sequence counts.
        reduced = self._allreduce(
            [local.count, local.total, local.total_sq, *mini_batch_counts(samples, layout.micro_rows, minis)]
        )
        counts = reduced[3:]
        adv = batch_advantages(
            signals,
            AdvantageStats(*reduced[:3]),
            batch.agents if batch is not None else (),
            norm=self.norm,
            algorithm=self.algo.name,
            global_std=global_std,
            agent_stats=self._agent_stats,
        )
        updates = self.epochs * layout.minis
        scorer = self._scorer()
        kl_shaped = self.loss_cfg.kl_in == "reward"
        # More than one optimizer step: every one is clipped around the logprobs of the weights the
        # step began with, and (several epochs) the reference is scored once rather than per pass.
        prox, refs = score_before_update(
            scorer,
            samples,
            layout.micro_rows,
            proximal=updates > 1,
            reference=self.epochs > 1 and not kl_shaped,
        )
        shaped = shape(
            scorer,
            samples,
            layout.micro_rows,
            advantages=[adv[rows] for rows in layout.micro_rows],
            prox=prox,
            refs=refs,
            signals=signals,
            cfg=self.loss_cfg,
            whitening=Whitening(self.norm, self.algo.name, global_std, self._allreduce, self._agent_stats),
            policy=self.spec.name,
            critic=self.critic,
            teacher=self.teacher,
        )
        agg = self.loss_cfg.loss_aggregation
        return StepInputs(
            samples,
            signals,
            layout,
            minis,
            denominators=[
                aggregation_denominator(agg, counts[2 * j], counts[2 * j + 1]) for j in range(len(minis))
            ],
            trains=[counts[2 * j + 1] > 0 for j in range(len(minis))],
            advantages=shaped.advantages,
            prox=prox,
            refs=shaped.refs,
            value_targets=shaped.value_targets,
            distill=(shaped.distill_kl_sum, shaped.distill_tokens),
        )

    def train_step(
        self, step: int, share: int, n_micro: int, global_std: float | None = None, version: int | None = None
    ) -> StepResult:
        # `version`: the weight version this step publishes; the step unless the policy's trainer
        # restarted (coordinator/policy_restart.py: versions then run ahead of steps).
        version = step if version is None else version
        self._require_resident(f"training step {step}")
        start = time.perf_counter()
        lease = ray.get(self.buffer.pull(self.spec.name, self.name, share, 60.0)) if share else None
        batch: SampleBatch | None = lease.batch if lease is not None else None
        inputs = self._inputs(batch, n_micro, global_std)
        self._set_gas(inputs.layout.per_mini)
        # Training step `step` produces version `step`: the schedule's step index is step - 1, the same
        # for every optimizer step of it and after a resume.
        lr = learning_rate(step - 1, self.algo, self.total_steps)
        set_learning_rate(self.engine.optimizer, lr)
        totals = LossTotals()
        guard = self._guard
        assert guard is not None
        guard.begin()
        self.begin_weight_update()
        # critic.warmupSteps: the critic trains alone, the policy's weights stay.
        for _ in range(0 if self.critic is not None and self.critic.warming_up(step) else self.epochs):
            for mini, denom, trains in zip(inputs.minis, inputs.denominators, inputs.trains, strict=True):
                # Each optimizer step's loss is its mini-batch's: the numerators of its micro-batches (on
                # every rank) over its all-reduced token or sequence count (lossAggregation), as AReaL
                # (train_batch normalises by the loss weight of the mini-batch it is given) and verl
                # (loss_scale_factor over the mini-batch's tokens) do, so that a step's size does not
                # depend on how the batch's tokens fall between mini-batches. DeepSpeed divides each
                # backward by the accumulation count and averages the gradient over the ranks: undone.
                scale = self.world * len(mini) / denom
                for pos, k in enumerate(mini):
                    self._mark_boundary(pos == len(mini) - 1)
                    loss_sum = self._pass(inputs, k, totals)
                    self.engine.backward(loss_sum * scale)
                    micro_loss = float(loss_sum.detach())
                    totals.loss += micro_loss / denom
                    guard.loss(micro_loss)
                    # At the boundary: skipped by every rank when any saw a non-finite value, and not
                    # taken when no rank had a row of the mini-batch.
                    guard.step(trains=trains)
        guard.log_skips(policy=self.spec.name, step=step, rank=self.rank)
        value = self.critic.train(inputs, self.epochs, self._allreduce) if self.critic is not None else None
        # The version advances even when every optimizer step was skipped: the step happened and
        # published the weights it left (unchanged), as a step of no samples does.
        self.version = version
        assert self._guard is not None
        return step_result(
            inputs,
            lease,
            batch,
            totals,
            version,
            rank=self.rank,
            guard=self._guard,
            updates=self.epochs * inputs.layout.minis,
            lr=lr,
            wall_s=time.perf_counter() - start,
            value=value,
        )

    def ping(self) -> str:
        return self.name
