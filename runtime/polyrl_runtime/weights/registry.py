"""Transports by name (the `spec.weightSync.transport` enum) and the `auto` choice.

Extension point: `register_transport(name, sender_factory, receiver_factory)` adds a transport (for
example a later `delta` one) without touching the callers, which only ever name it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

from polyrl_operator.api import RLJobSpec
from polyrl_operator.api.weight_sync import TransportName
from polyrl_runtime.weights.api import WeightReceiver, WeightSender

SenderFactory = Callable[..., WeightSender]
ReceiverFactory = Callable[..., WeightReceiver]

# The values of the RLJob API's `spec.weightSync.transport`.
TRANSPORTS: tuple[str, ...] = get_args(TransportName)

# Works wherever Ray runs (any host, CPU or GPU): what an engine built without naming a transport
# receives through.
DEFAULT_TRANSPORT = "objectstore"


@dataclass(frozen=True)
class Transport:
    name: str
    sender: SenderFactory
    receiver: ReceiverFactory
    # The sender opens a process group of fixed size for each sync, so it is told how many receivers
    # join (`num_receivers`); a store-based sender serves any number of receivers.
    sized_group: bool = False
    # The sender keeps a copy of the latest version of its own (a store, a segment), which an engine
    # that joins later loads; False: it serves the trainer's tensors only until they change, and a
    # late joiner waits for the next publish.
    keeps_latest: bool = True
    # The sender can publish deltas beside each version (`deltas=` keyword, weights/delta_chain.py).
    deltas: bool = False
    # The sender writes versions under a URI (`uri=` and `full_every=` keywords, weights/storage.py).
    at_uri: bool = False


_REGISTRY: dict[str, Transport] = {}


def register_transport(
    name: str,
    sender: SenderFactory,
    receiver: ReceiverFactory,
    *,
    sized_group: bool = False,
    keeps_latest: bool = True,
    deltas: bool = False,
    at_uri: bool = False,
) -> None:
    if name == "auto":
        raise ValueError("'auto' is a choice among transports, not a transport")
    _REGISTRY[name] = Transport(name, sender, receiver, sized_group, keeps_latest, deltas, at_uri)


def get_transport(name: str) -> Transport:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown weight-sync transport {name!r}; known: {sorted(_REGISTRY)}") from None


def registered() -> list[str]:
    return sorted(_REGISTRY)


def choose_transport(
    requested: str,
    *,
    cuda: bool,
    same_host: bool,
    ray_available: bool = True,
    colocated: bool = False,
    across_pods: bool = False,
) -> str:
    """Resolve `auto` to the best transport for where the trainer and its engines are.

    GPU weights of a colocated policy (`colocated`: its rollout and trainer on one device pool, so its
    engines run on the trainer's GPU host) are copied device to device from the trainer's memory
    (`cudaipc`: no network, and NCCL refuses two ranks on one GPU). A policy that shares the GPUs of
    a pool of several pods (`across_pods`: trainer rank 0 beside pod 0's engine, the other engines on
    other hosts) has neither: NCCL would put two ranks on one GPU and cudaipc reaches one host, so
    its weights go through host memory (`objectstore`). Other GPU weights go through NCCL
    (`collective`): anything else copies them through host memory. On CPU, engines on the trainer's
    host serve from one shared segment (`shm`, the cheapest: one host copy); across hosts Ray's object
    store works everywhere; without Ray, gloo (`collective`) does.
    """
    if requested != "auto":
        get_transport(requested)
        return requested
    if cuda and colocated:
        return "cudaipc"
    if cuda and across_pods:
        return "objectstore"
    if cuda:
        return "collective"
    if same_host:
        return "shm"
    return "objectstore" if ray_available else "collective"


def choose_transports(spec: RLJobSpec, *, same_host: bool) -> dict[str, str]:
    """Each policy's transport: `spec.weightSync.transport`, its `auto` resolved per policy
    (`choose_transport`; a policy whose engines and trainer share one pod has them on one host, as
    every policy has under `polyrl run` (`same_host`), and on GPUs its engines read the trainer's
    device memory). An engine of adapters (a shared base's, a LoRA league's) receives through a
    transport that serves several trainers, never collective or cudaipc (which tie an engine to one
    trainer; validation refuses them when asked for by name): the trained members of a shared base
    agree on one, and its frozen members, which receive nothing, are given it."""
    out = {
        p.name: choose_transport(
            spec.weight_sync.transport,
            cuda=spec.trainer_placement(p).gpus > 0,
            same_host=same_host or spec.on_one_pod(p),
            colocated=spec.on_one_pod(p),
            across_pods=spec.shares_gpus_across_pods(p),
        )
        for p in spec.policies
    }
    one_trainer = ("collective", "cudaipc")
    for base in spec.shared_bases():
        chosen = {out[m] for m in base.trained}
        agreed = next(iter(chosen)) if len(chosen) == 1 else DEFAULT_TRANSPORT
        out.update(dict.fromkeys(base.policies, DEFAULT_TRANSPORT if agreed in one_trainer else agreed))
    for p in spec.policies:  # a full-weight league's engine snapshots what it serves: any transport
        if p.league is not None and p.algorithm.lora is not None and out[p.name] in one_trainer:
            out[p.name] = DEFAULT_TRANSPORT
    return out


def sender_options(
    name: str, *, receivers: int, deltas: int = 0, uri: str | None = None, full_every: int = 8
) -> dict[str, Any]:
    """The `make_sender` keyword arguments that depend on the engines it serves (`receivers` of them)
    and on the job (`deltas`: versions whose deltas each manifest lists, 0 for none; `uri` and
    `full_every`: where and how a transport that writes versions to storage writes them)."""
    transport = get_transport(name)
    options: dict[str, Any] = {"num_receivers": receivers} if transport.sized_group else {}
    if deltas:
        if not transport.deltas:
            raise ValueError(f"weight-sync transport {name!r} does not carry deltas")
        options["deltas"] = deltas
    if transport.at_uri:
        if uri is None:
            raise ValueError(f"weight-sync transport {name!r} writes versions under a uri; none was given")
        options.update(uri=uri, full_every=full_every)
    return options


def make_sender(name: str, policy: str, bucket_bytes: int, **kwargs: Any) -> WeightSender:
    return get_transport(name).sender(policy, bucket_bytes, **kwargs)


def make_receiver(name: str, **kwargs: Any) -> WeightReceiver:
    return get_transport(name).receiver(**kwargs)


def _objectstore_sender(*args: Any, **kwargs: Any) -> WeightSender:
    # Imported when used: the transport needs Ray, the others (and in-process engines) do not.
    from polyrl_runtime.weights.objectstore import ObjectStoreSender

    return ObjectStoreSender(*args, **kwargs)


def _objectstore_receiver(*args: Any, **kwargs: Any) -> WeightReceiver:
    from polyrl_runtime.weights.objectstore import ObjectStoreReceiver

    return ObjectStoreReceiver(*args, **kwargs)


def _register_builtins() -> None:
    from polyrl_runtime.weights.collective import TRANSPORT as COLLECTIVE
    from polyrl_runtime.weights.collective import CollectiveReceiver, CollectiveSender
    from polyrl_runtime.weights.cudaipc import TRANSPORT as CUDAIPC
    from polyrl_runtime.weights.cudaipc import CudaIpcReceiver, CudaIpcSender
    from polyrl_runtime.weights.shm import ShmReceiver, ShmSender
    from polyrl_runtime.weights.storage import TRANSPORT as STORAGE
    from polyrl_runtime.weights.storage import StorageReceiver, StorageSender

    register_transport(DEFAULT_TRANSPORT, _objectstore_sender, _objectstore_receiver, deltas=True)
    register_transport("shm", ShmSender, ShmReceiver)
    register_transport(
        COLLECTIVE, CollectiveSender, CollectiveReceiver, sized_group=True, keeps_latest=False, deltas=True
    )
    register_transport(CUDAIPC, CudaIpcSender, CudaIpcReceiver, keeps_latest=False)
    register_transport(STORAGE, StorageSender, StorageReceiver, at_uri=True)


_register_builtins()
