"""DeepSpeed's JIT-compiled CPU ops, built once per machine without ever waiting on a dead build.

`deepspeed.init_distributed` on CPU compiles (first run, ~80 s on 2 cores) or loads its shared-memory
comm op through torch's `cpp_extension`, whose build lock is a plain file (`<ext>/lock`, created with
O_EXCL, removed when the build ends). A build that is killed — Ctrl-C on a first `polyrl run`, a pod
evicted while compiling, a test timeout — leaves that file behind, and every later process waits for
it forever (seen on this project's machines: trainers stuck in `setup` until the job was killed).

`prepare_ops()` builds or loads the op under our own lock, an `flock` the kernel releases when its
holder dies. Holding it proves no build of ours is running, so a leftover torch lock file is stale
and is removed (logged). Only then does `init_distributed` run, and it finds the op built.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import structlog

from polyrl_runtime.trainers.deepspeed_import import import_deepspeed
from polyrl_runtime.waiting import lock_deadline_s, locked

log = structlog.get_logger(__name__)

LOCK_NAME = ".polyrl-build.lock"


def extensions_dir() -> Path:
    """Where torch builds JIT extensions: $TORCH_EXTENSIONS_DIR, else torch's own default."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


@contextlib.contextmanager
def build_lock(root: Path) -> Iterator[list[Path]]:
    """Hold the machine-wide build lock of `root`; yields the stale torch lock files it removed."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    # waits (and says so) for a live build; a dead holder's lock is gone
    with open(path, "a+b") as f, locked(f, path, what="DeepSpeed op build", deadline_s=lock_deadline_s()):
        removed = []
        for stale in sorted(root.glob("*/lock")):
            log.warning("ops.stale_build_lock_removed", path=str(stale))
            stale.unlink(missing_ok=True)
            removed.append(stale)
        yield removed


def prepare_ops() -> None:
    """Build or load DeepSpeed's CPU comm op under `build_lock` (no-op where DeepSpeed has none)."""
    import_deepspeed()
    with build_lock(extensions_dir()):
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()
