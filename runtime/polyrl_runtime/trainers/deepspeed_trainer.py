"""DeepSpeed trainer rank: ZeRO stage from `trainer.zeroStage`, gloo on CPU, NCCL on GPU.

Each rank is a Ray actor placed on a `polyrl/<policy>/trainer` resource. Ranks of one policy form
their own process group (rendezvous at rank 0's address). A step: every rank pulls its share of the
step's samples from the experience buffer under a lease, the ranks all-reduce the advantage
statistics and token count, run the same number of micro-batches (padding with empty ones), and
DeepSpeed does one optimizer step (GRPO) or one per micro-batch (PPO, with the proximal logprobs
taken before the first update). The driver acks the leases after the step, so a rank that dies
mid-step has its samples redelivered. The client optimizer is torch's AdamW: DeepSpeed's CPU Adam
would compile C++ ops on first use.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import ray
import structlog
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.algorithms.advantages import AdvantageStats, advantages
from polyrl_runtime.algorithms.losses import (
    LossConfig,
    TokenBatch,
    policy_loss,
    sequence_logprobs,
    sequence_logprobs_and_entropy,
)
from polyrl_runtime.cpusets import pin_from_env
from polyrl_runtime.experience.types import Sample, SampleBatch
from polyrl_runtime.models import load_model
from polyrl_runtime.netmap import free_port
from polyrl_runtime.trainers.api import StepResult
from polyrl_runtime.trainers.ops import prepare_ops
from polyrl_runtime.weights.endpoints import TrainerWeights

log = structlog.get_logger(__name__)


def policy_seed(job_seed: int, policy: str) -> int:
    return (job_seed * 1_000_003 + zlib.crc32(policy.encode())) % (2**31)


def micro_batches(batch: SampleBatch | None, micro: int, n_micro: int) -> list[list[int]]:
    """Row indices of each of `n_micro` micro-batches of at most `micro` rows (empty ones pad the
    list, so every rank runs the same number), rows sorted by sequence length first: a micro-batch
    is padded to its longest row, so mixing short turns with long ones (a long-tail reply beside
    one-token answers) would pay for the long one in every row. GRPO sums the micro losses into one
    optimizer step, so grouping does not change its gradient; PPO's per-micro-batch updates see rows
    grouped by length instead of by arrival, an order as arbitrary as before."""
    n = 0 if batch is None else len(batch)
    order: list[int] = []
    if batch is not None:
        lengths = np.diff(batch.prompt_offsets) + np.diff(batch.response_offsets)
        order = [int(i) for i in np.argsort(lengths, kind="stable")]
    rows = [order[i : i + micro] for i in range(0, n, micro)]
    return rows + [[] for _ in range(n_micro - len(rows))]


class DeepSpeedTrainer(TrainerWeights):
    def __init__(
        self,
        name: str,
        policy_json: str,
        job_seed: int,
        *,
        rank: int,
        world: int,
        buffer: Any,
        temperature: float = 1.0,
    ) -> None:
        pin_from_env()
        torch.set_num_threads(1)
        self.name = name
        self.spec = Policy.model_validate_json(policy_json)
        self.rank = rank
        self.world = world
        self.buffer = buffer
        self.temperature = temperature
        self.algo = self.spec.algorithm
        self.loss_cfg = LossConfig(
            self.algo.clip_eps, self.algo.is_cap, self.algo.kl_coef, self.algo.entropy_coef
        )
        self.version = 0
        self.cuda = self.spec.trainer.gpus > 0 and torch.cuda.is_available()
        seed = policy_seed(job_seed, self.spec.name)
        self.model = load_model(self.spec.model.uri, seed=seed, dtype=self.spec.model.dtype)
        self.ref = None
        if self.algo.kl_coef > 0:
            self.ref = copy.deepcopy(self.model).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        self.engine: Any = None
        self._gas = 0

    def address(self) -> tuple[str, int]:
        util: Any = ray.util
        return str(util.get_node_ip_address()), free_port()

    def setup(self, master_addr: str, master_port: int) -> None:
        """Join the policy's process group and build the DeepSpeed engine (all ranks at once)."""
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world),
            LOCAL_RANK="0",
        )
        if not self.cuda:
            prepare_ops()  # never wait on a torch build lock a killed build left behind
        deepspeed.init_distributed(dist_backend="nccl" if self.cuda else "gloo")
        if self.cuda:
            self.model.cuda()
            if self.ref is not None:
                self.ref.cuda()
        micro = self.spec.trainer.micro_batch_size
        config = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": self.spec.trainer.zero_stage},
            "bf16": {"enabled": self.cuda and self.spec.model.dtype in ("auto", "bfloat16")},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.algo.lr, weight_decay=0.0)
        self.engine, *_ = deepspeed.initialize(model=self.model, optimizer=optimizer, config=config)
        self._gas = 1
        log.info(
            "trainer.ready",
            policy=self.spec.name,
            rank=self.rank,
            world=self.world,
            zero=self.spec.trainer.zero_stage,
        )

    # -- one step ------------------------------------------------------------------------------

    def _allreduce(self, values: list[float], op: str = "sum") -> list[float]:
        if self.world == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        if self.cuda:
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return [float(x) for x in t.cpu()]

    def _set_gas(self, gas: int) -> None:
        if gas != self._gas:
            self.engine.set_train_batch_size(self.spec.trainer.micro_batch_size * gas * self.world)
            self._gas = gas

    def _token_batch(self, samples: list[Sample], rows: list[int]) -> tuple[TokenBatch, torch.Tensor]:
        tb = TokenBatch.build(
            [samples[i].prompt_ids for i in rows],
            [samples[i].response_ids for i in rows],
            [samples[i].allowed_ids for i in rows],
        )
        width = tb.targets.shape[1]
        behav = torch.zeros(len(rows), width)
        for j, i in enumerate(rows):
            lp = samples[i].logprobs
            behav[j, : len(lp)] = torch.from_numpy(lp.astype(np.float32))
        return tb, behav

    def _forward_loss(
        self, tb: TokenBatch, behav: torch.Tensor, adv: torch.Tensor, prox: torch.Tensor | None
    ) -> tuple[torch.Tensor, Any]:
        entropy = None
        if self.loss_cfg.entropy_coef > 0:
            logp, entropy = sequence_logprobs_and_entropy(self.engine, tb, self.temperature)
        else:
            logp = sequence_logprobs(self.engine, tb, self.temperature)
        device = logp.device
        mask = tb.response_mask.to(device)
        ref = None
        if self.ref is not None:
            with torch.no_grad():
                ref = sequence_logprobs(self.ref, tb, self.temperature)
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

    def train_step(self, step: int, share: int, n_micro: int, global_std: float | None = None) -> StepResult:
        start = time.perf_counter()
        lease = ray.get(self.buffer.pull.remote(self.spec.name, self.name, share, 60.0)) if share else None
        batch: SampleBatch | None = lease.batch if lease is not None else None
        n = 0 if batch is None else len(batch)
        signals = torch.from_numpy(batch.rewards.astype(np.float32)) if batch is not None else torch.zeros(0)
        local = AdvantageStats.of(signals)
        tokens_local = 0 if batch is None else int(batch.response_offsets[-1])
        count, total, total_sq, tokens = self._allreduce(
            [local.count, local.total, local.total_sq, tokens_local]
        )
        stats = AdvantageStats(count, total, total_sq)
        adv = advantages(
            signals, self.algo.advantage_norm, stats, algorithm=self.algo.name, global_std=global_std
        )
        micro_rows = micro_batches(batch, self.spec.trainer.micro_batch_size, n_micro)
        samples = batch.samples() if batch is not None else []
        ppo = self.algo.name == "ppo"
        self._set_gas(1 if ppo else n_micro)
        prox: list[torch.Tensor | None] = [None] * n_micro
        if ppo and batch is not None:
            with torch.no_grad():
                for k, rows in enumerate(micro_rows):
                    if rows:
                        prox[k] = sequence_logprobs(
                            self.engine, self._token_batch(samples, rows)[0], self.temperature
                        )
        # Each rank's micro loss is scaled so the optimizer sees the mean over all tokens of the step.
        scale = self.world * n_micro / max(tokens, 1.0)
        loss_total, acc = 0.0, {"clip": 0.0, "isw": 0.0, "trunc": 0.0, "kl": 0.0, "ent": 0.0, "tok": 0}
        self.begin_weight_update()
        for k, rows in enumerate(micro_rows):
            if rows:
                assert batch is not None
                tb, behav = self._token_batch(samples, rows)
                loss_sum, ls = self._forward_loss(tb, behav, adv[rows], prox[k])
                for key, v in (
                    ("clip", ls.clip_frac),
                    ("isw", ls.is_weight_mean),
                    ("trunc", ls.is_truncated_frac),
                    ("kl", ls.kl),
                    ("ent", ls.entropy),
                ):
                    acc[key] += v * ls.tokens
                acc["tok"] += ls.tokens
            else:  # keep collectives aligned across ranks: a zero loss still runs backward
                loss_sum = sum(p.sum() for p in self.engine.module.parameters()) * 0.0
            loss = loss_sum * scale
            self.engine.backward(loss)
            self.engine.step()
            loss_total += float(loss_sum.detach())
        grad_norm = self.engine.get_global_grad_norm()
        self.version = step
        lag = (
            np.zeros(0)
            if batch is None
            else np.array([max(0, (step - 1) - s.min_version) for s in samples], dtype=np.float64)
        )
        tok = max(acc["tok"], 1)
        return StepResult(
            rank=self.rank,
            lease_id=lease.lease_id if lease is not None else None,
            samples=n,
            tokens=tokens_local,
            loss=loss_total / max(tokens, 1.0),
            clip_frac=acc["clip"] / tok,
            is_weight_mean=acc["isw"] / tok,
            is_truncated_frac=acc["trunc"] / tok,
            kl=acc["kl"] / tok,
            entropy=acc["ent"] / tok,
            staleness_mean=float(lag.mean()) if len(lag) else 0.0,
            staleness_max=int(lag.max()) if len(lag) else 0,
            signal_mean=float(signals.mean()) if n else 0.0,
            grad_norm=float(grad_norm) if grad_norm is not None and math.isfinite(float(grad_norm)) else 0.0,
            wall_s=time.perf_counter() - start,
        )

    # -- weights and checkpoints ------------------------------------------------------------------

    def init_sender(self, transport: str, bucket_bytes: int, transport_kwargs: dict[str, Any] | None) -> None:
        self.init_weight_sender(transport, self.spec.name, bucket_bytes, **(transport_kwargs or {}))

    def weight_tensors(self) -> Mapping[str, torch.Tensor]:
        module = self.engine.module if self.engine is not None else self.model
        if self.spec.trainer.zero_stage == 3 and self.engine is not None:
            import deepspeed

            params = list(module.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                full = {k: v.detach().clone() for k, v in module.state_dict().items()}
            return full
        named = {k: p.data for k, p in module.named_parameters()}
        named.update(dict(module.named_buffers()))
        return named

    def gather_for_peers(self) -> None:
        """ZeRO-3, ranks > 0: take part in the parameter gather rank 0 does to publish weights."""
        self.weight_tensors()

    def save(self, directory: str, tag: str) -> None:
        self.engine.save_checkpoint(directory, tag=tag, client_state={"version": self.version})

    def load(self, directory: str, tag: str) -> None:
        self.begin_weight_update()
        _, client = self.engine.load_checkpoint(directory, tag=tag)
        self.version = int((client or {}).get("version", self.version))

    def ping(self) -> str:
        return self.name
