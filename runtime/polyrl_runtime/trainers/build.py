"""What a trainer rank is made of, built once its process group exists.

Pure parts first: where each rank of a policy sits (`rank_layout`), the learning rate per training
step (`lr_factor`, `learning_rate`), the DeepSpeed config (`deepspeed_config`). Then construction (`build_trainer`):

- the model in `model.dtype`, on this rank's device. Under ZeRO-3 it is partitioned as it is built:
  a Hugging Face model loads with `HfDeepSpeedConfig` alive, so `from_pretrained` constructs it
  inside `deepspeed.zero.Init` and each rank keeps only its shard; a plain-torch built-in model is
  small and seeded, so it is built whole and converted by `zero.Init(module=...)` (its constructor
  re-initialises child modules, which `zero.Init` as a context would have partitioned already).
- gradient checkpointing (Hugging Face models; non-reentrant, so ZeRO-3's hooks see each recompute);
- the optimizer (torch AdamW: DeepSpeed's CPU Adam would compile C++ ops on first use) with no
  scheduler: the learning rate is a function of the *training* step, which the trainer sets before
  each step (`set_learning_rate`). A scheduler stepped by DeepSpeed would count optimizer steps,
  epochs x miniBatches per training step (ppo's default: one per micro-batch), so warmupSteps and
  the cosine horizon would mean different things for different settings. The training step is the policy's version, which a
  checkpoint restores, so a resumed job continues the schedule with no scheduler state;
- the KL reference model, only when `klCoef > 0`: loaded again from the URI (never a copy of the
  trained one), frozen, and under ZeRO-3 wrapped in its own optimizer-less DeepSpeed engine so it is
  partitioned exactly like the trained model.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from polyrl_operator.api import Algorithm, Policy
from polyrl_runtime.models import is_hf, load_model, resolve_dtype
from polyrl_runtime.trainers.deepspeed_import import import_deepspeed
from polyrl_runtime.trainers.lora import apply_lora

log = structlog.get_logger(__name__)


# -- ranks -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankSlot:
    """One trainer rank: its global rank, its pod and its index within the pod."""

    rank: int
    pod: int
    local_rank: int
    world: int


def rank_layout(replicas: int, ranks_per_pod: int) -> list[RankSlot]:
    """Every rank of a policy: pod p holds global ranks p*N .. p*N+N-1 (N = ranks per pod). This is
    the plan (ranks and world); Ray places each rank on any pod with a free trainer unit, so a rank's
    device comes from where it landed (`trainers.api.node_local_ranks`)."""
    if replicas < 1 or ranks_per_pod < 1:
        raise ValueError(f"need at least one pod and one rank per pod, got {replicas} x {ranks_per_pod}")
    world = replicas * ranks_per_pod
    return [
        RankSlot(rank=p * ranks_per_pod + r, pod=p, local_rank=r, world=world)
        for p in range(replicas)
        for r in range(ranks_per_pod)
    ]


def cuda_device_index(local_rank: int, visible: int) -> int:
    """The CUDA device of a rank. Ray gives an actor that asks for one GPU exactly that GPU as its
    only visible device (index 0); where every GPU of the pod is visible, the rank's own is its
    local rank."""
    if visible < 1:
        raise ValueError("no CUDA device is visible to this trainer rank")
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise ValueError(f"local rank {local_rank} has no device: only {visible} are visible")
    return local_rank


# -- optimiser schedule ------------------------------------------------------------------------------


def lr_factor(step: int, algo: Algorithm, total_steps: int) -> float:
    """Multiplier of `lr` at training step `step` (from 0): during warmup step k uses
    (k+1)/(warmupSteps+1); then 1 (constant) or a cosine from 1 down to minLrRatio, reached at
    `total_steps` and held after it."""
    warmup = algo.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if algo.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return algo.min_lr_ratio + (1.0 - algo.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def learning_rate(step: int, algo: Algorithm, total_steps: int) -> float:
    """The learning rate of every optimizer step within training step `step` (from 0)."""
    return algo.lr * lr_factor(step, algo, total_steps)


def set_learning_rate(optimizer: Any, lr: float) -> None:
    """Set `lr` on every parameter group. DeepSpeed's optimizer wrappers (ZeRO, bf16) expose the
    wrapped optimizer's own groups as `param_groups`, so this reaches the optimizer that steps."""
    for group in optimizer.param_groups:
        group["lr"] = lr


# -- DeepSpeed ---------------------------------------------------------------------------------------


def deepspeed_config(policy: Policy, dtype: torch.dtype) -> dict[str, Any]:
    """The DeepSpeed config of a policy's trainer: ZeRO stage, clipping, and a mixed-precision
    section matching the dtype the model is built in."""
    return {
        "train_micro_batch_size_per_gpu": policy.trainer.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": policy.algorithm.max_grad_norm,
        "zero_optimization": {"stage": policy.trainer.zero_stage},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _zero3(config: dict[str, Any]) -> bool:
    return int(config["zero_optimization"]["stage"]) == 3


# -- construction ------------------------------------------------------------------------------------


@dataclass
class Built:
    """What `build_trainer` returns: the DeepSpeed engine of the trained model, the reference
    (a frozen module, an inference engine under ZeRO-3, or None) and the config both use."""

    engine: Any
    ref: Any
    config: dict[str, Any]
    hf_config: Any  # transformers' HfDeepSpeedConfig under ZeRO-3: it must outlive the models
    # The client optimizer, the one whose step writes the weights (DeepSpeed's ZeRO and
    # mixed-precision wrappers call it): a step is skipped by making its step a no-op
    # (trainers/nonfinite.py).
    optimizer: Any = None


def load_policy_model(policy: Policy, seed: int, cuda: bool) -> torch.nn.Module:
    """The policy's initial model: `model.uri` in `model.dtype` (`cuda` decides what `auto` is)."""
    return load_model(
        policy.model.uri,
        seed=seed,
        dtype=policy.model.dtype,
        cuda=cuda,
        trust_remote_code=policy.model.trust_remote_code,
    )


def build_model(
    policy: Policy, seed: int, cuda: bool, device: torch.device, config: dict[str, Any]
) -> torch.nn.Module:
    """The policy's model in its dtype: on `device`, or under ZeRO-3 partitioned over the ranks
    (a Hugging Face model only if `hf_zero3_config` is alive)."""
    deepspeed = import_deepspeed()

    model = load_policy_model(policy, seed, cuda)
    if _zero3(config) and not is_hf(policy.model.uri):
        deepspeed.zero.Init(
            module=model, config_dict_or_path=config, dtype=resolve_dtype(policy.model.dtype, cuda=cuda)
        )
        return model
    if not _zero3(config):
        model.to(device)
    return model


def hf_zero3_config(policy: Policy, config: dict[str, Any]) -> Any:
    """Under ZeRO-3, transformers builds a model partitioned while this object lives."""
    if not (_zero3(config) and is_hf(policy.model.uri)):
        return None
    integration: Any = importlib.import_module("transformers.integrations.deepspeed")
    return integration.HfDeepSpeedConfig(config)


def enable_gradient_checkpointing(model: torch.nn.Module, policy: Policy) -> bool:
    """Turn on activation recomputation where the model supports it; False for a model without it
    (the plain-torch built-in models, whose activations are small)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        log.warning("trainer.gradient_checkpointing_unsupported", policy=policy.name, uri=policy.model.uri)
        return False
    # Non-reentrant: the recompute runs under autograd, so ZeRO-3's gather hooks fire in it too.
    kwargs = {"use_reentrant": False}
    hf: Any = model
    if hasattr(hf, "activation_checkpointing_enable"):  # the name since transformers 5
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return True


def build_reference(
    policy: Policy, seed: int, cuda: bool, device: torch.device, config: dict[str, Any]
) -> Any:
    """The frozen KL reference (the initial policy), or None when `klCoef` is 0."""
    if policy.algorithm.kl_coef <= 0:
        return None
    if policy.algorithm.lora is not None:
        # The reference is the trained model with its adapters disabled (`lora.reference_model`),
        # not a second model: the trainer scores it through its own engine.
        return None
    ref = build_model(policy, seed, cuda, device, config)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    if not _zero3(config):
        return ref
    engine, *_ = import_deepspeed().initialize(model=ref, config=config)
    engine.eval()
    return engine


def build_trainer(policy: Policy, *, seed: int, cuda: bool, device: torch.device, total_steps: int) -> Built:
    """Model, reference, optimizer, schedule and DeepSpeed engine of one rank. Call on every rank
    of the policy at once, after `deepspeed.init_distributed` (ZeRO-3 partitions collectively)."""
    dtype = resolve_dtype(policy.model.dtype, cuda=cuda)
    config = deepspeed_config(policy, dtype)
    hf_config = hf_zero3_config(policy, config)
    model = build_model(policy, seed, cuda, device, config)
    if policy.trainer.gradient_checkpointing:
        enable_gradient_checkpointing(model, policy)
    model = apply_lora(model, policy)  # unchanged without algorithm.lora; else only adapters train
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=policy.algorithm.lr, weight_decay=0.0)
    engine, *_ = import_deepspeed().initialize(model=model, optimizer=optimizer, config=config)
    set_learning_rate(engine.optimizer, learning_rate(0, policy.algorithm, total_steps))
    ref = build_reference(policy, seed, cuda, device, config)
    return Built(engine=engine, ref=ref, config=config, hf_config=hf_config, optimizer=optimizer)
