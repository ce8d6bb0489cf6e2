"""Several LoRA adapters resident on one base model, each row of a batch served by its own adapter.

Every adapted linear layer keeps its base weight once and, stacked, the adapters that target it:
`a` holds each adapter's A (rank x in, already multiplied by the adapter's scaling, alpha / rank)
one under another, `b` each adapter's B (out x rank) side by side. A forward pass computes

    base(x) + ((x @ a.T) * mask) @ b.T

where `mask` keeps, for each row, the columns of that row's adapter only. One pair of dense matmuls
serves every adapter in the batch (vLLM's punica kernels serve several adapters in one kernel too),
where peft's mixed batch (`adapter_names`) runs one sub-batch per adapter in every adapted layer.
Rows of one adapter get what peft computes with that adapter alone, up to rounding (exactly, when
the scaling is a power of two): the other adapters' columns add exact zeros.

Adapters may differ in rank, scaling and target modules: a layer holds columns only for the
adapters that adapt it, and rows of the others get its base output. An adapter's tensors carry
peft's names without its wrapper prefix (`model.layers.0.self_attn.q_proj.lora_A.weight`, what
`get_peft_model_state_dict` gives with `base_model.model.` removed); its first load fixes its layout
(the modules and the rank), and every later version must have exactly that layout. A load checks
every tensor before it writes any: a version is applied whole or not at all.

Not thread-safe: `load`, `route` and the forward passes they affect run on one thread. A load
between two forward passes leaves the other adapters' rows exactly as they were.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from polyrl_runtime.models.lora_layout import A_SUFFIX, B_SUFFIX


class AdapterLoadError(ValueError):
    """A version of an adapter that does not fit the model or the adapter's layout; nothing was
    written. The message names the adapter and the tensor."""


@dataclass(frozen=True)
class _Columns:
    start: int
    rank: int


class _Adapted:
    """One adapted linear layer's adapters (see the module docstring); a forward hook of the layer,
    so the base model's parameters keep their names and the layer's own forward is untouched."""

    def __init__(self, base: torch.nn.Linear) -> None:
        weight = base.weight
        self._shape, self._like = (base.out_features, base.in_features), weight
        self.width = 0  # the columns of every adapter on the layer
        self._a: torch.Tensor | None = None  # allocated at the first write or route, at `width`
        self._b: torch.Tensor | None = None
        self.columns: dict[str, _Columns] = {}
        self.mask: torch.Tensor | None = None  # [rows, columns]; None: the base alone
        base.register_forward_hook(self)

    def add(self, adapter: str, rank: int) -> None:
        """Columns for `adapter`. Adapters added before the first write share one allocation; one added
        later grows the stacked tensors (a copy of the others' columns)."""
        self.columns[adapter] = _Columns(self.width, rank)
        self.width += rank
        if self._a is not None and self._b is not None:
            self._a = torch.cat([self._a, self._a.new_zeros(rank, self._a.shape[1])])
            self._b = torch.cat([self._b, self._b.new_zeros(self._b.shape[0], rank)], dim=1)

    # Allocated as normal tensors even inside inference mode (a first route may come in a forward
    # pass): later versions are written into them outside it.
    @property
    def a(self) -> torch.Tensor:
        if self._a is None:
            with torch.inference_mode(False):
                self._a = self._like.new_zeros(self.width, self._shape[1])
        return self._a

    @property
    def b(self) -> torch.Tensor:
        if self._b is None:
            with torch.inference_mode(False):
                self._b = self._like.new_zeros(self._shape[0], self.width)
        return self._b

    def write(self, adapter: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        cols = self.columns[adapter]
        end = cols.start + cols.rank
        rows = self.a[cols.start : end]
        rows.copy_(a)
        rows.mul_(scaling)  # in place: no second copy of the adapter, even for a moment
        self.b[:, cols.start : end].copy_(b)

    def read(self, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of `adapter`'s A (scaled, as written) and B: `write` of them at scaling 1 restores it."""
        cols = self.columns[adapter]
        end = cols.start + cols.rank
        return self.a[cols.start : end].detach().clone(), self.b[:, cols.start : end].detach().clone()

    def copy(self, source: str, target: str) -> None:
        """`target`'s columns become a copy of `source`'s (same rank: the bank checked)."""
        src, dst = self.columns[source], self.columns[target]
        self.a[dst.start : dst.start + dst.rank].copy_(self.a[src.start : src.start + src.rank])
        self.b[:, dst.start : dst.start + dst.rank].copy_(self.b[:, src.start : src.start + src.rank])

    def route(self, adapters: Sequence[str | None]) -> None:
        mask = torch.zeros(len(adapters), self.a.shape[0], dtype=self.a.dtype, device=self.a.device)
        for row, name in enumerate(adapters):
            cols = self.columns.get(name) if name is not None else None
            if cols is not None:
                mask[row, cols.start : cols.start + cols.rank] = 1
        self.mask = mask

    def __call__(
        self, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> torch.Tensor:
        if self.mask is None:
            return out
        (x,) = inputs
        if self.mask.shape[0] != x.shape[0]:
            raise ValueError(f"{x.shape[0]} rows in the batch, but {self.mask.shape[0]} routed to adapters")
        low = (x @ self.a.T) * self.mask.reshape(self.mask.shape[0], *([1] * (x.dim() - 2)), -1)
        return out + low @ self.b.T


class LoraBank:
    """The adapters resident on `model` (a Hugging Face causal LM or any module of linear layers):
    `load` adds or updates one, `route` names each row's adapter for the next forward passes."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._layers: dict[str, _Adapted] = {}
        self._layouts: dict[str, dict[str, tuple[torch.Size, torch.Size]]] = {}
        self._routed: list[str | None] | None = None

    @property
    def adapters(self) -> list[str]:
        return list(self._layouts)

    def layout(self, adapter: str) -> dict[str, tuple[torch.Size, torch.Size]]:
        """Module name -> (A shape, B shape) of `adapter`: the tensors each version must have."""
        return dict(self._layouts[adapter])

    def nbytes(self, adapter: str) -> int:
        """The bytes one version of `adapter` moves (its A and B tensors)."""
        size = next(iter(self._layers.values())).a.element_size()
        return sum((a.numel() + b.numel()) * size for a, b in self._layouts[adapter].values())

    def declare(self, layouts: Mapping[str, Mapping[str, tuple[torch.Size, torch.Size]]]) -> None:
        """Add adapters by layout (adapter -> module -> (A shape, B shape)) before any version of them,
        so every layer allocates its columns once; their first `load` must match. B is zero until then."""
        for adapter, layout in layouts.items():
            zeros = {}
            for module, (a_shape, b_shape) in layout.items():
                zeros[module + A_SUFFIX] = torch.empty(a_shape, device="meta")
                zeros[module + B_SUFFIX] = torch.empty(b_shape, device="meta")
            shapes = {m: (a.shape, b.shape) for m, (a, b) in self._pairs(adapter, zeros).items()}
            if adapter in self._layouts:
                raise AdapterLoadError(f"adapter {adapter} is already resident")
            for module, (a_shape, _) in shapes.items():
                self._layer(module).add(adapter, int(a_shape[0]))
            self._layouts[adapter] = shapes
        if self._routed is not None:
            self.route(self._routed)

    def load(self, adapter: str, tensors: Mapping[str, torch.Tensor], scaling: float) -> None:
        """Apply one version of `adapter` (its first adds it, unless `declare` did). Checks every tensor
        first; raises `AdapterLoadError` naming the adapter and the tensor, having written nothing."""
        pairs = self._pairs(adapter, tensors)
        known = self._layouts.get(adapter)
        shapes = {m: (a.shape, b.shape) for m, (a, b) in pairs.items()}
        if known is not None and shapes != known:
            changed = sorted(set(shapes) ^ set(known)) or sorted(m for m in shapes if shapes[m] != known[m])
            raise AdapterLoadError(
                f"adapter {adapter}: this version's layout differs from its first at {changed[0]} "
                f"(an adapter keeps its modules and rank)"
            )
        if known is None:
            for module, (a, _) in pairs.items():
                self._layer(module).add(adapter, int(a.shape[0]))
            self._layouts[adapter] = shapes
            if self._routed is not None:
                self.route(self._routed)
        for module, (a, b) in pairs.items():
            self._layers[module].write(adapter, a, b, scaling)

    def copy(self, source: str, target: str) -> None:
        """`target` becomes a copy of `source`'s current version (its scaling included): a frozen
        snapshot the next versions of `source` leave as it is. `target` is declared with `source`'s
        layout on its first copy; a resident `target` must have that layout."""
        if source not in self._layouts:
            raise KeyError(f"no adapter named {source} is loaded (loaded: {self.adapters})")
        layout = self._layouts[source]
        if target not in self._layouts:
            self.declare({target: layout})
        elif self._layouts[target] != layout:
            raise AdapterLoadError(
                f"adapter {target}: its layout differs from {source}'s, which it would copy"
            )
        for module in layout:
            self._layers[module].copy(source, target)

    def tensors(self, adapter: str) -> dict[str, torch.Tensor]:
        """Copies of `adapter`'s tensors as it serves them (A already scaled): `load` of them at
        scaling 1 into another bank of the same base serves it bit for bit."""
        if adapter not in self._layouts:
            raise KeyError(f"no adapter named {adapter} is loaded (loaded: {self.adapters})")
        out = {}
        for module in self._layouts[adapter]:
            out[module + A_SUFFIX], out[module + B_SUFFIX] = self._layers[module].read(adapter)
        return out

    def route(self, adapters: Sequence[str | None]) -> None:
        """Row i of the following forward passes is served by `adapters[i]` (None: the base alone)."""
        unknown = sorted({a for a in adapters if a is not None and a not in self._layouts})
        if unknown:
            raise KeyError(f"no adapter named {', '.join(unknown)} is loaded (loaded: {self.adapters})")
        self._routed = list(adapters)
        for layer in self._layers.values():
            layer.route(self._routed)

    def _pairs(
        self, adapter: str, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        modules = dict(self.model.named_modules())
        a_of = {k.removesuffix(A_SUFFIX): t for k, t in tensors.items() if k.endswith(A_SUFFIX)}
        b_of = {k.removesuffix(B_SUFFIX): t for k, t in tensors.items() if k.endswith(B_SUFFIX)}
        other = sorted(k for k in tensors if not k.endswith((A_SUFFIX, B_SUFFIX)))
        if other:
            raise AdapterLoadError(f"adapter {adapter}: {other[0]} is not a LoRA A or B weight")
        if not a_of:
            raise AdapterLoadError(f"adapter {adapter}: no tensors")
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for module in sorted(set(a_of) | set(b_of)):
            if module not in a_of or module not in b_of:
                half = A_SUFFIX if module not in a_of else B_SUFFIX
                raise AdapterLoadError(f"adapter {adapter}: {module}{half} is missing")
            base = modules.get(module)
            if not isinstance(base, torch.nn.Linear):
                raise AdapterLoadError(
                    f"adapter {adapter}: {module}{A_SUFFIX}: the model has no linear layer {module}"
                )
            a, b = a_of[module], b_of[module]
            rank = a.shape[0]
            if a.shape != (rank, base.in_features) or b.shape != (base.out_features, rank):
                raise AdapterLoadError(
                    f"adapter {adapter}: {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit a "
                    f"linear layer of {base.in_features} inputs and {base.out_features} outputs"
                )
            pairs[module] = (a, b)
        return pairs

    def _layer(self, module: str) -> _Adapted:
        if module not in self._layers:
            base = self.model.get_submodule(module)
            assert isinstance(base, torch.nn.Linear)
            self._layers[module] = _Adapted(base)
        return self._layers[module]
