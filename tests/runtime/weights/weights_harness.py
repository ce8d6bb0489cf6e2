"""Helpers shared by the weight-sync tests: run one sync over any transport in this process."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from polyrl_runtime.weights import (
    SyncReport,
    TensorTarget,
    WeightManifest,
    WeightReceiver,
    WeightSender,
    make_receiver,
    make_sender,
)


def make_pair(
    transport: str, n_receivers: int, bucket_bytes: int
) -> tuple[WeightSender, list[WeightReceiver]]:
    kwargs: dict[str, Any] = {}
    rkw: dict[str, Any] = {}
    if transport == "collective":
        kwargs = {"num_receivers": n_receivers, "host": "127.0.0.1", "timeout_s": 60.0}
        rkw = {"timeout_s": 60.0}
    sender = make_sender(transport, "p", bucket_bytes, **kwargs)
    return sender, [make_receiver(transport, **rkw) for _ in range(n_receivers)]


def sync(
    sender: WeightSender,
    receivers: Sequence[WeightReceiver],
    targets: Sequence[TensorTarget],
    version: int,
    tensors: Mapping[str, torch.Tensor],
    *,
    relay: Callable[[WeightManifest], WeightManifest] | None = None,
) -> list[SyncReport | BaseException]:
    """Publish and receive on every receiver concurrently (collectives need all ranks at once).

    `relay` stands for the way from the trainer to the engines (e.g. a pickling round trip)."""
    manifest = sender.publish(version, tensors)
    if relay is not None:
        manifest = relay(manifest)
    results: list[SyncReport | BaseException] = [RuntimeError("not run")] * len(receivers)

    def run(i: int) -> None:
        try:
            results[i] = receivers[i].receive(manifest, targets[i])
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(receivers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sender.wait()
    return results


def zeros_like_all(
    tensors: Mapping[str, torch.Tensor], version: int = -1, *, swappable: bool = False
) -> TensorTarget:
    return TensorTarget(
        {k: torch.zeros_like(v).contiguous() for k, v in tensors.items()}, version, swappable=swappable
    )


def random_tensors(
    spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]], seed: int = 0
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in spec.items():
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=g).bool()
        else:
            info = torch.iinfo(dtype)
            t = torch.randint(
                max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g, dtype=torch.int64
            )
            t = t.to(dtype)
        out[name] = t
    return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    )


# A small bf16 model for the delta tests; "bias" never changes between versions.
DELTA_SHAPES = {"embed": (64, 16), "proj": (16, 16), "norm": (16,), "bias": (3,)}


def bf16_weights(seed: int, shapes: Mapping[str, tuple[int, ...]] = DELTA_SHAPES) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def next_version(
    prev: Mapping[str, torch.Tensor], version: int, fraction: float = 0.05
) -> dict[str, torch.Tensor]:
    """The next version: `fraction` of each tensor's elements changed, "bias" not at all."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        n: torch.where(torch.rand(t.shape, generator=g) < (0.0 if n == "bias" else fraction), t + 0.5, t)
        for n, t in prev.items()
    }
