"""`storage` transport: versions written under a URI (`s3://` or `file://`), for engines that reach the
trainer through nothing but storage: another cluster, a remote pool.

Under `<uri>/<policy>/` the trainer writes, for each version, one object:

- every `full_every` versions (and the first, and whenever the tensors' names, shapes or dtypes
  change) the *whole* version, `v<version>.whole`: every tensor in full with its CRC-32 (a chain's
  first link, which applies to any base of the right shapes: weights/delta.py `whole`);
- in between, only the bit-exact *deltas* from the version before, `v<version>.delta`.

The manifest names the newest whole version and the deltas since (`handle`, `deltas`). An engine at
one of those versions fetches the deltas from its own; any other (a joining or restarted engine, one
that fell behind) fetches the whole version and every delta since. Each tensor's checksum is checked
before the version is applied whole; when a check fails on the short way, the engine takes the long
one, and when that fails too the update fails naming the policy, the version and the tensor (the
engine keeps serving what it holds, and the next publish tries again).

The trainer keeps a host copy of its last version to make deltas from. When it writes a whole
version it removes everything under its prefix but that version and the one whole version (with its
deltas) before it: an engine still fetching the older chain finishes, and what an earlier trainer of
the policy left (a restart) goes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import ClassVar

import structlog
import torch

from polyrl_runtime import storage
from polyrl_runtime.weights.api import (
    DeltaLink,
    SyncReport,
    WeightManifest,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    WeightTarget,
    check_manifest,
    make_report,
)
from polyrl_runtime.weights.buckets import layout_for
from polyrl_runtime.weights.delta import DeltaError, TensorDelta, make_delta, whole
from polyrl_runtime.weights.delta_chain import chain_from, encode_link, log_rejected, receive_links

log = structlog.get_logger(__name__)

TRANSPORT = "storage"


def policy_root(uri: str, policy: str) -> str:
    """Where `policy`'s versions lie: an object-store URI, or a local directory for `file://`."""
    base = uri if storage.is_object_store(uri) else str(storage.local_path(uri))
    return storage.join(base, policy)


class StorageSender(WeightSender):
    """Writes each version under `uri`: whole every `full_every` versions, deltas in between."""

    transport: ClassVar[str] = TRANSPORT

    def __init__(self, policy: str, bucket_bytes: int, uri: str, full_every: int = 8) -> None:
        super().__init__(policy, bucket_bytes)
        if full_every < 1:
            raise ValueError(f"full_every must be at least 1, got {full_every}")
        self.root = policy_root(uri, policy)
        self.full_every = full_every
        self._base: dict[str, torch.Tensor] = {}  # the last version's host copy
        self._whole: DeltaLink | None = None  # the newest whole version
        self._links: list[DeltaLink] = []  # the deltas since it, oldest first

    def _write(self, name: str, deltas: list[TensorDelta], base: int, version: int) -> DeltaLink:
        data = encode_link(deltas)
        uri = storage.join(self.root, name)
        storage.write_bytes(uri, data)
        return DeltaLink(base, version, len(data), uri)

    def _generation(self) -> set[str]:
        """The names of the newest whole version and its deltas."""
        links = [self._whole, *self._links] if self._whole is not None else []
        return {str(link.handle).rsplit("/", 1)[-1] for link in links}

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> WeightManifest:
        self._check_version(version)
        layout = layout_for(tensors, self.bucket_bytes)
        host = {n: t.detach().cpu() for n, t in tensors.items()}
        base = self._base
        same = (
            bool(base)
            and base.keys() == host.keys()
            and all(base[n].shape == t.shape and base[n].dtype == t.dtype for n, t in host.items())
        )
        if same and self._whole is not None and len(self._links) + 1 < self.full_every:
            assert self.latest is not None
            deltas = [make_delta(n, base[n], t) for n, t in host.items()]
            self._links.append(self._write(f"v{version:012d}.delta", deltas, self.latest.version, version))
        else:
            previous = self._generation()  # an engine may still be fetching that chain
            wholes = [whole(n, t) for n, t in host.items()]
            self._whole, self._links = self._write(f"v{version:012d}.whole", wholes, -1, version), []
            keep = previous | self._generation()
            for name in storage.list_names(self.root):
                if name not in keep:
                    storage.remove_file(storage.join(self.root, name))
        self._base = {n: t.clone() for n, t in host.items()}
        self.latest = WeightManifest(
            self.policy, version, self.transport, layout, handle=self._whole, deltas=tuple(self._links)
        )
        log.debug("weights.published", policy=self.policy, version=version, uri=self.root)
        return self.latest

    def close(self) -> None:
        self._base, self._whole, self._links = {}, None, []
        self.latest = None


class StorageReceiver(WeightReceiver):
    transport: ClassVar[str] = TRANSPORT

    def receive(self, manifest: WeightManifest, target: WeightTarget) -> SyncReport:
        start = time.perf_counter()
        check_manifest(manifest, target)
        if manifest.version == target.version:
            return make_report(manifest, start, 0.0, applied=False)
        links = chain_from(manifest, target.version)
        if links:
            try:
                return self._apply(manifest, links, target, start)
            except DeltaError as e:  # the long way follows: the whole version and every delta since
                log_rejected(manifest, target.version, e)
        first: DeltaLink = manifest.handle
        try:
            return self._apply(manifest, [first, *manifest.deltas], target, start)
        except DeltaError as e:
            raise WeightSyncError(
                f"policy {manifest.policy} version {manifest.version}: tensor {e.tensor!r}: {e.reason} "
                f"(read from {first.handle}); the engine keeps version {target.version}"
            ) from e

    @staticmethod
    def _apply(
        manifest: WeightManifest, links: list[DeltaLink], target: WeightTarget, start: float
    ) -> SyncReport:
        data = [storage.read_bytes(str(link.handle)) for link in links]
        return receive_links(manifest, data, target, start, sum(len(d) for d in data))
