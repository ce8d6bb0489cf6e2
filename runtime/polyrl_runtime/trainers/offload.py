"""A trainer rank's state off its device between the phases of a shared device pool, and back.

`offload_rank` parks (`polyrl_runtime.device_memory`) every storage on the rank's device that holds
its state: the model's parameters and buffers, gradients, ZeRO-3's parameter shards (`ds_tensor`),
the reference model's weights, the optimizer's state (`exp_avg`, `exp_avg_sq`, `step`), and the
tensors the DeepSpeed optimizer wrapper of any ZeRO stage keeps (its flat bit16 and fp32 groups,
gradient partitions and buckets), found by walking the wrapper's attributes. Storages are moved
whole, so every view into a flat buffer still views it after `restore_rank`: a round trip changes no
bit, and the next step computes what it would have without one.

Nothing here imports DeepSpeed: the walk reaches its objects through their attributes, so a plain
torch model and optimizer go through the same code (the GPU tier runs it without DeepSpeed).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from polyrl_runtime.device_memory import HostBuffers, ParkedMemory, park, unique_storages

# How deep the walk follows containers inside an optimizer object (DeepSpeed nests at most
# dict -> list -> list of tensors).
_DEPTH = 4


class TrainerOffloadedError(RuntimeError):
    """A call needed the rank's tensors while they are in host memory (`offload`): `restore` first."""

    def __init__(self, rank: str, what: str) -> None:
        super().__init__(
            f"trainer rank {rank}: its state is offloaded to host memory; restore() it before {what}"
        )
        self.rank, self.what = rank, what

    def __reduce__(self) -> tuple[type[TrainerOffloadedError], tuple[str, str]]:
        return TrainerOffloadedError, (self.rank, self.what)  # through Ray


def module_tensors(module: Any) -> Iterator[torch.Tensor]:
    """Parameters (with their gradients and ZeRO-3 shards) and buffers of a module, or of the module
    a DeepSpeed engine wraps."""
    module = getattr(module, "module", module)
    if not isinstance(module, torch.nn.Module):
        return
    for p in module.parameters():
        yield p.data
        for extra in (p.grad, getattr(p, "ds_tensor", None)):
            if isinstance(extra, torch.Tensor):
                yield extra
    yield from module.buffers()


def object_tensors(obj: object, depth: int = _DEPTH, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """Every tensor an optimizer (a torch optimizer or a DeepSpeed wrapper around one) holds in its
    attributes, its state and the containers in them, `depth` levels down. Objects other than
    containers and optimizers are not entered: the walk stays inside the optimizer."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    children: Iterable[object]
    if isinstance(obj, dict):
        children = [*obj.keys(), *obj.values()]
    elif isinstance(obj, list | tuple | set):
        children = obj
    elif _is_optimizer(obj):
        children = list(vars(obj).values())
    else:
        return
    for child in children:
        yield from object_tensors(child, depth if _is_optimizer(obj) else depth - 1, seen)


def _is_optimizer(obj: object) -> bool:
    """A torch optimizer or DeepSpeed's wrapper of one (`ZeROOptimizer`, the bf16 optimizer), known
    by their interface: param groups and a step."""
    return isinstance(obj, torch.optim.Optimizer) or (
        hasattr(obj, "param_groups") and callable(getattr(obj, "step", None)) and hasattr(obj, "optimizer")
    )


def rank_storages(
    engine: Any, ref: Any, device: torch.device, critic: Any = None
) -> list[torch.UntypedStorage]:
    """The storages on `device` holding a rank's state: its engine's model and optimizer, the
    reference model (a module or an optimizer-less engine), if any, and the critic's engine (its
    value model and optimizer: trainers/critic.py), if any."""
    tensors: list[torch.Tensor] = [*module_tensors(engine), *module_tensors(ref), *module_tensors(critic)]
    for trained in (engine, critic):
        optimizer = getattr(trained, "optimizer", None)
        if optimizer is not None:
            tensors.extend(object_tensors(optimizer))
    return unique_storages(tensors, device)


def own_module_memory(module: Any) -> int:
    """Give the module's parameters and buffers whose memory torch cannot release (a CPU model loaded
    from safetensors keeps the mapped file as their storage) a storage of their own, with the same
    bytes; tensors that shared one storage share its copy. Parameter objects stay (the optimizer's
    state is keyed on them). Returns the bytes copied."""
    module = getattr(module, "module", module)
    if not isinstance(module, torch.nn.Module):
        return 0
    copies: dict[int, torch.UntypedStorage] = {}
    slots: list[tuple[dict[str, Any], str]] = [
        (m._parameters, n) for m in module.modules() for n in m._parameters
    ] + [(m._buffers, n) for m in module.modules() for n in m._buffers]
    for table, name in slots:
        t = table[name]
        storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
        if storage is None or storage.resizable() or storage.nbytes() == 0:
            continue
        key = storage.data_ptr()
        if key not in copies:
            whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            copies[key] = whole.clone().untyped_storage()
        owned = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            copies[key], t.storage_offset(), t.size(), t.stride()
        )
        if isinstance(t, torch.nn.Parameter):
            t.data = owned
        else:
            table[name] = owned
    return sum(s.nbytes() for s in copies.values())


def offload_rank(
    engine: Any, ref: Any, device: torch.device, buffers: HostBuffers | None = None, critic: Any = None
) -> ParkedMemory:
    """Copy the rank's state on `device` to host memory (`buffers`' when given: a rank that offloads
    every turn reuses them) and release it there (`restore_rank` brings it back). `critic`: the
    critic's engine, if any."""
    for module in (engine, ref, critic):
        own_module_memory(module)
    return park(keep=rank_storages(engine, ref, device, critic), buffers=buffers)


def restore_rank(parked: ParkedMemory, rank: str) -> float:
    """Give the rank's state back to its device, exactly; the seconds it took (`RestoreError`, naming
    the rank and the bytes, when the device has no room)."""
    return parked.restore(f"trainer rank {rank}")
