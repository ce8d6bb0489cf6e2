"""Weight-sync throughput of each transport next to this machine's own bounds, measured in one run.

    .venv/bin/python benchmarks/weight_sync.py [--sizes 64,256] [--bucket-mb 256] [--repeats 10]
        [--layout-scale 4] [--tables layout,bounds,messages] [--quick]
    .venv/bin/python benchmarks/weight_sync.py --deltas [--layout-scale 4] [--repeats 3] [--quick]

The first table moves a real model's layout: the 290 parameters of a Qwen2.5-0.5B-sized
Qwen2ForCausalLM (24 layers, hidden 896, intermediate 4864, 14 heads / 2 KV heads, vocabulary
151,936, tied embeddings, q/k/v biases and norms), names and shapes taken from `transformers` on the
meta device, in bf16. `--layout-scale N` divides hidden size, intermediate size and vocabulary by N
(default 4: 59 MiB, which this 2-core machine moves in tens of milliseconds; 1: the full model, about
1 GB). Each transport moves it in turns with the same bytes in 10 equal tensors, on a second pair of
actors; the ratio (10-tensor time / real-layout time) is what per-tensor costs leave of the speed.
`--quick` runs every table at tiny sizes once (the smoke test).

Trainer and engine are separate Ray actor processes. Every figure is end to end as seen from the
driver (publish -> the engine has applied the version); the bounds are measured the same way:
  copy   in-process single-thread tensor copy of the same bytes (what shm is compared with)
  gloo   raw broadcast of one flat uint8 tensor between two processes (what collective is compared with)
  ray    raw Ray transfer: ray.put of one numpy array in one actor, ray.get + copy into a
         preallocated array in another (what objectstore is compared with)
Each transport and its bound run in turns (bound, transport, bound, ...; best of `--repeats` each), so
a slow phase of this shared machine lands on both: measured one after the other, the raw gloo bound
alone moved between 2.3 and 4.3 GB/s from run to run at 64 MiB.
A second table shows that control messages per sync do not grow with the number of tensors.
`--gloo-pieces 16,4,1` adds a third: raw gloo moving the smallest size in broadcasts of that many MiB,
next to one broadcast of the whole (why collective sends pieces of 1 MiB or more as they are).
The engine holds its weights in an nn.Module, as the torch engine does, so transports that can apply
a version by swapping the module's tensors do (`--target dict`: tensors that must be overwritten in
place, as before that change).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")

import numpy as np
import ray
import torch
from ray.actor import ActorHandle
from torch._C._distributed_c10d import BroadcastOptions, TCPStore

from polyrl_runtime.engines.api import Engine
from polyrl_runtime.engines.client import EngineClient
from polyrl_runtime.trainers.api import TrainerRank
from polyrl_runtime.trainers.client import TrainerRankClient
from polyrl_runtime.weights import TensorTarget, VersionRegistry
from polyrl_runtime.weights.collective_group import GroupAddress, build_group
from polyrl_runtime.weights.endpoints import EngineWeights, PolicyWeightSync, TrainerWeights

MiB = 1 << 20
TARGET = ["module"]  # set from --target


Spec = tuple[str, tuple[int, ...]]  # a tensor's name and shape; one dtype per model


def even_specs(total_bytes: int, n_tensors: int, dtype: torch.dtype = torch.float32) -> list[Spec]:
    """`n_tensors` 1-D tensors of equal size, `total_bytes` in all."""
    per = total_bytes // dtype.itemsize // n_tensors
    return [(f"layer{i}_weight", (per,)) for i in range(n_tensors)]


def qwen2_specs(scale: int) -> list[Spec]:
    """The parameters of a Qwen2.5-0.5B-sized Qwen2ForCausalLM (24 layers, hidden 896, intermediate
    4864, 14 heads / 2 KV heads, vocab 151,936, tied embeddings: 290 tensors with q/k/v biases and
    norms), names and shapes exactly as `named_parameters()` gives them, built on the meta device.
    `scale` divides hidden size, intermediate size and vocabulary (head count and layers unchanged), so
    every tensor keeps its name and its place in the layout at about 1/scale^2 of the bytes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=896 // scale,
        intermediate_size=4864 // scale,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936 // scale,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        m = Qwen2ForCausalLM(config)
    return [(name, tuple(p.shape)) for name, p in m.named_parameters()]


def nbytes_of(specs: list[Spec], dtype: torch.dtype) -> int:
    return sum(math.prod(shape) for _, shape in specs) * dtype.itemsize


def fill(i: int) -> float:
    return float(i % 128)  # exact in bf16


def model(specs: list[Spec], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for i, (name, shape) in enumerate(specs):
        t = torch.empty(shape, dtype=dtype)
        t.fill_(fill(i))
        out[name] = t
    return out


def engine_module(specs: list[Spec], dtype: torch.dtype) -> torch.nn.Module:
    """The engine's model as the torch engine holds it: an nn.Module (submodules for dotted names),
    whose target may swap weights."""
    root = torch.nn.Module()
    for name, t in model(specs, dtype).items():
        owner = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
    return root


class Worker(TrainerWeights, EngineWeights):
    """One actor process that plays every role in turn (trainer, engine, raw peers): two processes
    serve the whole run, so no figure includes a process start."""

    def trainer(
        self, transport: str, specs: list[Spec], dtype: torch.dtype, bucket: int, kwargs: dict[str, Any]
    ) -> None:
        self.tensors = model(specs, dtype)
        self.init_weight_sender(transport, "bench", bucket, **kwargs)

    def weight_tensors(self) -> Mapping[str, torch.Tensor]:
        return self.tensors

    def engine(self, transport: str, specs: list[Spec], dtype: torch.dtype, kind: str) -> None:
        self.specs = specs
        self.module = engine_module(specs, dtype)
        if kind == "module":
            self.init_weight_receiver(transport, TensorTarget.from_module(self.module))
        else:
            self.init_weight_receiver(transport, {k: p.data for k, p in self.module.named_parameters()})

    def check(self) -> bool:
        # Through the module: what a forward pass would use, whether the update copied or swapped.
        params = dict(self.module.named_parameters())
        return all(bool((params[name] == fill(i)).all()) for i, (name, _) in enumerate(self.specs))

    def reset(self) -> None:
        for name in ("_weight_sender", "_weight_receiver"):
            if hasattr(self, name):
                getattr(self, name).close()
                delattr(self, name)
        self.tensors = {}
        self.module: Any = None
        self.reset_raw()

    def reset_raw(self) -> None:
        self.raw_buf: Any = None
        self.pg: Any = None
        self.store: Any = None
        self.arr: Any = None
        self.dst: Any = None

    # raw gloo broadcast
    def gloo_host(self) -> int:
        self.store = TCPStore(
            "127.0.0.1", 0, None, True, datetime.timedelta(seconds=120), wait_for_workers=False
        )
        return int(self.store.port)

    def gloo_join(self, rank: int, port: int, nbytes: int, generation: int) -> None:
        if rank:
            self.store = TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=120))
        addr = GroupAddress("127.0.0.1", port, generation, 2, "gloo")
        self.pg = build_group(self.store, addr, rank, datetime.timedelta(seconds=120))
        fill = torch.ones if rank == 0 else torch.zeros
        self.raw_buf = fill(nbytes, dtype=torch.uint8)

    def bcast(self, piece: int = 0) -> None:
        """One broadcast of the whole buffer, or (piece > 0) broadcasts of `piece` bytes, all in flight."""
        opts = BroadcastOptions()
        opts.rootRank = 0
        step = piece or self.raw_buf.numel()
        works = [
            self.pg.broadcast([self.raw_buf[i : i + step]], opts)
            for i in range(0, self.raw_buf.numel(), step)
        ]
        for w in works:
            w.wait()

    # raw Ray transfer
    def ray_setup(self, nbytes: int) -> None:
        self.arr = np.ones(nbytes, dtype=np.uint8)
        self.dst = np.zeros(nbytes, dtype=np.uint8)

    def put(self) -> list[Any]:
        return [ray.put(self.arr)]  # wrapped: a bare ref returned from a task would be resolved

    def get(self, refs: list[Any]) -> None:
        np.copyto(self.dst, ray.get(refs[0]))


class Counting:
    """Wraps an actor handle and counts the remote calls made through it (control messages)."""

    def __init__(self, handle: Any, counter: list[int]) -> None:
        self._h, self._c = handle, counter

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._h, name)
        counter = self._c

        class _M:
            def remote(self, *a: Any, **k: Any) -> Any:
                counter[0] += 1
                return method.remote(*a, **k)

        return _M()


Timed = Callable[[], None]


def timed(fn: Timed) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def best(fns: list[Timed], repeats: int) -> list[float]:
    """The best time of each of `fns`, run in turns (a, b, a, b, ...) so that a slow phase of this
    shared machine hits them alike; each is warmed up twice first (first-touch page faults, group
    rendezvous, worker start; transports alternate between two buffers or objects)."""
    for fn in fns:
        fn()
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times, strict=True):
            ts.append(timed(fn))
    return [min(ts) for ts in times]


def copy_bound(a: Any, b: Any, nbytes: int) -> tuple[Timed, Timed]:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def one() -> None:
        dst.copy_(src)

    return one, lambda: None


def gloo_bound(a: Any, b: Any, nbytes: int) -> tuple[Timed, Timed]:
    port = ray.get(a.gloo_host.remote())
    ray.get([a.gloo_join.remote(0, port, nbytes, 0), b.gloo_join.remote(1, port, nbytes, 0)])

    def one() -> None:
        ray.get([a.bcast.remote(), b.bcast.remote()])

    return one, lambda: ray.get([a.reset_raw.remote(), b.reset_raw.remote()])


def ray_bound(a: Any, b: Any, nbytes: int) -> tuple[Timed, Timed]:
    ray.get([a.ray_setup.remote(nbytes), b.ray_setup.remote(nbytes)])
    return lambda: ray.get(b.get.remote(a.put.remote())), lambda: ray.get(
        [a.reset_raw.remote(), b.reset_raw.remote()]
    )


BOUNDS = {"copy": copy_bound, "gloo": gloo_bound, "ray": ray_bound}


class Sync:
    """One transport between trainer `a` and engine `b`: `one()` syncs the next version end to end."""

    def __init__(
        self,
        a: Any,
        b: Any,
        transport: str,
        specs: list[Spec],
        *,
        bucket: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        kwargs: dict[str, Any] = (
            {"num_receivers": 1, "host": "127.0.0.1"} if transport == "collective" else {}
        )
        ray.get(
            [
                a.trainer.remote(transport, specs, dtype, bucket, kwargs),
                b.engine.remote(transport, specs, dtype, TARGET[0]),
            ]
        )
        self.a, self.b, self.transport = a, b, transport
        self.counter = [0]
        # The clients the driver calls the trainer and its engines with, over counting handles.
        self.wsync = PolicyWeightSync(
            "bench",
            TrainerRankClient(cast("ActorHandle[TrainerRank]", Counting(a, self.counter))),
            {"e0": EngineClient(cast("ActorHandle[Engine]", Counting(b, self.counter)))},
            VersionRegistry(),
            transport=transport,
        )
        self.version = 0
        self.pauses: list[float] = []
        self.messages = 0

    def one(self) -> None:
        self.counter[0] = 0
        result = self.wsync.sync(self.version)
        self.version += 1
        assert not result.failures, result.failures
        self.pauses.append(result.reports["e0"].pause_s)
        self.messages = self.counter[0]

    def close(self) -> None:
        assert ray.get(self.b.check.remote()), f"{self.transport}: engine weights differ from the trainer's"
        ray.get([self.a.reset.remote(), self.b.reset.remote()])


LAYOUT_DTYPE = torch.bfloat16  # what Qwen2.5 checkpoints hold and GPU trainers publish


def gb(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def real_layout_table(
    args: argparse.Namespace, workers: tuple[Any, ...], layout: list[Spec], bucket: int
) -> None:
    """Each transport moving the real layout, next to the same bytes in 10 tensors, in turns (two
    actor pairs, so neither sync is torn down between turns)."""
    a, b, c, d = workers
    nbytes = nbytes_of(layout, LAYOUT_DTYPE)
    hidden = 896 // args.layout_scale
    print(
        f"real layout: Qwen2.5-0.5B names and shapes, hidden/intermediate/vocab divided by "
        f"{args.layout_scale} (hidden {hidden}), {len(layout)} tensors, bf16, {nbytes / MiB:.1f} MiB, "
        f"against the same bytes in 10 tensors; bucket {args.bucket_mb} MiB, best of {args.repeats}"
    )
    print(f"{'':>6} {'transport':>12} {'tensors':>8} {'GB/s':>6} {'10-tensor GB/s':>14} {'ratio':>6}")
    ten = even_specs(nbytes, 10, LAYOUT_DTYPE)
    for transport in ("shm", "collective", "objectstore"):
        real = Sync(a, b, transport, layout, bucket=bucket, dtype=LAYOUT_DTYPE)
        even = Sync(c, d, transport, ten, bucket=bucket, dtype=LAYOUT_DTYPE)
        t_real, t_even = best([real.one, even.one], args.repeats)
        real.close()
        even.close()
        print(
            f"{'layout':>6} {transport:>12} {len(layout):>8} {gb(nbytes, t_real):>6.2f} "
            f"{gb(nbytes, t_even):>14.2f} {t_even / t_real:>6.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # 1024 is left to an explicit --sizes: with it a run takes minutes on this 2-core machine.
    ap.add_argument("--sizes", default="64,256", help="MiB of fp32 weights, comma separated")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tensors", type=int, default=16, help="tensors in the model for the main table")
    ap.add_argument("--tensor-counts", default="10,1000", help="tensor counts for the control-message table")
    ap.add_argument("--target", choices=["module", "dict"], default="module", help="the engine's weights")
    ap.add_argument("--gloo-pieces", default="", help="MiB per broadcast for the raw gloo pieces table")
    ap.add_argument(
        "--layout-scale",
        type=int,
        default=4,
        help="the real-layout table's Qwen2.5-0.5B layout with hidden, intermediate and vocab divided by "
        "this (1: the full model, about 1 GB in bf16; 0: no real-layout table)",
    )
    ap.add_argument(
        "--tables", default="layout,bounds,messages", help="which tables: layout, bounds, messages"
    )
    ap.add_argument(
        "--deltas",
        action="store_true",
        help="instead of the tables above, those of weightSync.deltas (benchmarks/_deltas.py): bytes and "
        "times at 1/10/100%% changed on the real layout, real training steps, a catch-up",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: checks that it runs")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.repeats, args.bucket_mb, args.tensor_counts = "1", 1, 1, "3,30"
        args.gloo_pieces, args.layout_scale = args.gloo_pieces or "1", 32 if args.layout_scale else 0
    TARGET[0] = args.target
    sizes = [int(s) for s in args.sizes.split(",")]
    bucket = args.bucket_mb * MiB
    layout = qwen2_specs(args.layout_scale) if args.layout_scale else []
    layout_bytes = nbytes_of(layout, LAYOUT_DTYPE)
    ray.init(
        address="local",  # a new local cluster, never one another process on this host started
        num_cpus=2,
        include_dashboard=False,
        logging_level="ERROR",
        object_store_memory=max(max(sizes) * MiB, layout_bytes) * 3 + (512 * MiB),
    )

    if args.deltas:
        deltas_tables(args, layout)
        ray.shutdown()
        return
    worker = ray.remote(num_cpus=0)(Worker)
    a, b, c, d = (worker.remote() for _ in range(4))
    ray.get([w.reset.remote() for w in (a, b, c, d)])
    tables = set(args.tables.split(","))
    if layout and "layout" in tables:
        real_layout_table(args, (a, b, c, d), layout, bucket)
    if "bounds" in tables:
        bounds_table(args, a, b, sizes, bucket)
    if "messages" in tables:
        messages_table(args, a, b, min(sizes) * MiB, bucket)
    if args.gloo_pieces:
        pieces_table(args, a, b, min(sizes) * MiB)
    ray.shutdown()


def deltas_tables(args: argparse.Namespace, specs: list[Spec]) -> None:
    import _deltas
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    g = torch.Generator().manual_seed(0)
    layout = {name: torch.randn(shape, generator=g).to(LAYOUT_DTYPE) for name, shape in specs}
    exact = _deltas.layout_table(layout, args.repeats)
    _deltas.training_table(steps=3 if args.quick else 10)
    _deltas.catch_up_table(layout, behind=3 if args.quick else 10, repeats=args.repeats)
    exact = _deltas.collective_table(layout, args.repeats) and exact
    exact = _deltas.storage_table(layout, behind=3 if args.quick else 10, repeats=args.repeats) and exact
    if not exact:
        raise SystemExit("a delta sync was not bit-exact")


def bounds_table(args: argparse.Namespace, a: Any, b: Any, sizes: list[int], bucket: int) -> None:
    print(f"\nweight sync, fp32, {args.tensors} tensors, bucket {args.bucket_mb} MiB, best of {args.repeats}")
    print(
        f"{'MiB':>6} {'bound':>6} {'bound GB/s':>10} {'transport':>12} {'GB/s':>6} {'ratio':>6} {'pause ms':>9}"
    )
    for mib in sizes:
        n = mib * MiB
        for transport, bound in (("shm", "copy"), ("collective", "gloo"), ("objectstore", "ray")):
            bound_one, bound_close = BOUNDS[bound](a, b, n)
            sync = Sync(a, b, transport, even_specs(n, args.tensors), bucket=bucket)
            t_bound, t = best([bound_one, sync.one], args.repeats)
            bound_close()
            sync.close()
            print(
                f"{mib:>6} {bound:>6} {gb(n, t_bound):>10.2f} {transport:>12} {gb(n, t):>6.2f} "
                f"{t_bound / t:>6.2f} {min(sync.pauses) * 1e3:>9.1f}"
            )


def messages_table(args: argparse.Namespace, a: Any, b: Any, size: int, bucket: int) -> None:
    print(f"\ncontrol messages per sync, {size // MiB} MiB total, bucket {args.bucket_mb} MiB")
    print(f"{'transport':>12} {'tensors':>8} {'messages':>9} {'GB/s':>6}")
    for transport in ("shm", "collective", "objectstore"):
        for n_tensors in (int(c) for c in args.tensor_counts.split(",")):
            sync = Sync(a, b, transport, even_specs(size, n_tensors), bucket=bucket)
            (t,) = best([sync.one], args.repeats)
            sync.close()
            print(f"{transport:>12} {n_tensors:>8} {sync.messages:>9} {gb(size, t):>6.2f}")


def pieces_table(args: argparse.Namespace, a: Any, b: Any, size: int) -> None:
    print(f"\nraw gloo, {size // MiB} MiB in broadcasts of N MiB, against one broadcast of the whole")
    print(f"{'N MiB':>6} {'GB/s':>6} {'whole GB/s':>10} {'ratio':>6}")
    whole, close = gloo_bound(a, b, size)
    for piece in (int(p) for p in args.gloo_pieces.split(",")):

        def pieces(piece: int = piece) -> None:
            ray.get([a.bcast.remote(piece * MiB), b.bcast.remote(piece * MiB)])

        t_whole, t = best([whole, pieces], args.repeats)
        print(f"{piece:>6} {gb(size, t):>6.2f} {gb(size, t_whole):>10.2f} {t_whole / t:>6.2f}")
    close()


if __name__ == "__main__":
    main()
