"""Types shared by every weight-sync transport: tensor specs, the one control message, reports, errors.

A sync moves one *version* of one policy's named tensors from the trainer (sender) to each rollout
engine (receiver). The sender produces a `WeightManifest`: the only control message of a sync, whatever
the number of tensors, carrying the names/shapes/dtypes, the bucket layout and a transport-specific
handle (object references, a shared-memory path, a process-group address). Receivers check it against
their own parameters before any byte moves, so a mismatched engine keeps serving its old version.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from polyrl_runtime.weights.buckets import BucketLayout


class WeightSyncError(RuntimeError):
    """A sync could not be completed; the receiving engine still holds its previous version."""


class WeightMismatchError(WeightSyncError):
    """The manifest does not match the engine's parameters; `name` is the first offending tensor, of
    `policy`'s `version` (when known)."""

    def __init__(self, name: str, reason: str, policy: str = "", version: int | None = None) -> None:
        where = f"policy {policy} version {version}: " if policy and version is not None else ""
        super().__init__(f"{where}weight update rejected at tensor {name!r}: {reason}")
        self.name, self.reason, self.policy, self.version = name, reason, policy, version

    def __reduce__(self) -> tuple[type[WeightMismatchError], tuple[str, str, str, int | None]]:
        # Crosses Ray actor boundaries: rebuild from its fields, not from the formatted message.
        return (type(self), (self.name, self.reason, self.policy, self.version))


class DeltaRejectedError(WeightSyncError):
    """An engine could not apply a version sent as deltas (it holds another base, or a check failed):
    it keeps its version and needs the whole one, which the driver then sends (`collective`)."""


class VersionError(WeightSyncError):
    """A version would move backwards (versions are monotone per policy)."""


@dataclass(frozen=True)
class DeltaLink:
    """The bit-exact deltas (weights/delta.py) that turn version `base` into `version`, one per
    tensor, `nbytes` to fetch; `handle` is the transport's (a Ray ObjectRef for objectstore)."""

    base: int
    version: int
    nbytes: int
    handle: Any


@dataclass(frozen=True)
class WeightManifest:
    """The single control message of one sync (O(1) per sync, independent of the tensor count)."""

    policy: str
    version: int
    transport: str
    layout: BucketLayout
    # Transport-specific: list of Ray ObjectRefs (objectstore), a file path (shm), a rendezvous
    # address (collective). Opaque to everyone except that transport's receiver.
    handle: Any = None
    # Deltas from the versions before this one (oldest first; each link's `version` is the next
    # link's `base`, the last one's is this version): a receiver at one of those bases may apply
    # them instead of fetching the whole version. Empty: whole versions only.
    deltas: tuple[DeltaLink, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.layout.payload_bytes


@dataclass(frozen=True)
class SyncReport:
    """What one receiver measured for one sync."""

    policy: str
    version: int
    transport: str
    nbytes: int
    num_tensors: int
    num_buckets: int
    control_messages: int
    wall_s: float
    pause_s: float
    applied: bool

    @property
    def gbps(self) -> float:
        return self.nbytes / self.wall_s / 1e9 if self.wall_s > 0 else float("inf")


@runtime_checkable
class WeightTarget(Protocol):
    """The engine side of a sync: named tensors to overwrite in place, and the version they hold."""

    @property
    def version(self) -> int: ...

    def named_tensors(self) -> Mapping[str, torch.Tensor]: ...

    def paused(self, new_version: int) -> Any:
        """Context manager: stop serving, let the caller overwrite tensors, then record `new_version`."""
        ...


class TensorTarget:
    """A `WeightTarget` over a dict of tensors (or an nn.Module's parameters).

    Serving code takes `serving()` around each forward pass; an update takes the same lock, so a
    generation never sees a half-written model, and the time spent waiting is the engine pause.

    A target built with `swappable=True` (every `from_module` target) may also be updated by `swap`:
    its tensors are *replaced* by others of the same names, shapes and dtypes (views of a receiver's
    staging buffer), which makes applying a version O(1) instead of a full copy. Whoever reads the
    tensors must then go through `named_tensors()` (or the module) after each update, not keep the
    tensor objects from before it.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        version: int = -1,
        *,
        swappable: bool = False,
        rebind: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
        lock: threading.Lock | None = None,
    ) -> None:
        for name, t in tensors.items():
            if not t.is_contiguous():
                raise ValueError(f"engine tensor {name!r} is not contiguous; weights are written in place")
        self._tensors = dict(tensors)
        self._version = version
        self._updates = 0
        # Shared by targets whose tensors one forward pass reads together (a base and its adapters).
        self._lock = lock if lock is not None else threading.Lock()
        self.swappable = swappable or rebind is not None
        self._rebind = rebind

    @classmethod
    def from_module(cls, module: torch.nn.Module, version: int = -1) -> TensorTarget:
        """The module's parameters under their `named_parameters()` names (a tied weight once, under
        its first name): exactly what a trainer publishes. Buffers (e.g. rotary `inv_freq`) are
        derived from the config, never trained, and stay the module's own."""
        params = dict(module.named_parameters())
        named: dict[str, torch.Tensor] = {k: p.data for k, p in params.items()}

        def rebind(new: Mapping[str, torch.Tensor]) -> None:
            # `.data` keeps each Parameter object (and so weight tying, hooks, optimiser state keys)
            # and only points it at the new storage.
            for name, p in params.items():
                p.data = new[name]

        return cls(named, version, rebind=rebind)

    @property
    def version(self) -> int:
        return self._version

    @property
    def lock(self) -> threading.Lock:
        """Held by `serving()` and `paused()`: a target built with another's lock (`lock=`) is updated
        only between the forward passes that serve that one."""
        return self._lock

    @property
    def updates(self) -> int:
        """How many updates have written (or may have written) the tensors: state derived from the
        weights (an engine's KV cache) is current while this count is unchanged, even when an update
        re-applies a version or fails halfway."""
        return self._updates

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    def swap(self, new: Mapping[str, torch.Tensor]) -> None:
        """Serve `new` (same names, shapes, dtypes) from now on; call only inside `paused()`."""
        if not self.swappable:
            raise TypeError("this target is updated in place only")
        if not self._lock.locked():
            raise RuntimeError("swap() outside paused()")
        if self._rebind is not None:
            self._rebind(new)
        self._tensors = {name: new[name] for name in self._tensors}

    @contextmanager
    def paused(self, new_version: int) -> Iterator[None]:
        with self._lock:
            try:
                yield
            finally:
                self._updates += 1
            self._version = new_version

    @contextmanager
    def serving(self) -> Iterator[int]:
        with self._lock:
            yield self._version


def swappable(target: WeightTarget) -> bool:
    """Whether `target` may be updated by `TensorTarget.swap` (its tensors all on one device)."""
    if not isinstance(target, TensorTarget) or not target.swappable:
        return False
    devices = {t.device for t in target.named_tensors().values()}
    return len(devices) <= 1


def check_manifest(manifest: WeightManifest, target: WeightTarget) -> None:
    """Raise `WeightMismatchError` naming the policy, the version and the first tensor whose name,
    shape or dtype differs."""
    own = target.named_tensors()
    seen: set[str] = set()

    def mismatch(name: str, reason: str) -> WeightMismatchError:
        return WeightMismatchError(name, reason, manifest.policy, manifest.version)

    for spec in manifest.layout.specs:
        seen.add(spec.name)
        t = own.get(spec.name)
        if t is None:
            raise mismatch(spec.name, "the engine has no tensor of that name")
        if tuple(t.shape) != spec.shape:
            raise mismatch(spec.name, f"shape {spec.shape} != engine's {tuple(t.shape)}")
        if t.dtype != spec.dtype:
            raise mismatch(spec.name, f"dtype {spec.dtype} != engine's {t.dtype}")
        if not t.is_contiguous():
            raise mismatch(spec.name, "the engine's tensor is not contiguous")
    for name in own:
        if name not in seen:
            raise mismatch(name, "the update does not contain this engine tensor")
    if manifest.version < target.version:
        raise VersionError(
            f"{manifest.policy}: update to version {manifest.version} is older than the engine's "
            f"{target.version}"
        )


class WeightSender(ABC):
    """Trainer side: makes one version of a policy's tensors available to its engines."""

    transport: ClassVar[str]

    def __init__(self, policy: str, bucket_bytes: int) -> None:
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be positive")
        self.policy = policy
        self.bucket_bytes = bucket_bytes
        self.latest: WeightManifest | None = None

    def _check_version(self, version: int) -> None:
        if self.latest is not None and version <= self.latest.version:
            raise VersionError(
                f"{self.policy}: version {version} is not newer than the published {self.latest.version}"
            )

    @abstractmethod
    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> WeightManifest:
        """Start (or complete) moving `tensors` as `version`; return the control message for engines."""

    def wait(self) -> None:  # noqa: B027 - a no-op default is right for store-based transports
        """Block until the data of the last publish has left this process (collective transports)."""

    def release_source(self) -> None:  # noqa: B027 - store-based transports hold their own copy
        """The caller is about to change the tensors it published: stop reading them.

        Senders that send straight from the caller's tensors (collective) finish that send first;
        until the next publish they can then no longer serve the latest version to late joiners.
        """

    def close(self) -> None:  # noqa: B027 - nothing to free by default
        """Release transport resources (segments, groups, object references)."""


class WeightReceiver(ABC):
    """Engine side: applies a whole version from a manifest, or nothing."""

    transport: ClassVar[str]

    @abstractmethod
    def receive(self, manifest: WeightManifest, target: WeightTarget) -> SyncReport:
        """Fetch the version named by `manifest` and write it into `target`, all or nothing."""

    def close(self) -> None:  # noqa: B027 - nothing to free by default
        """Release cached mappings or groups."""


def make_report(
    manifest: WeightManifest, start: float, pause_s: float, *, applied: bool, nbytes: int | None = None
) -> SyncReport:
    """The report of one receive that began at `start` (a `time.perf_counter()` reading); `nbytes`:
    what it fetched, when not the whole version (deltas)."""
    return SyncReport(
        policy=manifest.policy,
        version=manifest.version,
        transport=manifest.transport,
        nbytes=(manifest.nbytes if nbytes is None else nbytes) if applied else 0,
        num_tensors=len(manifest.layout.specs),
        num_buckets=len(manifest.layout.buckets),
        control_messages=1,
        wall_s=time.perf_counter() - start,
        pause_s=pause_s,
        applied=applied,
    )
