"""The torch engine's adapters: several policies served as LoRA adapters on the engine's one base model.

Each policy's adapter has a weight target of its own (`AdapterTarget`): a transport writes one version
of the adapter's tensors into it as it would into a model's parameters (the same manifest check, the
same all-or-nothing rule), and the version is applied to the bank (`engines/lora_bank.py`) as the
write completes, under the base model's serving lock, so between two forward passes. A transport
fetches a version before it takes that lock, so an update holds the other adapters' requests for the
copy into the bank only, never for the transfer: updating one policy never pauses another.

Versions and update counts are per adapter. A request's cached key and value rows are computed again
after its own adapter changes (as a full-weight engine does after any update) and are kept when
another adapter changes. Until its first version an adapter's B is zero, so it serves what the base
model gives, as peft's freshly initialised adapter does.

A frozen policy of the shared base (`base_policies`) has no adapter: its rows are routed to the base
alone, with the base's version and update count (which adapter updates never change), and a weight
update naming it is refused as one naming an unknown policy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from polyrl_operator.api import Lora
from polyrl_runtime.engines.lora_bank import LoraBank
from polyrl_runtime.models.lora_layout import AdapterLayout, adapter_layout
from polyrl_runtime.weights.api import TensorTarget


class UnknownAdapterError(ValueError):
    """A request or a weight update names a policy the engine holds no adapter for (a request of a
    policy it serves the base alone is accepted; a weight update for one is not)."""

    def __init__(self, engine: str, policy: str, known: Sequence[str]) -> None:
        super().__init__(
            f"engine {engine} serves the adapters of {', '.join(known)}: it holds none for policy {policy!r}"
        )
        self.engine, self.policy, self.known = engine, policy, tuple(known)

    def __reduce__(self) -> tuple[type[UnknownAdapterError], tuple[str, str, tuple[str, ...]]]:
        return UnknownAdapterError, (self.engine, self.policy, self.known)  # through Ray


class AdapterTarget(TensorTarget):
    """One adapter's tensors, as a weight target: written by a transport, then applied (`apply`) under
    the shared serving `lock` when the whole version has been written. A version that fails halfway
    leaves the served adapter as it was (only the staging tensors were written).

    The staging tensors exist only while a version is received: allocated when a transport first asks
    for them (its manifest check), dropped once the version is applied, so between updates an adapter
    is resident once, in the bank."""

    def __init__(
        self,
        layout: AdapterLayout,
        *,
        dtype: torch.dtype,
        device: torch.device,
        lock: threading.Lock,
        apply: Callable[[Mapping[str, torch.Tensor]], None],
    ) -> None:
        super().__init__({}, swappable=True, lock=lock)
        self.layout = layout
        self._dtype, self._device = dtype, device
        self._apply = apply
        self._staged: dict[str, torch.Tensor] | None = None

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        if self._staged is None:
            shapes = self.layout.shapes().items()
            self._staged = {n: torch.zeros(s, dtype=self._dtype, device=self._device) for n, s in shapes}
        return self._staged

    def swap(self, new: Mapping[str, torch.Tensor]) -> None:
        if not self.lock.locked():
            raise RuntimeError("swap() outside paused()")
        self._staged = {name: new[name] for name in self.layout.shapes()}

    @contextmanager
    def paused(self, new_version: int) -> Iterator[None]:
        with self.lock:
            yield
            self._apply(self.named_tensors())
            self._staged = None
            self._updates += 1
            self._version = new_version


class EngineAdapters:
    """The adapters of `loras` (policy -> its `algorithm.lora`) on `model`, which `base` serves, and
    the policies served `base` alone (`base_policies`: frozen policies of the shared base)."""

    def __init__(
        self,
        engine: str,
        model: torch.nn.Module,
        base: TensorTarget,
        loras: Mapping[str, Lora],
        base_policies: Sequence[str] = (),
    ) -> None:
        both = sorted(set(loras) & set(base_policies))
        if both:
            raise ValueError(f"engine {engine}: policy {both[0]} is given an adapter and the base alone")
        self.engine = engine
        self.base = base
        self.base_policies = frozenset(base_policies)
        self.bank = LoraBank(model)
        weight = next(model.parameters())
        self.targets: dict[str, AdapterTarget] = {}
        layouts = {policy: adapter_layout(model, policy, lora) for policy, lora in loras.items()}
        # Every adapter's columns allocated at once, B zero: each serves what the base gives until its
        # first version.
        self.bank.declare({p: _bank_layout(layout) for p, layout in layouts.items()})
        for policy, layout in layouts.items():

            def apply(
                tensors: Mapping[str, torch.Tensor], policy: str = policy, scaling: float = layout.scaling
            ) -> None:
                self.bank.load(policy, tensors, scaling)

            self.targets[policy] = AdapterTarget(
                layout, dtype=weight.dtype, device=weight.device, lock=base.lock, apply=apply
            )

    @property
    def policies(self) -> list[str]:
        return list(self.targets)

    def target(self, policy: str) -> AdapterTarget:
        """The weight target of `policy`'s adapter (a policy served the base alone has none)."""
        target = self.targets.get(policy)
        if target is None:
            raise UnknownAdapterError(self.engine, policy, self.policies)
        return target

    def check(self, policy: str) -> None:
        """Raise `UnknownAdapterError` unless the engine serves `policy` (an adapter or the base)."""
        if policy not in self.base_policies:
            self.target(policy)

    def version(self, policy: str) -> int:
        """The version `policy`'s tokens are sampled with: its adapter's, or the base's."""
        return self.base.version if policy in self.base_policies else self.target(policy).version

    def updates(self, policy: str) -> int:
        return self.base.updates if policy in self.base_policies else self.target(policy).updates

    def versions(self) -> dict[str, int]:
        """Each adapter's version (the policies served the base alone have no adapter: not listed)."""
        return {p: t.version for p, t in self.targets.items()}

    def route(self, policies: Sequence[str]) -> None:
        """Row i of the next forward passes runs with the adapter of `policies[i]` (the base alone for
        a policy in `base_policies`)."""
        self.bank.route([None if p in self.base_policies else p for p in policies])

    def nbytes(self, policy: str) -> int:
        return self.bank.nbytes(policy)


def _bank_layout(layout: AdapterLayout) -> dict[str, tuple[torch.Size, torch.Size]]:
    return {
        m: (torch.Size((layout.rank, layer.in_features)), torch.Size((layer.out_features, layout.rank)))
        for m, layer in layout.layers.items()
    }
