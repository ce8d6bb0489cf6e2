"""Engine-side staging shared by the `shm` and `collective` receivers: receive a whole version into a
flat buffer, then apply it all at once.

All or nothing needs the new version complete before the engine's tensors change, so a receiver
lands every byte in a staging buffer first. Applying it is then either

- a *swap* (targets that allow it, e.g. every `TensorTarget.from_module`): the tensors are rebound to
  dtype views of the staging buffer, O(1) per tensor instead of a copy of every byte. The buffer that
  served until then becomes the next staging buffer, so a receiver keeps two and never writes the one
  the engine is serving from; or
- a copy from the staging buffer into the target's tensors, for targets that must be written in place.

Swapping needs each tensor's bytes aligned for its dtype inside the flat buffer, hence `ALIGN` in the
layouts of the transports that use this module.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping

import torch

from polyrl_runtime.weights.api import TensorTarget, WeightManifest, WeightTarget, swappable
from polyrl_runtime.weights.buckets import BucketLayout, PairCache, run_copies, tensor_offsets

# Tensor starts in flat buffers: enough for any dtype (and for vectorised copies).
ALIGN = 64


def flat_views(layout: BucketLayout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each tensor of `layout` as a typed view of the flat buffer that holds it (no copy)."""
    out = {}
    for spec, off in zip(layout.specs, tensor_offsets(layout), strict=True):
        if off < 0:  # no bytes: nothing to share, any empty tensor of that shape will do
            out[spec.name] = torch.empty(spec.shape, dtype=spec.dtype, device=flat.device)
            continue
        if off % spec.dtype.itemsize:
            raise ValueError(f"{spec.name}: flat offset {off} is not aligned for {spec.dtype}")
        out[spec.name] = flat[off : off + spec.nbytes].view(spec.dtype).view(spec.shape)
    return out


class Staging:
    """The staging buffers of one receiver and the two ways of applying them (see the module doc)."""

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._live = -1  # index of the buffer the target is serving from after a swap, else -1
        self._views: list[tuple[object, dict[str, torch.Tensor]] | None] = [None, None]
        self._pairs = PairCache()
        self._index = 0
        self._swap = False
        self._owner: weakref.ref[TensorTarget] | None = None  # the target serving from _live

    def buffer(
        self, layout: BucketLayout, target: WeightTarget, device: torch.device | None = None
    ) -> torch.Tensor:
        """The buffer to receive the next version into; never the one the target serves from.

        `device`: where the transport must land the bytes (a NCCL receiver needs the GPU); None lets
        the buffer live wherever the target's tensors are.
        """
        owner = self._owner() if self._owner is not None else None
        if owner is not None and owner is not target:
            # Another target still serves from one of our buffers: leave both to it (its views keep
            # them alive) rather than ever writing into weights it serves.
            self.close()
        tensors = list(target.named_tensors().values())
        own_device = tensors[0].device if tensors else torch.device("cpu")
        self._swap = swappable(target) and (device is None or device == own_device)
        device = device or (own_device if self._swap else torch.device("cpu"))
        # Alternate only while swapping; a copying target never serves from our buffers, but one that
        # stopped swapping may still serve from the buffer it was last swapped to, so avoid that one.
        self._index = (1 - self._live) if self._live >= 0 else 0
        buf = self._bufs[self._index]
        if buf is None or buf.numel() < layout.total_bytes or buf.device != device:
            buf = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
            self._bufs[self._index] = buf
            self._views[self._index] = None
        return buf

    def apply(self, manifest: WeightManifest, target: WeightTarget, flat: torch.Tensor) -> float:
        """Make the staged version the target's (the caller validated the manifest); returns the pause."""
        layout = manifest.layout
        if self._swap:
            assert isinstance(target, TensorTarget)
            cached = self._views[self._index]
            key = (layout, flat.data_ptr())
            if cached is None or cached[0] != key:
                cached = (key, flat_views(layout, flat))
                self._views[self._index] = cached
            start = time.perf_counter()
            with target.paused(manifest.version):
                target.swap(cached[1])
                self._live = self._index
                self._owner = weakref.ref(target)
            return time.perf_counter() - start
        own: Mapping[str, torch.Tensor] = target.named_tensors()
        ordered = [own[s.name] for s in layout.specs]
        plan = self._pairs.plan(layout, ordered, flat, into_flat=False)
        start = time.perf_counter()
        with target.paused(manifest.version):
            run_copies(plan)
            if flat.device.type == "cuda":
                torch.cuda.synchronize(flat.device)
        return time.perf_counter() - start

    def close(self) -> None:
        # Buffers a target still serves from stay alive through its views; only our references go.
        self._bufs = [None, None]
        self._views = [None, None]
        self._live = -1
        self._owner = None
