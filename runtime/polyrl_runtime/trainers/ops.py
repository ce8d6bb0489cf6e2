"""DeepSpeed's JIT-compiled CPU ops, built once per machine without ever waiting on a dead build.

`deepspeed.init_distributed` on CPU compiles (first run, ~80 s on 2 cores) or loads its shared-memory
comm op through torch's `cpp_extension`, whose build lock is a plain file (`<ext>/lock`, created with
O_EXCL, removed when the build ends). A build that is killed — Ctrl-C on a first `polyrl run`, a pod
evicted while compiling, a test timeout — leaves that file behind, and every later process waits for
it forever (seen on this project's machines: trainers stuck in `setup` until the job was killed).

`prepare_ops()` builds or loads the op under our own lock, an `flock` the kernel releases when its
holder dies. Holding it proves no build of ours is running, so a leftover torch lock file is stale
and is removed (logged). Only then does `init_distributed` run, and it finds the op built.

A pod's build directory is its scratch volume, empty at every start. An image that compiled the op
once (`runtime/Dockerfile`) names that build in `POLYRL_PREBUILT_OPS_DIR`; `prepare_ops()` copies it
into the empty build directory first, so torch finds the op up to date and loads it instead of
compiling it again on each pod start. torch needs the build directory writable (its lock file), so
the image's copy is read, never used in place.

The build runs with this interpreter's own `ninja` (the `ninja` package DeepSpeed depends on) first
on PATH. Two ninja versions keep build logs in different formats, and each discards the other's: with
whichever `ninja` a process's PATH happened to find, the op was compiled again each time a process
with the other one came along (a pod's PATH starts with the venv's, a shell's may not).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import structlog

from polyrl_runtime.trainers.deepspeed_import import import_deepspeed
from polyrl_runtime.waiting import lock_deadline_s, locked

log = structlog.get_logger(__name__)

LOCK_NAME = ".polyrl-build.lock"
PREBUILT_ENV = "POLYRL_PREBUILT_OPS_DIR"


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


def seed_from_prebuilt(root: Path, prebuilt: Path | None) -> list[Path]:
    """Copy each op build of `prebuilt` that `root` lacks into `root` (times kept, so the build
    tools see it up to date); returns what it copied. Call it holding `build_lock(root)`."""
    if prebuilt is None or not prebuilt.is_dir() or prebuilt.resolve() == root.resolve():
        return []
    copied = []
    for build in sorted(p for p in prebuilt.iterdir() if p.is_dir()):
        target = root / build.name
        if not target.exists():
            shutil.copytree(build, target, ignore=shutil.ignore_patterns("lock"))
            copied.append(target)
    return copied


def prebuilt_dir() -> Path | None:
    env = os.environ.get(PREBUILT_ENV)
    return Path(env) if env else None


@contextlib.contextmanager
def own_tools_first() -> Iterator[str]:
    """PATH with this interpreter's bin directory first, for as long as the block runs; yields it."""
    before = os.environ.get("PATH")
    own = str(Path(sys.executable).parent)
    os.environ["PATH"] = os.pathsep.join(
        [own, *(p for p in (before or "").split(os.pathsep) if p and p != own)]
    )
    try:
        yield os.environ["PATH"]
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def prepare_ops() -> None:
    """Build or load DeepSpeed's CPU comm op under `build_lock` (no-op where DeepSpeed has none),
    starting from the image's prebuilt copy when there is one."""
    import_deepspeed()
    root = extensions_dir()
    with build_lock(root):
        for copied in seed_from_prebuilt(root, prebuilt_dir()):
            log.info("ops.prebuilt_copied", path=str(copied))
        from deepspeed.comm.torch import build_shm_op

        with own_tools_first():
            build_shm_op()
