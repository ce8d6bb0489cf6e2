"""A league under `polyrl run` (a subprocess with its own local Ray): TextArena self-play whose second
player is drawn from the policy's snapshots; the metrics rows carry the league's columns, and the
cross-play passes of the policy's versions against each other write their matrix and heatmap."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyrl_runtime.coordinator.crossplay import read_cells
from polyrl_testenv.localrun import metrics_rows, run_to_end

JOB = Path(__file__).parent.parent / "data" / "league-tictactoe-tiny.yaml"


@pytest.mark.slow
def test_polyrl_run_plays_a_league_and_cross_play_and_writes_their_results(tmp_path: Path) -> None:
    summary = run_to_end(JOB, tmp_path, "--quiet", timeout=600)
    assert summary["steps"] == {"me": 3}, summary
    rows = [r for r in metrics_rows(tmp_path) if r["step"] > 0]
    assert [r["league_held"] for r in rows] == [[0, 1], [1, 2], [2, 3]]
    assert all(r["league_bytes"] > 0 for r in rows)
    games = {k: v for k, v in rows[-1].items() if k.startswith("league_games_total_v")}
    assert games and sum(games.values()) > 0, rows[-1]
    assert all(0.0 <= v <= 1.0 for r in rows for k, v in r.items() if k.startswith("league_win_rate_v"))
    # cross-play at every step: the two newest versions (current and snapshots) against each other
    cells = read_cells(tmp_path / "crossplay.jsonl")
    by_step = {
        s: {(c["row_version"], c["column_version"]) for c in cells if c["step"] == s} for s in (1, 2, 3)
    }
    assert by_step == {
        1: {(0, 0), (0, 1), (1, 0), (1, 1)},
        2: {(1, 1), (1, 2), (2, 1), (2, 2)},
        3: {(2, 2), (2, 3), (3, 2), (3, 3)},
    }
    assert all(c["episodes"] == 2 and c["scored"] + c["failed"] + c["unmatched"] == 2 for c in cells)
    assert sum(c["scored"] for c in cells) > 0
    assert (tmp_path / "crossplay_me_me.png").stat().st_size > 0
    assert rows[-1]["rated_version"] == 3 and rows[-1]["rating"] is not None  # the newest version rated
    assert summary["files"][-1] == "crossplay_me_me.png"
