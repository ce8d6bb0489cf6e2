"""DeepSpeed, imported without mlflow, its Muon optimizer without compiling it, and without its CPU
shared-memory comm op.

`import deepspeed` imports mlflow, when it is installed, for its autotuner's result logging
(`deepspeed.autotuning.autotuner`): about 1.1 s of CPU in every trainer process as it starts
(DeepSpeed 0.19, mlflow 3, on 2 cores), where the whole `polyrl run` example has about 20 s to reach
its first step. polyrl never autotunes, and its metrics sinks (mlflow among them) run in the driver.

DeepSpeed wraps that import in `try`/`except`, so it is skipped while DeepSpeed imports
(`imports.skipped_imports`); the rest of the process imports mlflow as usual.

DeepSpeed imports its Muon optimizer's module whenever it builds a ZeRO engine or reduces gradients
(`deepspeed.runtime.zero.stage3`, `stage_1_and_2.average_tensor`: only to ask whether the optimizer
is Muon). The module decorates its kernels with `torch.compile`, which imports TorchInductor: about
2 s of CPU in every trainer rank, during its first build or its first step. polyrl's optimizer is
torch AdamW, never Muon: `import_deepspeed` imports that module once with `torch.compile` as the
identity, so its kernels stay plain functions and every later import finds it loaded.

`deepspeed.init_distributed` on CPU JIT-compiles (about 80 s of CPU on 2 cores, in every fresh
environment: a new venv, a pod's empty scratch volume) and loads a shared-memory comm op. Only
`inference_all_reduce`, DeepSpeed's tensor-parallel inference path, calls it; training's collectives
go through torch.distributed (gloo on CPU, NCCL on GPUs) either way. polyrl's trainers never run
DeepSpeed inference, so `import_deepspeed` marks that op incompatible, DeepSpeed's own switch for an
op it cannot build: `init_distributed` then neither compiles nor loads it.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from typing import Any

from polyrl_runtime.imports import skipped_imports

SKIPPED_ON_IMPORT = ("mlflow",)
UNCOMPILED_ON_IMPORT = ("deepspeed.runtime.zero.muon.muon_optimizer",)
NOT_BUILT_OPS = ("deepspeed_shm_comm",)  # op builders' NAMEs


@contextlib.contextmanager
def uncompiled() -> Iterator[None]:
    """While inside, `torch.compile` returns the function it is given (as a decorator too)."""
    import torch

    def identity(model: Any = None, **_: Any) -> Any:
        return model if model is not None else (lambda fn: fn)

    compile_ = torch.compile
    torch.compile = identity
    try:
        yield
    finally:
        torch.compile = compile_


def import_deepspeed() -> Any:
    """The `deepspeed` module (imported once per process, without mlflow, its Muon optimizer
    uncompiled, its ops in `NOT_BUILT_OPS` marked incompatible so that nothing builds them)."""
    with skipped_imports(SKIPPED_ON_IMPORT):
        import deepspeed
    if not all(name in sys.modules for name in UNCOMPILED_ON_IMPORT):
        with uncompiled():
            for name in UNCOMPILED_ON_IMPORT:
                importlib.import_module(name)
    compatible = deepspeed.ops.__compatible_ops__  # probed once per process, then a plain dict
    compatible.update(dict.fromkeys(NOT_BUILT_OPS, False))
    return deepspeed
