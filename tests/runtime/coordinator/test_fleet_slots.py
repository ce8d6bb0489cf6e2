"""A slot is reported drained only from an idle poll that started after its drain was routed: an
idle moment seen earlier says nothing about requests still routed to it."""

from __future__ import annotations

from polyrl_runtime.coordinator.fleet import Slot


def test_drained_needs_an_idle_poll_after_the_drain() -> None:
    s = Slot("e0", handle=None)
    s.observe(0.0, 0)
    s.draining = True
    assert not s.drained  # the idle poll predates the drain
    s.observe(0.1, 0, draining_at_poll=False)  # a poll started before the routes went out
    assert not s.drained
    s.observe(0.2, 1, draining_at_poll=True)
    assert not s.drained  # still busy
    s.observe(0.3, 0, draining_at_poll=True)
    assert s.drained
