"""The DeepSpeed op build lock: a build killed mid-way must not make later trainers wait forever."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from torch.utils.file_baton import FileBaton

from polyrl_runtime.trainers.ops import build_lock

# What torch's cpp_extension does while it compiles: take the baton (a plain file), then work.
HOLD_BATON = """
import sys, time
from torch.utils.file_baton import FileBaton
assert FileBaton(sys.argv[1]).try_acquire()
print("ready", flush=True)
time.sleep(600)
"""

# A live build of ours: our lock, then torch's baton, released when told (a line on stdin).
LIVE_BUILD = """
import sys
from pathlib import Path
from torch.utils.file_baton import FileBaton
from polyrl_runtime.trainers.ops import build_lock
with build_lock(Path(sys.argv[1])):
    baton = FileBaton(sys.argv[2])
    assert baton.try_acquire()
    print("ready", flush=True)
    sys.stdin.readline()
    baton.release()
"""


def _start(code: str, *args: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_a_killed_build_leaves_a_lock_that_build_lock_removes(tmp_path: Path) -> None:
    (tmp_path / "deepspeed_shm_comm").mkdir()
    lock_file = tmp_path / "deepspeed_shm_comm" / "lock"
    child = _start(HOLD_BATON, str(lock_file))
    child.kill()  # killed mid-build: torch's lock file stays behind
    child.wait(30)
    assert lock_file.exists()
    with build_lock(tmp_path) as removed:
        assert removed == [lock_file]
        assert FileBaton(str(lock_file)).try_acquire()  # a build can start at once


def test_a_live_build_is_waited_for_not_broken(tmp_path: Path) -> None:
    (tmp_path / "ext").mkdir()
    baton = tmp_path / "ext" / "lock"
    child = _start(LIVE_BUILD, str(tmp_path), str(baton))
    seen: list[bool] = []

    def finish_build_soon() -> None:
        threading.Event().wait(0.5)
        seen.append(baton.exists())  # still there: nobody broke the live build's lock
        assert child.stdin is not None
        child.stdin.write("done\n")
        child.stdin.flush()

    t = threading.Thread(target=finish_build_soon)
    t.start()
    with build_lock(tmp_path) as removed:  # waits for the build, which removes its own baton
        assert removed == []
    t.join()
    assert child.wait(30) == 0
    assert seen == [True]
