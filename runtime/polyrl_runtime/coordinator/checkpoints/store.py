"""Checkpoint directories: `<root>/step-000040/` holds each policy's trainer state (DeepSpeed:
weights and optimizer, every rank) under `trainers/<policy>/`, the experience buffer snapshot
(`buffer.pkl`: unconsumed samples and counters) and `state.json` (steps, versions, run counters).
A policy's restart point, `<root>/policy-<name>-step-000043/`, holds its trainer state alone and a
`state.json` with its entry: what a restart of that policy's trainer alone loads when it is newer
than the policy's entry in the latest checkpoint (checkpointer.py `maybe_restart_point`).

`state.json` is written last: a checkpoint without it is incomplete and ignored, so a crash while
checkpointing leaves the previous checkpoint as the latest. The root is a local directory (file://,
a mounted pvc://, or the run's output) or an object-store URI (s3://):

- local: the checkpoint is written as `step-N.tmp` and renamed once `state.json` is in it;
- object store: every writer stages its part locally and uploads it (`storage.staged_dir`: the
  trainer ranks their DeepSpeed files, the coordinator `buffer.pkl`), and the coordinator uploads
  `state.json` only after every part is uploaded. Pruning deletes a checkpoint's `state.json` first,
  so a half-deleted checkpoint is incomplete, never a corrupt "latest". Restoring reads `state.json`
  and `buffer.pkl` from the store and each trainer rank downloads its policy's directory
  (`storage.fetched_dir`).
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from polyrl_runtime import storage
from polyrl_runtime.experience.buffer import BufferSnapshot

log = structlog.get_logger(__name__)

STATE = "state.json"
BUFFER = "buffer.pkl"
TRAINER_TAG = "ckpt"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
# A policy's restart point: its trainer state alone, between the job's checkpoints (`begin(policy=)`).
_POLICY_DIR = re.compile(r"^policy-([a-z0-9-]+)-step-(\d{6,})$")


@dataclass(frozen=True)
class CheckpointRef:
    location: str  # a local directory or an object-store URI
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def path(self) -> Path:
        """The checkpoint's directory, for a local root."""
        if storage.is_object_store(self.location):
            raise ValueError(f"{self.location}: an object-store checkpoint has no local path")
        return Path(self.location)

    def trainer_dir(self, policy: str) -> str:
        """Where the policy's trainer state is: what the trainer ranks `load` from. A policy whose
        trainer was gone when this checkpoint was cut (frozen) has it in the checkpoint its entry
        names (`trainer_at`), a sibling of this one that pruning keeps."""
        at = self.state["policies"].get(policy, {}).get("trainer_at")
        home = storage.join(self.location.rstrip("/").rsplit("/", 1)[0], at) if at else self.location
        return storage.join(home, "trainers", policy)

    @property
    def policy(self) -> str:
        """The policy of a restart point (its state holds that policy alone)."""
        (name,) = self.state["policies"]
        return str(name)

    @property
    def name(self) -> str:
        """The checkpoint's directory name (`step-000040`)."""
        return self.location.rstrip("/").rsplit("/", 1)[-1]

    def holds_trainers_of(self) -> set[str]:
        """The names of the other checkpoints whose trainer states this one uses."""
        return {str(e["trainer_at"]) for e in self.state["policies"].values() if e.get("trainer_at")}

    def buffer(self) -> BufferSnapshot:
        snap: BufferSnapshot = pickle.loads(storage.read_bytes(storage.join(self.location, BUFFER)))
        return snap


class CheckpointStore:
    def __init__(self, root: Path | str, keep: int) -> None:
        self.remote = storage.is_object_store(root)
        self.root: str = str(root).rstrip("/") if self.remote else str(Path(root))
        self.keep = keep
        # Locations begun and not yet committed or abandoned: a prune (another policy's restart
        # point committing meanwhile) must not take them for leftovers.
        self._writing: set[str] = set()

    def __repr__(self) -> str:
        return f"CheckpointStore({self.root!r}, keep={self.keep})"

    def begin(self, step: int, policy: str | None = None) -> str:
        """A new checkpoint's location: writers put their parts there, then `commit` completes it.
        With `policy`: that policy's restart point (`policy-<name>-step-N`), its trainer state alone."""
        name = f"step-{step:06d}" if policy is None else f"policy-{policy}-step-{step:06d}"
        if self.remote:
            # An object store has no rename: the checkpoint is written in place, complete once its
            # state.json exists. Leftovers of an earlier attempt at this step go first, state first.
            final = storage.join(self.root, name)
            self._remove(final)
            self._writing.add(final)
            return final
        tmp = Path(self.root) / f"{name}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "trainers").mkdir(parents=True)
        self._writing.add(str(tmp))
        return str(tmp)

    def abandon(self, location: str) -> None:
        """A checkpoint begun at `location` will not be committed: the next prune removes it."""
        self._writing.discard(location)

    def commit(self, location: str, state: dict[str, Any], buffer: BufferSnapshot | None) -> CheckpointRef:
        """Complete the checkpoint at `location` (every trainer part is written): the buffer (none
        for a restart point), then `state.json`, then prune the old ones."""
        if buffer is not None:
            payload = pickle.dumps(buffer, protocol=pickle.HIGHEST_PROTOCOL)
            storage.write_bytes(storage.join(location, BUFFER), payload)
        text = json.dumps(state, indent=1, sort_keys=True).encode()
        if self.remote:
            storage.write_bytes(storage.join(location, STATE), text)
            final = location
        else:
            tmp = Path(location)
            (tmp / STATE).write_bytes(text)
            target = tmp.with_suffix("")
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
            final = str(target)
        self._writing.discard(location)
        self.prune()
        return CheckpointRef(final, state)

    def _complete(self, pattern: re.Pattern[str]) -> list[CheckpointRef]:
        refs = []
        for name in storage.list_names(self.root):
            if pattern.match(name) is None:
                continue
            location = storage.join(self.root, name)
            state = self._state(location)
            if state is not None:
                refs.append(CheckpointRef(location, state))
        return sorted(refs, key=lambda r: r.step)

    def all(self) -> list[CheckpointRef]:
        """The complete checkpoints of the job, oldest first."""
        return self._complete(_STEP_DIR)

    def latest(self) -> CheckpointRef | None:
        refs = self.all()
        return refs[-1] if refs else None

    def restart_points(self) -> list[CheckpointRef]:
        """The complete restart points of every policy, oldest first."""
        return self._complete(_POLICY_DIR)

    def drop_restart_points(self) -> None:
        """Remove the restart points of earlier attempts, but those a checkpoint names as a policy's
        trainer state: a job (re)starting resumes from its checkpoints, and its policies' restart
        points begin again from there."""
        used = {name for r in self.all() for name in r.holds_trainers_of()}
        for p in self.restart_points():
            if p.name not in used:
                self._remove(p.location)

    def prune(self) -> None:
        """Keep the newest `keep` checkpoints, and of each policy its newest restart point when it
        is newer than the policy's entry in the latest checkpoint; remove older ones and incomplete
        ones. What a kept checkpoint names as a policy's trainer state (`trainer_at`) stays."""
        refs = self.all()
        kept_refs = refs[max(0, len(refs) - self.keep) :]
        used = {name for r in kept_refs for name in r.holds_trainers_of()}
        for r in refs[: max(0, len(refs) - self.keep)]:
            if r.name not in used:  # a frozen policy's trainer state stays while a kept one uses it
                self._remove(r.location)
        points = self.restart_points()
        entries = refs[-1].state["policies"] if refs else {}
        newest = {p.policy: p for p in points}  # sorted by step: the last one of each policy wins
        for p in points:
            current = newest[p.policy] is p and p.step > int(entries.get(p.policy, {}).get("step", -1))
            if not current and p.name not in used:
                self._remove(p.location)
        kept = {r.location for r in refs} | {p.location for p in points} | set(self._writing)
        for name in storage.list_names(self.root):
            location = storage.join(self.root, name)
            if location in kept:
                continue
            ours = _STEP_DIR.match(name) or _POLICY_DIR.match(name)
            if self.remote and ours:
                self._remove(location)  # an attempt that never got its state.json
            elif not self.remote and name.endswith(".tmp") and name.startswith(("step-", "policy-")):
                shutil.rmtree(location, ignore_errors=True)

    def _state(self, location: str) -> dict[str, Any] | None:
        if not self.remote:
            state = Path(location) / STATE
            return json.loads(state.read_text()) if state.is_file() else None
        try:
            loaded: dict[str, Any] = json.loads(storage.read_bytes(storage.join(location, STATE)))
        except storage.NotFoundError:
            return None  # incomplete
        return loaded

    def _remove(self, location: str) -> None:
        if self.remote:  # state.json first: from here on the checkpoint is incomplete
            storage.remove_file(storage.join(location, STATE))
        storage.remove_tree(location)
        log.debug("checkpoint.removed", location=location)


def checkpoint_root(uri: str | None, out_dir: Path) -> Path | str:
    """Where checkpoints go: the job's `checkpoint.uri` (a local path for file:// and a mounted
    pvc://, the URI itself for s3://) or `<out>/checkpoints`."""
    if uri is None:
        return out_dir / "checkpoints"
    if storage.is_object_store(uri):
        return uri.rstrip("/")
    if uri.startswith(storage.LOCAL_SCHEMES):
        return storage.local_path(uri)
    raise ValueError(f"checkpoint.uri {uri}: use file://, pvc:// or s3://")
