"""The tensors of one policy's LoRA adapter on a model: which linear layers it adapts, A's and B's shapes.

A trainer and an engine that share a base model must agree on an adapter's tensors before the first
weight update: the trainer publishes them under these names and the engine receives into tensors of
these shapes. Both derive them here, from the model and the policy's `algorithm.lora`, resolving
`targetModules` as peft does for a list of names or `all-linear` (`peft.LoraConfig.target_modules`):

- a name matches a module whose path is that name or ends with `.` + that name;
- `all-linear` is every linear layer except the model's output head.

Names are peft's (`get_peft_model_state_dict`) without its `base_model.model.` wrapper:
`model.layers.0.self_attn.q_proj.lora_A.weight` is A (rank x in_features), `...lora_B.weight` is B
(out_features x rank). An adapter on one shared base may adapt linear layers only: embeddings and the
other module kinds peft also wraps have no place in a bank of stacked linear adapters
(`engines/lora_bank.py`), so they are refused with the field named.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from polyrl_operator.api import Lora
from polyrl_runtime.models.hf import ModelLoadError

ALL_LINEAR = "all-linear"
FIELD = "algorithm.lora.targetModules"
A_SUFFIX = ".lora_A.weight"
B_SUFFIX = ".lora_B.weight"


class AdapterLayoutError(ModelLoadError):
    """`algorithm.lora` cannot be laid out on the model as a shared-base adapter; names policy and field."""


@dataclass(frozen=True)
class AdaptedLayer:
    in_features: int
    out_features: int


@dataclass(frozen=True)
class AdapterLayout:
    """One policy's adapter on a model: the adapted linear layers by module path, its rank and scaling."""

    policy: str
    rank: int
    scaling: float  # alpha / rank: an adapter adds scaling * B @ A to each adapted weight
    layers: Mapping[str, AdaptedLayer]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape of every tensor one version of the adapter has, in module order."""
        out: dict[str, tuple[int, ...]] = {}
        for module, layer in self.layers.items():
            out[module + A_SUFFIX] = (self.rank, layer.in_features)
            out[module + B_SUFFIX] = (layer.out_features, self.rank)
        return out

    def nbytes(self, element_size: int) -> int:
        """The bytes of one version of the adapter at `element_size` bytes per element."""
        return sum(a * b for a, b in self.shapes().values()) * element_size


def _output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None


def adapter_layout(model: torch.nn.Module, policy: str, lora: Lora) -> AdapterLayout:
    """The layout of `policy`'s adapter on `model` (see the module docstring); raises
    `AdapterLayoutError` naming the policy and the field when a target matches nothing, matches a
    module that is not a linear layer, or `all-linear` is combined with names."""
    targets = list(lora.target_modules)
    modules = [(n, m) for n, m in model.named_modules() if n]
    if ALL_LINEAR in targets:
        if len(targets) > 1:
            raise AdapterLayoutError(
                f"policy {policy}: {FIELD}: {ALL_LINEAR} cannot be combined with module names"
            )
        head = _output_head(model)
        chosen = [(n, m) for n, m in modules if isinstance(m, torch.nn.Linear) and m is not head]
    else:
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n, _ in modules)]
        if missing:
            have = sorted({n.rsplit(".", 1)[-1] for n, m in modules if isinstance(m, torch.nn.Linear)})
            raise AdapterLayoutError(
                f"policy {policy}: {FIELD}: the model has no module named {', '.join(missing)}; "
                f"its linear layers are: {', '.join(have)}"
            )
        chosen = [(n, m) for n, m in modules if any(n == t or n.endswith("." + t) for t in targets)]
        other = [n for n, m in chosen if not isinstance(m, torch.nn.Linear)]
        if other:
            raise AdapterLayoutError(
                f"policy {policy}: {FIELD}: {other[0]} ({type(dict(chosen)[other[0]]).__name__}) is not a "
                "linear layer; adapters on a shared base adapt linear layers only"
            )
    if not chosen:
        raise AdapterLayoutError(f"policy {policy}: {FIELD}: the model has no linear layer to adapt")
    layers = {
        n: AdaptedLayer(int(m.in_features), int(m.out_features))
        for n, m in chosen
        if isinstance(m, torch.nn.Linear)
    }
    return AdapterLayout(policy, lora.rank, lora.alpha / lora.rank, layers)
