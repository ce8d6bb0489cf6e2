"""A league under `polyrl run` (a subprocess with its own local Ray): TextArena self-play whose second
player is drawn from the policy's snapshots; the metrics rows carry the league's columns."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyrl_testenv.localrun import metrics_rows, run_to_end

JOB = Path(__file__).parent.parent / "data" / "league-tictactoe-tiny.yaml"


@pytest.mark.slow
def test_polyrl_run_plays_a_league_and_writes_its_columns(tmp_path: Path) -> None:
    summary = run_to_end(JOB, tmp_path, "--quiet", timeout=600)
    assert summary["steps"] == {"me": 3}, summary
    rows = [r for r in metrics_rows(tmp_path) if r["step"] > 0]
    assert [r["league_held"] for r in rows] == [[0, 1], [1, 2], [2, 3]]
    assert all(r["league_bytes"] > 0 for r in rows)
    games = {k: v for k, v in rows[-1].items() if k.startswith("league_games_total_v")}
    assert games and sum(games.values()) > 0, rows[-1]
    assert all(0.0 <= v <= 1.0 for r in rows for k, v in r.items() if k.startswith("league_win_rate_v"))
