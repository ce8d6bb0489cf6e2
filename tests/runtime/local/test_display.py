"""`polyrl run`'s progress display: a league policy's rating in its lines and, once a league reports,
a rating column in the live table; a job without a league shows neither."""

from __future__ import annotations

import dataclasses
import io

from rich.console import Console

from polyrl_runtime.coordinator.metrics.records import StepRecord
from polyrl_runtime.local.display import ProgressDisplay


def _record(policy: str, **fields: object) -> StepRecord:
    return dataclasses.replace(StepRecord.before_training(policy, 3, 1.0, None, None), step=3, **fields)


def _table_text(display: ProgressDisplay) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(display._table())
    return out.getvalue()


def test_a_league_policys_rating_shows_in_its_line_and_the_table() -> None:
    display = ProgressDisplay(["player", "judge"], 10, live=False, quiet=True)
    display.record(_record("judge"))
    assert "rating" not in _table_text(display) and "rating" not in display._line(display.latest["judge"])
    display.record(_record("player", league_held=[0, 2], rating=1147.2, rated_version=2))
    assert "rating 1147 (v2)" in display._line(display.latest["player"])
    lines = _table_text(display).splitlines()
    header = next(line for line in lines if "policy" in line)
    player = next(line for line in lines if "player" in line)
    assert header.split("┃")[-2].strip() == "rating" and player.split("│")[-2].strip() == "1147"
