"""DeepSpeed trainer rank: ZeRO stage from `trainer.zeroStage`, gloo on CPU, NCCL on GPU.

Each rank is a Ray actor placed on one unit of a `polyrl/<policy>/trainer` resource (a trainer pod
offers one per rank: one per GPU, or `trainer.ranksPerPod` on CPU) and, on GPU, one GPU of its own.
Ranks of one policy form their own process group (rendezvous at rank 0's address); what a rank is
built of (model, reference, optimizer, schedule, DeepSpeed config) is in `trainers/build.py`. A step: every rank pulls its share of the
step's samples from the experience buffer under a lease, the ranks all-reduce the advantage
statistics and token count, run the same number of micro-batches (padding with empty ones), and
DeepSpeed does one optimizer step (GRPO) or one per micro-batch (PPO, with the proximal logprobs
taken before the first update), which every rank skips when any saw a non-finite loss or gradient
(trainers/nonfinite.py). The driver acks the leases after the step, so a rank that dies
mid-step has its samples redelivered.

On a device pool a rank moves its state to host memory between its phases (`offload`, `restore`:
trainers/offload.py); while it is offloaded every call that needs its tensors fails with
`TrainerOffloadedError`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import ray
import structlog
import torch

from polyrl_operator.api import Policy
from polyrl_runtime import storage
from polyrl_runtime.algorithms.advantages import (
    AdvantageStats,
    advantages,
    agent_stats,
    scale_stats,
)
from polyrl_runtime.algorithms.estimators import estimator, normalisation
from polyrl_runtime.algorithms.kl_reward import shaped_returns, token_advantages, token_kl
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
from polyrl_runtime.experience.types import Sample
from polyrl_runtime.models import is_hf, model_dir
from polyrl_runtime.netmap import free_port
from polyrl_runtime.trainers.api import OffloadReport, StepResult
from polyrl_runtime.trainers.batching import micro_batches, pack_rows, row_lengths
from polyrl_runtime.trainers.build import (
    Built,
    build_trainer,
    learning_rate,
    set_learning_rate,
)
from polyrl_runtime.trainers.export import export_policy, zero_gather
from polyrl_runtime.trainers.lora import reference_model
from polyrl_runtime.trainers.nonfinite import StepGuard
from polyrl_runtime.trainers.offload import TrainerOffloadedError, offload_rank, restore_rank
from polyrl_runtime.trainers.process_group import (
    allreduce,
    gather_agent_stats,
    join_process_group,
    policy_seed,
)
from polyrl_runtime.trainers.publish import published_tensors
from polyrl_runtime.weights.endpoints import TrainerWeights

log = structlog.get_logger(__name__)


# One token of prompt and one of response: the input of an empty micro-batch's zero-weighted step.
_PAD_ROW = TokenBatch.build([np.zeros(1, np.int32)], [np.zeros(1, np.int32)], [np.zeros(0, np.int32)])


# The loss statistics a step reports as means over its scored tokens (`LossStats` fields, which are
# also `StepResult` fields of the same name).
TOKEN_WEIGHTED = ("clip_frac", "is_weight_mean", "is_truncated_frac", "is_masked_frac", "kl", "entropy")


class DeepSpeedTrainer(TrainerWeights):
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
        self.version = 0
        self.cuda = gpus > 0 and torch.cuda.is_available()  # gpus: its pod's (or pool's)
        self.seed = policy_seed(job_seed, self.spec.name)
        self.model: Any = None  # the engine's module, once `setup` built it
        self.ref: Any = None
        self.engine: Any = None
        self._built: Built | None = None
        self._gas = 0
        self._guard: StepGuard | None = None  # its optimizer steps, once `setup` built the engine
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

    def _token_batch(self, samples: list[Sample], rows: list[int]) -> tuple[TokenBatch, torch.Tensor]:
        """The rows' model inputs and [rows, R] behaviour logprobs. Each row carries the temperature
        its tokens were sampled at: the policy's, or the call's own (`Turn.temperature`). The
        trainer's, proximal and reference logprobs of the row are all taken at it, so that they and
        the behaviour logprobs are of one distribution (`self.temperature` only scores `_PAD_ROW`)."""
        tb = TokenBatch.build(
            [samples[i].prompt_ids for i in rows],
            [samples[i].response_ids for i in rows],
            [samples[i].allowed_ids for i in rows],
            [samples[i].loss_mask for i in rows],
            [samples[i].temperature for i in rows],
        )
        width = tb.targets.shape[1]
        behav = torch.zeros(len(rows), width)
        for j, i in enumerate(rows):
            lp = samples[i].logprobs
            behav[j, : len(lp)] = torch.from_numpy(lp.astype(np.float32))
        return tb, behav

    def _reference_logprobs(self, tb: TokenBatch) -> torch.Tensor | None:
        """[B, R] the reference policy's logprobs of the rows (no gradient); None without klCoef."""
        with torch.no_grad():
            if self.ref is not None:
                return sequence_logprobs(self.ref, tb, self.temperature)
            if self.loss_cfg.kl_coef > 0 and self.algo.lora is not None:
                # LoRA: the initial policy is the trained model with its adapters switched off.
                with reference_model(self.engine.module):
                    return sequence_logprobs(self.engine, tb, self.temperature)
        return None

    def _kl_in_reward(
        self,
        samples: list[Sample],
        micro_rows: list[list[int]],
        prox: list[torch.Tensor | None],
        rewards: torch.Tensor,
        global_std: float | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """klIn reward (algorithms/kl_reward.py): each micro-batch's [rows, R] advantages and its
        reference logprobs. The KL is taken against the proximal logprobs: PPO's, else the weights
        now, which (one optimizer step per batch) every micro-batch of the step is scored at."""
        refs: list[torch.Tensor | None] = []
        returns: list[torch.Tensor] = []  # an empty micro-batch's: [0, 0], as its mask; no agents
        masks: list[torch.Tensor] = []
        agents: list[list[str]] = []
        with torch.no_grad():
            for k, rows in enumerate(micro_rows):
                if not rows:
                    refs.append(None)
                    returns.append(torch.zeros(0, 0))
                    masks.append(torch.zeros(0, 0))
                    agents.append([])
                    continue
                tb = self._token_batch(samples, rows)[0]
                ref = self._reference_logprobs(tb)
                if ref is None:  # the API refuses klIn reward without klCoef > 0, which builds one
                    raise ValueError(f"policy {self.spec.name}: algorithm.klIn reward needs klCoef > 0")
                refs.append(ref)
                old = prox[k]
                old = sequence_logprobs(self.engine, tb, self.temperature) if old is None else old
                mask = tb.response_mask.to(old.device)
                kl = token_kl(ref, old, self.loss_cfg.kl_estimator)
                returns.append(shaped_returns(rewards[rows].to(old.device), kl, mask, self.loss_cfg.kl_coef))
                masks.append(mask)
                agents.append([samples[i].agent for i in rows])
        shaped = token_advantages(
            returns,
            masks,
            agents,
            self.norm,
            algorithm=self.algo.name,
            allreduce=self._allreduce,
            agent_stats=self._agent_stats,
            global_std=global_std,
        )
        return shaped, refs

    def _forward_loss(
        self,
        tb: TokenBatch,
        behav: torch.Tensor,
        adv: torch.Tensor,
        prox: torch.Tensor | None,
        ref: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """`adv` per row or per token; `ref`: the rows' reference logprobs when scored already."""
        # The entropy is always computed (a metric); it enters the loss only with entropyCoef > 0.
        logp, entropy = sequence_logprobs_and_entropy(self.engine, tb, self.temperature)
        device = logp.device
        mask = tb.response_mask.to(device)
        ref = self._reference_logprobs(tb) if ref is None else ref.to(device)
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
        n = 0 if batch is None else len(batch)
        signals = torch.from_numpy(batch.rewards.astype(np.float32)) if batch is not None else torch.zeros(0)
        local = scale_stats(signals, self.algo.name)
        tokens_local = 0 if batch is None else batch.trained_tokens  # context tokens are not trained
        count, total, total_sq, tokens, sequences = self._allreduce(
            [local.count, local.total, local.total_sq, tokens_local, float(n)]
        )
        stats = AdvantageStats(count, total, total_sq)
        agents = batch.agents if batch is not None else ()
        adv = advantages(
            signals,
            self.norm,
            stats,
            algorithm=self.algo.name,
            global_std=global_std,
            agents=agents,
            by_agent=self._agent_stats(signals, agents) if self.norm == "per-agent" else None,
        )
        budget = self.spec.trainer.max_tokens_per_micro_batch
        if budget is not None:  # the count depends on the lengths: every rank runs the largest
            local_n = len(pack_rows(row_lengths(batch), self.spec.trainer.micro_batch_size, budget))
            n_micro = int(self._allreduce([float(max(n_micro, local_n))], op="max")[0])
        micro_rows = micro_batches(batch, self.spec.trainer.micro_batch_size, n_micro, budget)
        samples = batch.samples() if batch is not None else []
        ppo = estimator(self.algo.name).proximal_steps
        self._set_gas(1 if ppo else n_micro)
        prox: list[torch.Tensor | None] = [None] * n_micro
        if ppo and batch is not None:
            with torch.no_grad():
                for k, rows in enumerate(micro_rows):
                    if rows:
                        prox[k] = sequence_logprobs(
                            self.engine, self._token_batch(samples, rows)[0], self.temperature
                        )
        micro_adv = [adv[rows] for rows in micro_rows]
        refs: list[torch.Tensor | None] = [None] * n_micro
        if self.loss_cfg.kl_in == "reward":  # on every rank: the normalisation all-reduces
            micro_adv, refs = self._kl_in_reward(samples, micro_rows, prox, signals, global_std)
        # Each rank's micro loss is scaled so the optimizer sees the step's loss: its micro-batches'
        # numerators over the all-reduced token or sequence count (algorithm.lossAggregation).
        denom = aggregation_denominator(self.loss_cfg.loss_aggregation, tokens, sequences)
        scale = self.world * n_micro / denom
        # Training step `step` produces version `step`: the schedule's step index is step - 1, the same
        # for every optimizer step of it (ppo takes one per micro-batch) and after a resume.
        lr = learning_rate(step - 1, self.algo, self.total_steps)
        set_learning_rate(self.engine.optimizer, lr)
        loss_total, acc = 0.0, dict.fromkeys(TOKEN_WEIGHTED, 0.0)
        tokens_scored = 0
        guard = self._guard
        assert guard is not None
        guard.begin()
        self.begin_weight_update()
        for k, rows in enumerate(micro_rows):
            if rows:
                assert batch is not None
                tb, behav = self._token_batch(samples, rows)
                loss_sum, ls = self._forward_loss(tb, behav, micro_adv[k], prox[k], refs[k])
                for key in TOKEN_WEIGHTED:
                    acc[key] += getattr(ls, key) * ls.tokens
                tokens_scored += ls.tokens
            else:
                # Keep collectives aligned across ranks: a zero-weighted forward and backward. A real
                # forward (not a sum of the parameters) because under ZeRO-3 a parameter is an empty
                # shard outside the forward's gather hooks, and its gradient must have the full size.
                logp = sequence_logprobs(self.engine, _PAD_ROW, self.temperature)
                loss_sum = logp.sum() * 0.0
            loss = loss_sum * scale
            self.engine.backward(loss)
            micro_loss = float(loss_sum.detach())
            loss_total += micro_loss
            guard.loss(micro_loss)
            guard.step()  # at a boundary: skipped by every rank when any saw a non-finite value
        grad_norm = guard.grad_norm()
        guard.log_skips(policy=self.spec.name, step=step, rank=self.rank)
        # The version advances even when every optimizer step was skipped: the step happened and
        # published the weights it left (unchanged), as a step of no samples does.
        self.version = version
        lag = (
            np.zeros(0)
            if batch is None
            else np.array([max(0, (version - 1) - s.min_version) for s in samples], dtype=np.float64)
        )
        per_token = {key: total / max(tokens_scored, 1) for key, total in acc.items()}
        return StepResult(
            rank=self.rank,
            lease_id=lease.lease_id if lease is not None else None,
            samples=n,
            tokens=tokens_local,
            loss=loss_total / denom,
            clip_frac=per_token["clip_frac"],
            is_weight_mean=per_token["is_weight_mean"],
            is_truncated_frac=per_token["is_truncated_frac"],
            is_masked_frac=per_token["is_masked_frac"],
            kl=per_token["kl"],
            entropy=per_token["entropy"],
            staleness_mean=float(lag.mean()) if len(lag) else 0.0,
            staleness_max=int(lag.max()) if len(lag) else 0,
            signal_mean=float(signals.mean()) if n else 0.0,
            grad_norm=grad_norm,
            skipped_nonfinite=guard.skipped,
            lr=lr,
            wall_s=time.perf_counter() - start,
        )

    # -- weights and checkpoints ------------------------------------------------------------------

    def init_sender(self, transport: str, bucket_bytes: int, transport_kwargs: Mapping[str, object]) -> None:
        self.init_weight_sender(transport, self.spec.name, bucket_bytes, **transport_kwargs)

    def weight_tensors(self) -> Mapping[str, torch.Tensor]:
        """What the engines load: parameters only, tied once, Hugging Face names (adapters merged under
        LoRA; the adapter alone when the engines share the base), gathered bucket by bucket under
        ZeRO-3 (`publish.published_tensors`)."""
        self._require_resident("publishing weights")
        module = self.engine.module if self.engine is not None else self.model
        return published_tensors(
            module,
            zero_gather(self.spec.trainer.zero_stage),
            adapter_only=self.adapter_only,
            adapter=self.adapter_name,
        )

    def gather_for_peers(self) -> None:
        """ZeRO-3, ranks > 0: take part in the bucket gathers rank 0 does to publish weights."""
        self._require_resident("publishing weights")
        module = self.engine.module if self.engine is not None else self.model
        published_tensors(
            module,
            zero_gather(self.spec.trainer.zero_stage),
            keep=False,
            adapter_only=self.adapter_only,
            adapter=self.adapter_name,
        )

    def save(self, directory: str, tag: str) -> None:
        """`directory`: a local path or an object-store URI (each rank stages and uploads its files)."""
        self._require_resident("saving a checkpoint")
        # LoRA: the frozen base is the model URI's, so only adapters and optimizer state are stored.
        with storage.staged_dir(directory) as local:
            self.engine.save_checkpoint(
                str(local),
                tag=tag,
                client_state={"version": self.version},
                exclude_frozen_parameters=self.algo.lora is not None,
            )

    def load(self, directory: str, tag: str) -> None:
        self._require_resident("loading a checkpoint")
        self.begin_weight_update()
        with storage.fetched_dir(directory) as local:
            _, client = self.engine.load_checkpoint(
                str(local), tag=tag, load_module_strict=self.algo.lora is None
            )
        self.version = int((client or {}).get("version", self.version))

    def export(self, directory: str) -> None:
        """Write the policy as a Hugging Face model directory (trainers/export.py). Every rank calls
        it at once (ZeRO-3 gathers are collective); rank 0 writes."""
        self._require_resident("exporting")
        uri = self.spec.model.uri
        with storage.staged_dir(directory) as local:
            export_policy(
                self.engine.module,
                local,
                source_dir=model_dir(uri) if is_hf(uri) else None,
                source_uri=uri,
                gather=zero_gather(self.spec.trainer.zero_stage),
                writer=self.rank == 0,
            )

    # -- device pools ----------------------------------------------------------------------------

    def offload(self) -> OffloadReport:
        """Move this rank's state to host memory (trainers/offload.py); `restore` brings it back."""
        if self.engine is None:
            raise RuntimeError(f"trainer rank {self.name}: nothing to offload before setup")
        if self._offloaded is not None:
            raise RuntimeError(f"trainer rank {self.name}: offloaded already")
        self.begin_weight_update()  # a sender reading these tensors finishes first
        self._offloaded = parked = offload_rank(self.engine, self.ref, self.device, self._host_buffers)
        log.info("trainer.offloaded", rank=self.name, bytes=parked.nbytes, seconds=parked.seconds)
        return OffloadReport(self.rank, "offload", parked.seconds, parked.host_bytes)

    def restore(self) -> OffloadReport:
        if self._offloaded is None:
            raise RuntimeError(f"trainer rank {self.name}: not offloaded, nothing to restore")
        parked = self._offloaded
        seconds = restore_rank(parked, self.name)  # on failure it stays offloaded: restore may be retried
        self._offloaded = None
        log.info("trainer.restored", rank=self.name, bytes=parked.nbytes, seconds=seconds)
        return OffloadReport(self.rank, "restore", seconds, parked.nbytes)

    def _require_resident(self, what: str) -> None:
        if self._offloaded is not None:
            raise TrainerOffloadedError(self.name, what)

    def ping(self) -> str:
        return self.name
