"""The files on the host that a `cudaipc` sender shares with its engines.

`ServeGuard`: which version the sender's tensors still hold. A file of 8 bytes (little-endian int64:
the version, `NOT_SERVED` for none) under a `flock`: engines hold it shared while they read the
sender's tensors, the sender exclusive while it rewrites the word. So a sender never tells engines a
version is gone while one of them is still copying it, and an engine never starts on a version the
sender's tensors no longer hold.

`CounterSink`: where engines return torch's per-mapping count (see weights/cudaipc.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import tempfile
import time
import uuid
from pathlib import Path

NOT_SERVED = -1
POLL_S = 1e-3


def guard_dir() -> str:
    """Where guards live: /dev/shm, which torch's CUDA IPC reference counters need anyway."""
    d = "/dev/shm"
    return d if os.path.isdir(d) and os.access(d, os.W_OK) else tempfile.gettempdir()


class ServeGuard:
    """One sender's guard: it creates the file, engines open it by path (read-only). flock is per
    open file, so a sender and an engine in one process exclude each other too."""

    def __init__(self, path: str, *, create: bool) -> None:
        # Engines only read the word and lock the file (flock needs no write access).
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL if create else os.O_RDONLY
        self.path = path
        self._fd = os.open(path, flags, 0o644)
        if create:
            self.set_served(NOT_SERVED)

    @classmethod
    def create(cls, directory: str, policy: str) -> ServeGuard:
        return cls(os.path.join(directory, _file_name(policy, ".guard")), create=True)

    def served(self) -> int:
        value: int = struct.unpack("<q", os.pread(self._fd, 8, 0))[0]
        return value

    def set_served(self, version: int) -> None:
        os.pwrite(self._fd, struct.pack("<q", version), 0)

    def acquire(self, *, exclusive: bool, timeout_s: float) -> bool:
        """Take the lock; False when it was not free within `timeout_s`."""
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(self._fd, mode)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(POLL_S)

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # also drops any lock held through it
            self._fd = -1

    def destroy(self) -> None:
        """Close and remove the file (engines holding it open still read the cleared word)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.close()


def _file_name(policy: str, suffix: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in policy)
    return f"polyrl-cudaipc-{safe}-{os.getpid()}-{uuid.uuid4().hex[:8]}{suffix}"


class CounterSink:
    """A shared-memory file laid out as torch's CUDA IPC reference counters (`RefcountedMapAllocator`:
    a header whose first int counts the processes mapping the file, then int64 counters from byte 64)
    that nobody reads. An engine freeing a mapping decrements the counter its handle names; pointed
    here, that leaves torch's own count of each shared storage to the sender alone. The header count
    starts at 1, so an engine unmapping the file never removes it (were it removed anyway, engines'
    decrements would fail, which torch ignores)."""

    HEADER = 64
    COUNTERS = 10_000  # what torch maps of such a file (CUDA_IPC_REF_COUNTER_FILE_SIZE)

    def __init__(self, policy: str) -> None:
        self.path = Path("/dev/shm") / _file_name(policy, ".counts")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.HEADER + 8 * self.COUNTERS)
            os.pwrite(fd, struct.pack("<i", 1), 0)
        finally:
            os.close(fd)

    @property
    def shm_name(self) -> bytes:
        """The name torch opens it by (`shm_open`)."""
        return f"/{self.path.name}".encode()

    def destroy(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
