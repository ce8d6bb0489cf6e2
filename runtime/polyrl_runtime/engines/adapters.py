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

A policy's past versions are served as snapshots (`snapshot`: a league's opponents): a copy of its
adapter's version in a slot of the bank, taken between two forward passes, which its next versions
leave as it is. A request names one by `SamplingParams.snapshot`; at most `keep` are held per policy,
and taking one more evicts the oldest, whose requests still in the engine then fail with
`UnknownSnapshotError` (their cache rows would be served other weights).

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
from polyrl_runtime.engines.api import SnapshotReport, UnknownSnapshotError
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
        self._snapshots: dict[str, dict[int, str]] = {}  # policy -> version -> its bank slot
        self._free_slots: dict[str, list[str]] = {}  # evicted slots, reused by the next snapshots
        self._slots: dict[str, int] = {}  # slots made per policy
        self._copies: dict[str, int] = {}  # slot -> versions copied into it
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

    def _new_slot(self, policy: str, layout: Mapping[str, tuple[torch.Size, torch.Size]] | None) -> str:
        """A bank adapter for one more snapshot of `policy`: an evicted one's, or a new one (declared
        with `layout` when given; else its first copy declares it)."""
        free = self._free_slots.get(policy)
        if free:
            return free.pop()
        n = self._slots.get(policy, 0)
        slot, self._slots[policy] = f"{policy}#snapshot{n}", n + 1
        if layout is not None:
            self.bank.declare({slot: layout})
        return slot

    def snapshot(self, policy: str, keep: int) -> SnapshotReport:
        """Hold `policy`'s adapter at its current version as a snapshot (again: nothing to do),
        evicting the oldest beyond `keep`. Call between forward passes (under the base's lock)."""
        if keep < 1:
            raise ValueError(f"engine {self.engine}: keep must be at least 1, got {keep}")
        target = self.target(policy)
        held = self._snapshots.setdefault(policy, {})
        evicted: list[int] = []
        if target.version not in held:
            while len(held) >= keep:
                oldest = min(held)
                self._free_slots.setdefault(policy, []).append(held.pop(oldest))
                evicted.append(oldest)
            slot = self._new_slot(policy, None)
            self.bank.copy(policy, slot)
            self._copies[slot] = self._copies.get(slot, 0) + 1
            held[target.version] = slot
        versions = tuple(sorted(held))
        nbytes = sum(self.bank.nbytes(slot) for slot in held.values())
        return SnapshotReport(policy, target.version, tuple(evicted), versions, nbytes)

    def snapshot_tensors(self, policy: str, versions: Sequence[int]) -> dict[int, dict[str, torch.Tensor]]:
        """Copies of `policy`'s snapshots at `versions` (`UnknownSnapshotError` for one not held), for
        another engine of the same base to hold (`receive_snapshots`)."""
        return {v: self.bank.tensors(self._slot(policy, v) or policy) for v in versions}

    def receive_snapshots(
        self, policy: str, states: Mapping[int, Mapping[str, torch.Tensor]], keep: int
    ) -> SnapshotReport:
        """Hold the snapshots `states` (version -> tensors, from `snapshot_tensors` of another engine)
        beside those held, at most `keep` of all (the oldest evicted). Call between forward passes."""
        if keep < 1:
            raise ValueError(f"engine {self.engine}: keep must be at least 1, got {keep}")
        self.target(policy)  # the policy is one of the engine's adapters
        layout = self.bank.layout(policy)
        held = self._snapshots.setdefault(policy, {})
        evicted: list[int] = []
        for version in sorted(states):
            if version in held:
                continue
            while len(held) >= keep:
                oldest = min(held)
                if oldest > version:  # older than every snapshot kept: not worth a slot
                    break
                self._free_slots.setdefault(policy, []).append(held.pop(oldest))
                evicted.append(oldest)
            if len(held) >= keep:
                continue
            slot = self._new_slot(policy, layout)
            self.bank.load(slot, states[version], scaling=1.0)
            self._copies[slot] = self._copies.get(slot, 0) + 1
            held[version] = slot
        versions = tuple(sorted(held))
        nbytes = sum(self.bank.nbytes(slot) for slot in held.values())
        return SnapshotReport(policy, max(versions, default=-1), tuple(evicted), versions, nbytes)

    def snapshots(self) -> dict[str, list[int]]:
        """Per policy with snapshots, the versions held."""
        return {p: sorted(held) for p, held in self._snapshots.items() if held}

    def _slot(self, policy: str, snapshot: int | None) -> str | None:
        """The bank adapter that serves `policy` (at past version `snapshot`); None: the base alone."""
        if snapshot is None:
            return None if policy in self.base_policies else policy
        held = self._snapshots.get(policy, {})
        if snapshot not in held:
            raise UnknownSnapshotError(self.engine, policy, snapshot, sorted(held))
        return held[snapshot]

    def _evicted(self, policy: str, snapshot: int | None) -> bool:
        """A row of an evicted snapshot: its request has failed already (`UnknownSnapshotError`), and a
        step that took it before the eviction serves it the base alone, its tokens never returned."""
        return snapshot is not None and snapshot not in self._snapshots.get(policy, {})

    def target(self, policy: str) -> AdapterTarget:
        """The weight target of `policy`'s adapter (a policy served the base alone has none)."""
        target = self.targets.get(policy)
        if target is None:
            raise UnknownAdapterError(self.engine, policy, self.policies)
        return target

    def check(self, policy: str, snapshot: int | None = None) -> None:
        """Raise `UnknownAdapterError` unless the engine serves `policy` (an adapter or the base), and
        `UnknownSnapshotError` unless it holds `snapshot` of it."""
        if policy not in self.base_policies:
            self.target(policy)
        self._slot(policy, snapshot)

    def version(self, policy: str, snapshot: int | None = None) -> int:
        """The version `policy`'s tokens are sampled with: the snapshot's, its adapter's, or the base's."""
        if snapshot is not None:
            return snapshot
        return self.base.version if policy in self.base_policies else self.target(policy).version

    def updates(self, policy: str, snapshot: int | None = None) -> int:
        """How often the weights serving `policy` (at `snapshot`) were written: a cache row computed
        with them is current while this is unchanged."""
        if snapshot is not None:
            return -1 if self._evicted(policy, snapshot) else self._copies[str(self._slot(policy, snapshot))]
        return self.base.updates if policy in self.base_policies else self.target(policy).updates

    def versions(self) -> dict[str, int]:
        """Each adapter's version (the policies served the base alone have no adapter: not listed)."""
        return {p: t.version for p, t in self.targets.items()}

    def route(self, rows: Sequence[tuple[str, int | None]]) -> None:
        """Row i of the next forward passes runs with the adapter of `rows[i]`: (policy, snapshot), the
        base alone for a policy in `base_policies`."""
        self.bank.route([None if self._evicted(p, snap) else self._slot(p, snap) for p, snap in rows])

    def nbytes(self, policy: str) -> int:
        return self.bank.nbytes(policy)


def _bank_layout(layout: AdapterLayout) -> dict[str, tuple[torch.Size, torch.Size]]:
    return {
        m: (torch.Size((layout.rank, layer.in_features)), torch.Size((layer.out_features, layout.rank)))
        for m, layer in layout.layers.items()
    }
