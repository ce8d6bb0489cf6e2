"""A league through the driver and real actors (`spec.policies[].league`): one LoRA policy plays itself,
its rival drawn by `ctx.opponent` from snapshots of its past versions, which its engine holds as
copies of its adapter; a snapshot's turns are never trained on, and each step's record reports the
snapshots held, their bytes, and the current version's results against them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from driver_harness import make_job, policy, run

from polyrl_runtime.coordinator.crossplay import read_cells

pytestmark = pytest.mark.slow

LORA = {"rank": 4, "alpha": 8, "targetModules": ["q_proj", "v_proj"]}


def league_job(
    league: dict[str, Any],
    *,
    steps: int = 4,
    rival: bool = True,
    rival_policy: str = "agent",
    cross_play: dict[str, Any] | None = None,
    lora: dict[str, Any] | None = LORA,
) -> Any:
    model = {"uri": "builtin://tiny-qwen2", "dtype": "float32"}
    p = policy("agent", model=model)
    p["algorithm"] = {"name": "grpo", "groupSize": 4, "lr": 1.0e-2, **({"lora": lora} if lora else {})}
    p["league"] = league
    frozen = policy(rival_policy, model=model, frozen=True)
    frozen.pop("trainer", None)
    extra = {"evaluation": {"greedy": False, "crossPlay": cross_play}} if cross_play else {}
    return make_job(
        mode="sync",
        maxStaleness=0,
        training={"totalSteps": steps, "episodesPerStep": 16, "seed": 3},
        workflow={
            "entrypoint": "league_workflows:HigherDigit",
            "args": {"symbols": 4, "rival": rival, "policies": {"player": "agent", "rival": rival_policy}},
        },
        policies=[p, *([frozen] if rival_policy != "agent" else [])],
        **extra,
    )


def test_a_policy_plays_snapshots_of_its_past_versions(ray_local: Any, tmp_path: Path) -> None:
    job = league_job({"snapshotEverySteps": 1, "keep": 2, "sampling": "uniform", "latestFraction": 0.25})
    driver, summary = run(job, tmp_path)
    assert summary.state == "done", summary.message
    records = [r for r in summary.records if r.step > 0]
    # After each step's sync its version is a snapshot too; the oldest beyond keep is evicted.
    assert [r.league_held for r in records] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    assert all(r.league_bytes and r.league_bytes > 0 for r in records)
    games = records[-1].league_games_total
    assert sum(games.values()) > 0 and set(games) <= {"0", "1", "2", "3"}
    assert all(0.0 <= w <= 1.0 for r in records for w in r.league_win_rate.values())
    # Rated from step 2 on (step 1's episodes, at version 0, met only version 0 itself).
    assert records[0].rating is None and records[-1].rated_version in (2, 3)
    assert records[-1].rating is not None
    # /progress (and so the RLJob's status and its Ratings column) carries the newest rating.
    (agent,) = driver.progress().policies
    assert agent.rating == records[-1].rating
    # A rival at a snapshot adds no sample: fewer than two samples an episode in all.
    assert all(r.samples < 2 * r.episodes for r in records), [(r.samples, r.episodes) for r in records]


def test_a_full_weight_policy_plays_host_copies_of_its_past_versions(ray_local: Any, tmp_path: Path) -> None:
    """Without LoRA each snapshot is a host copy of the weights, served by one serving copy of the
    model on each engine (residentSnapshots 1), switched between snapshots as episodes ask."""
    league = {"snapshotEverySteps": 1, "keep": 2, "sampling": "uniform", "latestFraction": 0.25}
    _, summary = run(league_job({**league, "residentSnapshots": 1}, steps=2, lora=None), tmp_path)
    assert summary.state == "done", summary.message
    records = [r for r in summary.records if r.step > 0]
    assert [r.league_held for r in records] == [[0, 1], [1, 2]]
    weights = records[0].league_bytes // 2  # two host copies of the model's weights
    assert weights > 100_000 and all(r.league_bytes == 2 * weights for r in records)
    assert sum(records[-1].league_games_total.values()) > 0
    assert all(r.samples < 2 * r.episodes for r in records), [(r.samples, r.episodes) for r in records]
    assert records[-1].rating is not None


def test_a_league_no_episode_plays_fails_the_job_naming_it(ray_local: Any, tmp_path: Path) -> None:
    job = league_job({"snapshotEverySteps": 1, "keep": 2}, rival=False)
    _, summary = run(job, tmp_path, unused_episodes=8)
    assert summary.state == "failed"
    assert (
        "spec.policies[0].league: workflow league_workflows:HigherDigit asked for no opponent"
        in summary.message
    )


def test_a_league_for_cross_play_alone_rates_its_versions_against_a_fixed_rival(
    ray_local: Any, tmp_path: Path
) -> None:
    """No ctx.opponent: the rival is a frozen policy's agent; the league's snapshots play only in
    cross-play, which is no reason to fail the job, and the frozen rival anchors the ratings."""
    pair = {"pairs": [{"row": "agent", "column": "fixed"}], "everySteps": 1, "versions": 2, "episodes": 4}

    def job(steps: int) -> Any:
        league = {"snapshotEverySteps": 1, "keep": 2}
        xp = {**pair, "anchor": "fixed", "anchorRating": 1200}
        return league_job(league, steps=steps, rival=False, rival_policy="fixed", cross_play=xp)

    driver, summary = run(job(3), tmp_path, unused_episodes=8)
    assert summary.state == "done", summary.message
    cells = read_cells(tmp_path / "crossplay.jsonl")
    assert {(c["step"], c["row_version"], c["column_version"]) for c in cells} == {
        (1, 0, 0),
        (1, 1, 0),
        (2, 1, 0),
        (2, 2, 0),
        (3, 2, 0),
        (3, 3, 0),
    }
    assert all(c["scored"] == 4 for c in cells)
    ratings = driver.ratings.ratings()
    assert ratings[("fixed", 0)] == 1200.0 and ("agent", 3) in ratings
    (agent, _) = driver.progress().policies
    assert agent.rating == round(ratings[("agent", 3)], 1)
    # resumed for one step more, the ratings go on from the checkpoint's games: the whole run's
    again, summary = run(job(4), tmp_path, unused_episodes=8)
    assert summary.state == "done" and again.resumed, summary.message
    assert set(driver.ratings.games) < set(again.ratings.games)
    assert {a for a, _ in again.ratings.games} == {("agent", v) for v in range(5)}


def test_a_cross_play_pair_that_never_meets_fails_the_job_naming_it(ray_local: Any, tmp_path: Path) -> None:
    """A policy against itself, in a workflow that seats no ctx.opponent: no side to score."""
    pair = {"pairs": [{"row": "agent", "column": "agent"}], "everySteps": 1, "versions": 2, "episodes": 2}
    job = league_job({"snapshotEverySteps": 1, "keep": 2}, steps=3, rival=False, cross_play=pair)
    _, summary = run(job, tmp_path, unused_episodes=10_000)
    assert summary.state == "failed"
    assert summary.message.startswith("spec.evaluation.crossPlay.pairs[0]: in 8 cross-play episodes")
    assert "never meet" in summary.message
