"""Chains of bit-exact deltas between consecutive versions of a policy's tensors (weights/delta.py),
for a transport that keeps versions in a store (objectstore).

The sender keeps a host copy of the version it published last. Each new version is published whole,
as before, and beside it as the deltas from that copy, encoded once (`encode_link`: pickled
`TensorDelta`s, what a receiver fetches). The manifest lists the links of the last `keep` versions,
so an engine that holds any of their bases (it missed a few syncs, or restarted from a version the
chain still covers) fetches those deltas rather than the whole version.

The receiver applies a chain to copies of its tensors and checks each tensor's checksum against the
new version before anything is served: a wrong base or a damaged delta fails that update only, with
the tensor named, and the receiver then fetches the whole version. A tensor that did not change
keeps its tensor object (its checksum is still checked), so applying a delta copies only what changed.
"""

from __future__ import annotations

import itertools
import pickle
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog
import torch

from polyrl_runtime.weights.api import (
    DeltaLink,
    SyncReport,
    WeightManifest,
    WeightTarget,
    make_report,
    swappable,
)
from polyrl_runtime.weights.delta import DeltaError, TensorDelta, apply_delta, checksum, make_delta

log = structlog.get_logger(__name__)


def encode_link(deltas: Sequence[TensorDelta]) -> bytes:
    """The bytes a receiver fetches for one link."""
    return pickle.dumps(list(deltas), protocol=pickle.HIGHEST_PROTOCOL)


def decode_link(data: bytes) -> list[TensorDelta]:
    deltas = pickle.loads(data)
    if not isinstance(deltas, list) or not all(isinstance(d, TensorDelta) for d in deltas):
        raise DeltaError("?", "a delta link holds something other than tensor deltas")
    return deltas


class DeltaChain:
    """Sender side: the previous version's host copy and the links of the last `keep` versions."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.keep = keep
        self.links: deque[DeltaLink] = deque(maxlen=keep)
        self._base: dict[str, torch.Tensor] = {}
        self._base_version: int | None = None

    def extend(
        self, version: int, tensors: Mapping[str, torch.Tensor], put: Callable[[bytes], Any]
    ) -> tuple[DeltaLink, ...]:
        """Add the link from the previous version to `version` (stored with `put`, which returns its
        handle) and keep `version` as the next base. A version whose tensors differ in names, shapes
        or dtypes from the base starts a new chain."""
        base = self._base
        same = base.keys() == tensors.keys() and all(
            base[n].shape == t.shape and base[n].dtype == t.dtype for n, t in tensors.items()
        )
        if self._base_version is not None and same:
            data = encode_link([make_delta(n, base[n], t.detach().cpu()) for n, t in tensors.items()])
            self.links.append(DeltaLink(self._base_version, version, len(data), put(data)))
        else:
            self.links.clear()
        self._base = {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()}
        self._base_version = version
        return tuple(self.links)

    def clear(self) -> None:
        self.links.clear()
        self._base, self._base_version = {}, None


def chain_from(manifest: WeightManifest, version: int) -> list[DeltaLink]:
    """The links of `manifest` that lead from `version` to the manifest's version, in order (empty
    when the chain does not start at or pass through `version`)."""
    links = list(manifest.deltas)
    for i, link in enumerate(links):
        if link.base == version:
            tail = links[i:]
            connected = all(a.version == b.base for a, b in itertools.pairwise(tail))
            return tail if connected and tail[-1].version == manifest.version else []
    return []


def apply_chain(
    own: Mapping[str, torch.Tensor], links: Sequence[list[TensorDelta]]
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """`own` with every link applied in order: the new version's tensors (those that did not change
    are `own`'s objects), and the names of those that changed. Raises `DeltaError` naming the first
    tensor whose delta does not apply or whose result fails its checksum; `own` is never written."""
    out = dict(own)
    changed: set[str] = set()
    for deltas in links:
        if {d.name for d in deltas} != out.keys():
            missing = sorted(out.keys() ^ {d.name for d in deltas})
            raise DeltaError(missing[0], "the delta link and the engine's tensors differ in names")
        for d in deltas:
            if d.full or d.changed:
                out[d.name] = apply_delta(d, out[d.name])
                changed.add(d.name)
            elif checksum(out[d.name]) != d.checksum:  # unchanged: the base itself must be right
                raise DeltaError(d.name, "the engine's tensor is not the delta's base (checksum differs)")
    return out, changed


def receive_links(
    manifest: WeightManifest, links: Sequence[bytes], target: WeightTarget, start: float, nbytes: int
) -> SyncReport:
    """Apply fetched links (`encode_link` bytes, in order) to `target` as `manifest`'s version: every
    tensor is checked before any is served (`DeltaError` names the first that fails, and `target`
    keeps its version); `nbytes` is what was fetched for them."""
    new, changed = apply_chain(target.named_tensors(), [decode_link(d) for d in links])
    pause_start = time.perf_counter()
    with target.paused(manifest.version):
        if swappable(target):
            target.swap(new)  # type: ignore[attr-defined]  # swappable() checked it is a TensorTarget
        else:
            own = target.named_tensors()
            for name in changed:
                own[name].copy_(new[name])
    pause = time.perf_counter() - pause_start
    log.debug("weights.delta_applied", policy=manifest.policy, version=manifest.version, links=len(links))
    return make_report(manifest, start, pause, applied=True, nbytes=nbytes)


def log_rejected(manifest: WeightManifest, base: int, error: DeltaError) -> None:
    """An engine at `base` could not apply `manifest`'s deltas: that update takes the whole version."""
    log.warning(
        "weights.delta_rejected",
        policy=manifest.policy,
        version=manifest.version,
        base=base,
        tensor=error.tensor,
        reason=error.reason,
    )
