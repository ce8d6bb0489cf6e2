"""`--cpus ROLE=CPUS`: parsing with errors that name the item, and pinning every thread of a process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from polyrl_runtime.cpusets import ENV, CpuSetError, format_cpus, parse_cpu_sets, parse_cpus, role_env

AVAILABLE = frozenset({0, 1, 2, 3})


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0,2-3", {0, 2, 3}), (" 1 , 3 ", {1, 3}), ("2-2", {2})],
)
def test_cpu_lists_parse_and_format_back(text: str, cpus: set[int]) -> None:
    assert parse_cpus(text) == cpus
    assert parse_cpus(format_cpus(cpus)) == cpus


def test_format_uses_ranges() -> None:
    assert format_cpus({5, 0, 1, 2}) == "0-2,5"
    assert format_cpus(set()) == ""


def test_roles_map_to_cpu_sets() -> None:
    sets = parse_cpu_sets(["rollout=0-1", "workflow=0", "trainer=2,3"], AVAILABLE)
    assert sets == {"rollout": {0, 1}, "workflow": {0}, "trainer": {2, 3}}
    assert role_env(sets, "trainer") == {ENV: "2-3"}
    assert role_env(sets, "nothing") == {}
    assert parse_cpu_sets([], AVAILABLE) == {}


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("trainer", "--cpus trainer: expected ROLE=CPUS"),
        ("gpu=0", "--cpus gpu=0: unknown role 'gpu' (roles: rollout, workflow, trainer; pool:NAME for"),
        ("trainer=9", "--cpus trainer=9: CPU 9 is not available to this process (available: 0-3)"),
        ("trainer=2-9", "CPU 4-9 is not available"),
        ("trainer=", "--cpus trainer=: '' is not a CPU number or range"),
        ("trainer=a", "'a' is not a CPU number or range"),
        ("trainer=3-1", "range '3-1' ends before it starts"),
        ("trainer=-1", "'-1' is not a CPU number"),
    ],
)
def test_bad_items_are_named_in_the_error(item: str, message: str) -> None:
    with pytest.raises(CpuSetError) as err:
        parse_cpu_sets([item], AVAILABLE)
    assert message in str(err.value)


def test_a_role_given_twice_is_an_error() -> None:
    with pytest.raises(CpuSetError, match="role 'rollout' is given twice"):
        parse_cpu_sets(["rollout=0", "rollout=1"], AVAILABLE)


def test_the_default_available_set_is_this_process_affinity() -> None:
    mine = min(os.sched_getaffinity(0))
    assert parse_cpu_sets([f"trainer={mine}"]) == {"trainer": {mine}}
    with pytest.raises(CpuSetError, match="not available"):
        parse_cpu_sets([f"trainer={max(os.sched_getaffinity(0)) + 1}"])


# Threads that exist before pinning, and one started afterwards by a thread that existed before: all of
# them must end up on the pinned CPU.
_PROBE = """
import os, threading
from polyrl_runtime.cpusets import pin_from_env
go, done = threading.Event(), threading.Event()
late = []
def early():
    go.wait()
    t = threading.Thread(target=done.wait)
    t.start()
    late.append(t)
threads = [threading.Thread(target=early) for _ in range(3)]
for t in threads:
    t.start()
print(sorted(pin_from_env()))
go.set()
for t in threads:
    t.join()
masks = set()
for tid in os.listdir("/proc/self/task"):
    masks.add(frozenset(os.sched_getaffinity(int(tid))))
print(len(os.listdir("/proc/self/task")), sorted(sorted(m) for m in masks))
done.set()
"""


def test_pinning_covers_every_thread_of_the_process() -> None:
    cpu = max(os.sched_getaffinity(0))
    r = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**os.environ, ENV: str(cpu)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    pinned, masks = r.stdout.splitlines()[-2:]  # after the "cpus.pinned" log line
    assert pinned == f"[{cpu}]"
    n_threads, _, rest = masks.partition(" ")
    # main and the three late threads; an early thread can linger in /proc for a moment after join()
    assert int(n_threads) >= 4
    assert rest == f"[[{cpu}]]"


def test_no_env_pins_nothing_and_a_bad_env_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from polyrl_runtime.cpusets import pin_from_env

    monkeypatch.delenv(ENV, raising=False)
    before = os.sched_getaffinity(0)
    assert pin_from_env() is None
    assert os.sched_getaffinity(0) == before
    monkeypatch.setenv(ENV, "zero")
    with pytest.raises(CpuSetError, match=f"{ENV}='zero': 'zero' is not a CPU number"):
        pin_from_env()
