"""A function called in a child process of its own: a call that does not return in time is ended
with its process (the caller waits at most the timeout) and the next call gets a new child; errors
come back naming the exception; the `math` reward runs this way, off the main thread too."""

from __future__ import annotations

import math
import os
import threading
import time

import pytest

from polyrl_runtime.rewards.builtins import math_answer
from polyrl_runtime.rewards.isolated import IsolatedCall


def test_a_call_that_does_not_return_in_time_is_ended_and_the_next_one_gets_a_new_child() -> None:
    call = IsolatedCall(time.sleep, 0.5)
    try:
        assert call(0) is None
        first = call._child[0].pid if call._child else None
        with pytest.raises(TimeoutError, match=r"sleep did not return in 0.5 s \(its process was ended\)"):
            call(60)
        assert call._child is None  # killed, not left sleeping
        assert call(0) is None
        assert call._child is not None and call._child[0].pid != first
    finally:
        call.close()


def test_an_error_in_the_child_names_the_exception() -> None:
    call = IsolatedCall(math.sqrt, 5.0)
    try:
        assert call(4.0) == 2.0
        with pytest.raises(RuntimeError, match="ValueError: math domain error"):
            call(-1.0)
        assert call(9.0) == 3.0  # the child survives an exception
    finally:
        call.close()


def test_the_child_never_runs_in_the_callers_process() -> None:
    call = IsolatedCall(os.getpid, 5.0)
    try:
        assert call() != os.getpid()
    finally:
        call.close()


def test_the_math_reward_works_off_the_main_thread() -> None:
    """A Ray async actor's event loop is not the main thread: math-verify's SIGALRM timeouts would
    be off there; in the child they are on, and the caller's wait is bounded either way."""
    out: list[float] = []
    worker = threading.Thread(
        target=lambda: out.append(math_answer("\\boxed{\\frac{1}{2}}", {"answer": "0.5"}))
    )
    worker.start()
    worker.join(120)
    assert out == [1.0]
