"""DeepSpeed, imported without mlflow, and its engines built without Muon.

`import deepspeed` imports mlflow, when it is installed, for its autotuner's result logging
(`deepspeed.autotuning.autotuner`): about 1.1 s of CPU in every trainer process as it starts
(DeepSpeed 0.19, mlflow 3, on 2 cores), where the whole `polyrl run` example has about 20 s to reach
its first step. polyrl never autotunes, and its metrics sinks (mlflow among them) run in the driver.

DeepSpeed wraps that import in `try`/`except`. A `None` entry in `sys.modules` makes an import
raise ImportError, so DeepSpeed takes its own path for a package that is not installed. The entry
exists only while DeepSpeed imports: the rest of the process imports mlflow as usual, and a module
already imported is left as it is.

`deepspeed.initialize` imports DeepSpeed's Muon optimizer, when ZeRO is on, only to add its class
to the optimizers ZeRO accepts (`deepspeed.runtime.zero.utils.is_zero_supported_optimizer`, also
under `try`/`except ImportError`). That module decorates its kernels with `torch.compile`, which
imports TorchInductor: about 2 s of CPU in every trainer rank as it builds its engine. polyrl's
optimizer is torch AdamW, so `initialize` builds engines with that module marked as not
importable, in the same way.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

SKIPPED_ON_IMPORT = ("mlflow",)
SKIPPED_ON_INITIALIZE = ("deepspeed.runtime.zero.muon.muon_optimizer",)


@contextlib.contextmanager
def skipped_imports(names: tuple[str, ...]) -> Iterator[None]:
    """While inside, importing any of `names` that is not imported yet raises ImportError."""
    added = [n for n in names if n not in sys.modules]
    for n in added:
        sys.modules[n] = None  # type: ignore[assignment]  # the import system's "not importable" mark
    try:
        yield
    finally:
        for n in added:
            if n in sys.modules and sys.modules[n] is None:
                del sys.modules[n]


def import_deepspeed() -> Any:
    """The `deepspeed` module (imported once per process, without mlflow)."""
    with skipped_imports(SKIPPED_ON_IMPORT):
        import deepspeed
    return deepspeed


def initialize(**kwargs: Any) -> tuple[Any, ...]:
    """`deepspeed.initialize(**kwargs)`, without importing the Muon optimizer (see above)."""
    deepspeed = import_deepspeed()
    with skipped_imports(SKIPPED_ON_INITIALIZE):
        return tuple(deepspeed.initialize(**kwargs))
