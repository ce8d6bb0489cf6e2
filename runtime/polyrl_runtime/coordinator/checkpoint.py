"""Checkpoint directories: `<root>/step-000040/` holds each policy's trainer state (DeepSpeed:
weights and optimizer, every rank), the experience buffer snapshot (unconsumed samples and counters)
and `state.json` (steps, versions, run counters). `state.json` is written last, then the directory is
renamed from its `.tmp` name: a directory without it is incomplete and ignored, so a crash while
checkpointing leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl_runtime.experience.buffer import BufferSnapshot
from polyrl_runtime.models import local_path

STATE = "state.json"
BUFFER = "buffer.pkl"
TRAINER_TAG = "ckpt"


@dataclass(frozen=True)
class CheckpointRef:
    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def trainer_dir(self, policy: str) -> Path:
        return self.path / "trainers" / policy

    def buffer(self) -> BufferSnapshot:
        with (self.path / BUFFER).open("rb") as f:
            snap: BufferSnapshot = pickle.load(f)
        return snap


class CheckpointStore:
    def __init__(self, root: Path, keep: int) -> None:
        self.root = Path(root)
        self.keep = keep

    def begin(self, step: int) -> Path:
        tmp = self.root / f"step-{step:06d}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "trainers").mkdir(parents=True)
        return tmp

    def commit(self, tmp: Path, state: dict[str, Any], buffer: BufferSnapshot) -> CheckpointRef:
        with (tmp / BUFFER).open("wb") as f:
            pickle.dump(buffer, f, protocol=pickle.HIGHEST_PROTOCOL)
        (tmp / STATE).write_text(json.dumps(state, indent=1, sort_keys=True))
        final = tmp.with_suffix("")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        self.prune()
        return CheckpointRef(final, state)

    def all(self) -> list[CheckpointRef]:
        if not self.root.is_dir():
            return []
        refs = []
        for d in sorted(self.root.glob("step-*")):
            if d.suffix == ".tmp" or not (d / STATE).is_file():
                continue
            refs.append(CheckpointRef(d, json.loads((d / STATE).read_text())))
        return sorted(refs, key=lambda r: r.step)

    def latest(self) -> CheckpointRef | None:
        refs = self.all()
        return refs[-1] if refs else None

    def prune(self) -> None:
        refs = self.all()
        for r in refs[: max(0, len(refs) - self.keep)]:
            shutil.rmtree(r.path, ignore_errors=True)
        for d in self.root.glob("step-*.tmp"):
            shutil.rmtree(d, ignore_errors=True)


def checkpoint_root(uri: str | None, out_dir: Path) -> Path:
    """Where checkpoints go: the job's `checkpoint.uri` (file:// or a mounted pvc://) or `<out>/checkpoints`."""
    if uri is None:
        return out_dir / "checkpoints"
    if uri.startswith(("file://", "pvc://")):
        return local_path(uri)
    raise ValueError(
        f"checkpoint.uri {uri}: object stores are not supported by this runtime yet; use pvc:// or file://"
    )
