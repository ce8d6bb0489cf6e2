"""The autoscaler's pure replica decision (``polyrl_operator.autoscale``): windows, max, hysteresis
and cooldown."""

from __future__ import annotations

from polyrl_operator.autoscale import ScaleState, Signals, decide
from polyrl_operator.settings import Autoscale

PARAMS = Autoscale(backlog_high=4, utilisation_low=0.3, out_window=30, in_window=120, cooldown=60)


def test_autoscale_scales_out_only_after_the_window_and_respects_max() -> None:
    busy = Signals(backlog=40, utilisation=1.0, ready=2)
    d = decide(2, 1, 8, signals=busy, state=ScaleState(), now=0, params=PARAMS)
    assert d.desired == 2 and d.state.high_since == 0
    d = decide(2, 1, 8, signals=busy, state=d.state, now=29, params=PARAMS)
    assert d.desired == 2
    d = decide(2, 1, 8, signals=busy, state=d.state, now=30, params=PARAMS)
    assert d.desired == 8 and d.reason is not None  # ceil(40 / 4) = 10, capped at 8
    assert decide(2, 1, 3, signals=busy, state=ScaleState(high_since=0), now=31, params=PARAMS).desired == 3


def test_autoscale_hysteresis_and_cooldown() -> None:
    idle = Signals(backlog=0, utilisation=0.1, ready=3)
    mid = Signals(backlog=2, utilisation=0.5, ready=3)  # between the marks: no change either way
    state = ScaleState(last_change=0)
    assert decide(3, 1, 8, signals=idle, state=state, now=30, params=PARAMS).desired == 3  # cooldown
    d = decide(3, 1, 8, signals=idle, state=ScaleState(), now=100, params=PARAMS)
    d = decide(3, 1, 8, signals=mid, state=d.state, now=200, params=PARAMS)
    assert d.desired == 3 and d.state.low_since is None  # the window restarted
    d = decide(3, 1, 8, signals=idle, state=d.state, now=300, params=PARAMS)
    d = decide(3, 1, 8, signals=idle, state=d.state, now=420, params=PARAMS)
    assert d.desired == 2  # one at a time
    assert decide(1, 1, 8, signals=idle, state=ScaleState(low_since=0), now=1000, params=PARAMS).desired == 1
    assert (
        decide(
            3, 1, 8, signals=Signals(40, 1.0, ready=2), state=ScaleState(high_since=0), now=99, params=PARAMS
        ).desired
        == 3
    )
    assert decide(0, 2, 8, signals=None, state=ScaleState(), now=0, params=PARAMS).desired == 2
