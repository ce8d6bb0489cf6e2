"""LoRA through peft: adapters on a Hugging Face model, and the merged weights the engines serve.

`apply_lora` wraps the policy's model with `peft.get_peft_model` when `algorithm.lora` is set: the
base weights are frozen and only the adapters require grad, so an optimizer built from the
parameters that require grad trains (and stores state for) the adapters alone.

The rollout engines serve a plain Hugging Face model, so weight sync and export send merged weights
under the base model's names: `base + (alpha / rank) * B @ A` for every adapted weight (peft's own
`get_delta_weight`), computed into new tensors so the trained adapters and the frozen base are never
modified. Parameters only, each once (tied embeddings appear under their first name), exactly the
names and shapes `AutoModelForCausalLM.from_pretrained(dir).named_parameters()` has.

The KL reference of a LoRA policy is the same module with its adapters disabled (`reference_model`):
no second copy of the base weights.

LoRA needs a Hugging Face model: the plain-torch `builtin://tiny` models are rejected with a clear
error (peft's `all-linear` only knows `PreTrainedModel`s, and these toys exist for speed, not
adapters). Adapting tied embeddings (`lm_head` or `embed_tokens` of a model with
`tie_word_embeddings`) is rejected too: the merged input and output embeddings would differ, which
a tied model cannot hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import structlog
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.models import ModelLoadError

log = structlog.get_logger(__name__)

ALL_LINEAR = "all-linear"
FIELD = "algorithm.lora.targetModules"

# Gathers a group of parameters for reading (ZeRO-3: `deepspeed.zero.GatheredParameters`); every
# rank must enter the same gathers in the same order.
Gather = Callable[[list[torch.nn.Parameter]], AbstractContextManager[Any]]


class LoraError(ModelLoadError):
    """`algorithm.lora` cannot be applied to the policy's model; the message names policy and field.
    A `ModelLoadError`: the same spec fails the same way, so the job fails without retrying."""


def no_gather(params: list[torch.nn.Parameter]) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


def _adaptable(module: torch.nn.Module) -> bool:
    """Module kinds peft's LoRA can wrap (the ones a targetModules hint should list)."""
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, Conv1D)
    return isinstance(module, kinds)


def check_target_modules(model: torch.nn.Module, policy: str, targets: list[str]) -> None:
    """Every `targetModules` entry names at least one module of the model (peft only complains when
    none matches), and `all-linear` stands alone."""
    if ALL_LINEAR in targets:
        if len(targets) > 1:
            raise LoraError(f"policy {policy}: {FIELD}: {ALL_LINEAR} cannot be combined with module names")
        return
    names = [n for n, _ in model.named_modules() if n]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        have = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and _adaptable(m)})
        raise LoraError(
            f"policy {policy}: {FIELD}: the model has no module named {', '.join(missing)}; "
            f"its linear and embedding modules are: {', '.join(have)}"
        )


def lora_config(policy: Policy) -> Any:
    """peft's `LoraConfig` of the policy's `algorithm.lora` (which must be set)."""
    import peft

    lora = policy.algorithm.lora
    if lora is None:
        raise LoraError(f"policy {policy.name}: algorithm.lora is not set")
    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=ALL_LINEAR if lora.target_modules == [ALL_LINEAR] else list(lora.target_modules),
        bias="none",
        task_type=peft.TaskType.CAUSAL_LM,
    )


def apply_lora(model: torch.nn.Module, policy: Policy, *, adapter_name: str = "default") -> torch.nn.Module:
    """The module to train: `model` itself without `algorithm.lora`, else a peft model whose only
    trainable parameters are the adapters (named `adapter_name`)."""
    lora = policy.algorithm.lora
    if lora is None:
        return model
    import peft
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise LoraError(
            f"policy {policy.name}: algorithm.lora needs a Hugging Face model; {policy.model.uri} is a "
            "plain torch model (use a Hugging Face directory, e.g. builtin://tiny-qwen2)"
        )
    check_target_modules(model, policy.name, lora.target_modules)
    try:
        wrapped: torch.nn.Module = peft.get_peft_model(model, lora_config(policy), adapter_name=adapter_name)
    except ValueError as e:  # e.g. a targeted module of a kind LoRA cannot wrap (a norm)
        raise LoraError(f"policy {policy.name}: {FIELD}: {e}") from e
    _check_untied(wrapped, policy.name)
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    log.info("lora.applied", policy=policy.name, rank=lora.rank, trainable=trainable, total=total)
    return wrapped


def add_lora(model: torch.nn.Module, policy: Policy, *, adapter_name: str | None = None) -> None:
    """Add an adapter with the policy's LoRA settings, named `adapter_name` (default: as the
    policy), to a peft model that `apply_lora` made: another policy's adapter on the same base, or
    the policy's value adapter (trainers/value_adapter.py)."""
    lora = policy.algorithm.lora
    if lora is None:
        raise LoraError(f"policy {policy.name}: sharing a base model needs algorithm.lora")
    check_target_modules(base_model(model), policy.name, lora.target_modules)
    name = policy.name if adapter_name is None else adapter_name
    peft_model: Any = model
    try:
        peft_model.add_adapter(name, lora_config(policy))
    except ValueError as e:
        raise LoraError(f"policy {policy.name}: {FIELD}: {e}") from e
    _check_untied(model, policy.name)
    log.info("lora.added", policy=policy.name, adapter=name, rank=lora.rank)


def _check_untied(model: torch.nn.Module, policy: str) -> None:
    from peft.tuners.lora import LoraLayer

    base = base_model(model)
    config = getattr(base, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return
    embeddings = (base.get_input_embeddings(), base.get_output_embeddings())  # type: ignore[operator]
    if any(isinstance(m, LoraLayer) for m in embeddings):
        raise LoraError(
            f"policy {policy}: {FIELD}: the model ties its input and output embeddings "
            "(tie_word_embeddings), so neither lm_head nor embed_tokens can be adapted"
        )


def is_peft(module: torch.nn.Module) -> bool:
    import peft

    return isinstance(module, peft.PeftModel)


def base_model(module: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a peft model (with the adapters in place), else `module`."""
    if is_peft(module):
        base: torch.nn.Module = module.get_base_model()  # type: ignore[operator]
        return base
    return module


def reference_model(module: torch.nn.Module) -> AbstractContextManager[Any]:
    """Within this context `module` computes the KL reference policy: a peft model with its adapters
    disabled is exactly the initial model (the base is frozen)."""
    if not is_peft(module):
        raise TypeError("reference_model needs a peft model (algorithm.lora set)")
    ctx: AbstractContextManager[Any] = module.disable_adapter()  # type: ignore[operator]
    return ctx


def _units(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module, bool]]:
    """(name, module, is_lora_layer) in `named_parameters` order: a LoRA layer as one unit (its base
    weight and its adapters are read together), every other module for its own parameters."""
    from peft.tuners.lora import LoraLayer

    if isinstance(module, LoraLayer):
        yield prefix, module, True
        return
    if any(True for _ in module.parameters(recurse=False)):
        yield prefix, module, False
    for name, child in module.named_children():
        yield from _units(child, f"{prefix}.{name}" if prefix else name)


def _delta(layer: Any) -> torch.Tensor | None:
    deltas = [
        layer.get_delta_weight(a)
        for a in layer.active_adapters
        if a in layer.lora_A or a in getattr(layer, "lora_embedding_A", {})
    ]
    if not deltas:
        return None
    total: torch.Tensor = deltas[0]
    for d in deltas[1:]:
        total = total + d
    return total


@torch.no_grad()
def serving_tensors(
    module: torch.nn.Module, gather: Gather | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every parameter the served model has, adapters merged in.

    Without `gather` the tensors of unadapted parameters are the live ones (read them before the
    next optimizer step); with it every tensor is a copy taken under the gather, one unit at a time,
    so at most one layer is gathered at once."""
    base = base_model(module)
    seen: set[int] = set()
    for name, unit, lora in _units(base):
        params = list(unit.parameters())
        out: list[tuple[str, torch.Tensor]] = []
        with (gather or no_gather)(params):
            if lora:
                target = unit.get_base_layer()  # type: ignore[operator]
                delta = _delta(unit)
                own = list(target.named_parameters(recurse=False))
            else:
                delta = None
                own = list(unit.named_parameters(recurse=False))
            for pname, p in own:
                if id(p) in seen:  # a tied weight is served once, under its first name
                    continue
                seen.add(id(p))
                value = p.detach()
                if delta is not None and pname == "weight":
                    value = value + delta.to(value.dtype)
                elif gather is not None:
                    value = value.clone()
                out.append((f"{name}.{pname}" if name else pname, value))
        yield from out


@torch.no_grad()
def adapter_tensors(module: torch.nn.Module, gather: Gather | None = None) -> dict[str, torch.Tensor]:
    """The adapters' parameters under the peft model's own state-dict names (copies), gathered in
    one collective: adapters are a small fraction of the model."""
    adapters = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    with (gather or no_gather)([p for _, p in adapters]):
        return {name: p.detach().clone() for name, p in adapters}
