"""Building DeepSpeed's CPU op: a build killed mid-way must not make later trainers wait forever, an
image's build is reused, and every process builds with the same tools."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from torch.utils.file_baton import FileBaton

from polyrl_runtime.trainers.ops import build_lock, own_tools_first, seed_from_prebuilt

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


def test_an_image_s_prebuilt_op_is_copied_where_missing_and_never_over_a_build(tmp_path: Path) -> None:
    image, scratch = tmp_path / "image", tmp_path / "scratch"
    for name in ("deepspeed_shm_comm", "other_op"):
        (image / name).mkdir(parents=True)
        (image / name / f"{name}.so").write_bytes(b"built")
    (image / "deepspeed_shm_comm" / "lock").write_text("")  # a baton the image build left: not copied
    (scratch / "other_op").mkdir(parents=True)
    (scratch / "other_op" / "other_op.so").write_bytes(b"mine")

    assert seed_from_prebuilt(scratch, image) == [scratch / "deepspeed_shm_comm"]
    assert (scratch / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").read_bytes() == b"built"
    assert not (scratch / "deepspeed_shm_comm" / "lock").exists()
    assert (scratch / "other_op" / "other_op.so").read_bytes() == b"mine"  # a build of its own stays
    assert seed_from_prebuilt(scratch, image) == []  # nothing left to copy
    assert seed_from_prebuilt(scratch, None) == seed_from_prebuilt(scratch, tmp_path / "absent") == []


def test_builds_find_this_interpreter_s_tools_first_and_path_is_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    own = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", f"/usr/bin:{own}:/bin")
    with own_tools_first() as path:
        assert path.split(":") == [own, "/usr/bin", "/bin"]
        assert os.environ["PATH"] == path
    assert os.environ["PATH"] == f"/usr/bin:{own}:/bin"
