"""A league's opponents in the workflow worker (workflows/opponents.py) and `ctx.opponent`: a group's
draw is one function of its id, the latest version in `latest_fraction` of the draws, the snapshots by
their weights; a snapshot's turns are never recorded; the score compares the trained agents' rewards
with the opponent's."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
from fakes import FakeBuffer, FakeEngine

from polyrl_runtime.data.row import RowRef
from polyrl_runtime.engines.api import SamplingParams, UnknownSnapshotError
from polyrl_runtime.engines.pool import EnginePool
from polyrl_runtime.experience.client import BufferClient
from polyrl_runtime.experience.types import Ticket
from polyrl_runtime.models import load_tokenizer
from polyrl_runtime.workflows.api import EpisodeContext
from polyrl_runtime.workflows.opponents import OpponentRecord, OpponentTable, draw, opponent_score
from polyrl_runtime.workflows.runner import WorkflowWorker
from polyrl_testenv.inprocess import engine_routes
from polyrl_testenv.league_jobs import higher_digit_job


def test_a_draw_is_a_function_of_its_key_with_the_latest_in_its_fraction() -> None:
    table = OpponentTable("p", (0, 2, 4), (1.0, 1.0, 2.0), latest_fraction=0.25)
    draws = [draw(table, f"g-{i}/rival") for i in range(4000)]
    assert draws == [draw(table, f"g-{i}/rival") for i in range(4000)]  # the same on any worker
    counts = Counter(draws)
    assert set(counts) == {None, 0, 2, 4}
    assert counts[None] / 4000 == pytest.approx(0.25, abs=0.03)
    assert counts[4] / counts[0] == pytest.approx(2.0, rel=0.2)  # by weight among the snapshots


def test_nothing_held_is_the_latest_and_zero_weights_are_uniform() -> None:
    assert {draw(OpponentTable("p"), f"g{i}") for i in range(50)} == {None}
    flat = Counter(draw(OpponentTable("p", (1, 2), (0.0, 0.0), 0.0), f"g{i}") for i in range(2000))
    assert set(flat) == {1, 2} and flat[1] / 2000 == pytest.approx(0.5, abs=0.05)


def test_a_table_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="2 snapshots, 1 weights"):
        OpponentTable("p", (1, 2), (1.0,))
    with pytest.raises(ValueError, match="0 <= latest_fraction <= 1"):
        OpponentTable("p", (), (), 1.5)


@pytest.mark.parametrize(
    ("rewards", "trained", "want"),
    [
        ({"me": 1.0, "rival": 0.0}, ["me"], 1.0),
        ({"me": 0.2, "rival": 0.2}, ["me"], 0.5),
        ({"a": 0.0, "b": 1.0, "rival": 0.4}, ["a", "b"], 1.0),  # the trained agents' mean
        ({"me": 0.0, "rival": 1.0}, ["me", "rival"], 0.0),  # the opponent itself never counts
        ({"me": 1.0}, ["me"], None),  # no reward for the opponent
        ({"rival": 1.0}, [], None),
    ],
)
def test_the_score_compares_the_trained_agents_with_the_opponent(
    rewards: dict[str, float], trained: list[str], want: float | None
) -> None:
    assert opponent_score(rewards, trained, "rival") == want


def test_an_opponent_at_a_snapshot_asks_for_it_and_records_no_turn() -> None:
    seen: list[SamplingParams] = []

    def reply(prompt: list[int], params: SamplingParams) -> list[int]:
        seen.append(params)
        return [5]

    handle = FakeEngine(reply)
    tok = load_tokenizer("builtin://tiny")
    tables = {"agent": OpponentTable("agent", (3,), (1.0,), latest_fraction=0.0)}

    def ctx(group: str) -> EpisodeContext:
        return EpisodeContext(
            f"{group}-0",
            group,
            0,
            1,
            EnginePool(engine_routes({"agent": {"e0": handle}})),
            {"agent": tok},
            {"agent": SamplingParams(max_new_tokens=1)},
            agent_policies={"me": "agent", "rival": "agent"},
            opponent_tables=tables,
        )

    async def go() -> None:
        c = ctx("g-1")
        await c.agent("me").generate("x")
        rival = c.opponent("rival")
        assert rival.snapshot == 3 and c.opponent("rival").snapshot == 3  # drawn once
        await rival.generate("x")
        assert [t.agent for t in c.turns] == ["me"] and [call.agent for call in c.calls] == ["me"]
        assert [p.snapshot for p in seen] == [None, 3] and c.opponents == {"rival": ("agent", 3)}
        with pytest.raises(KeyError, match=r"policy 'solver'.*has no league"):
            EpisodeContext(
                "e", "g", 0, 1, c.pool, {"solver": tok}, c.sampling, opponent_tables=tables
            ).opponent("solver")

    asyncio.run(go())


def test_the_worker_trains_the_player_alone_and_evaluates_against_the_latest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "data"))
    tok = load_tokenizer("builtin://tiny-qwen2")
    digits = {d: tok.token_id(d) for d in "0123"}
    seen: list[int | None] = []

    def reply(prompt: list[int], params: SamplingParams) -> list[int]:
        seen.append(params.snapshot)
        return [digits["3"] if params.snapshot is None else digits["1"]]  # the current version wins

    buffer = FakeBuffer()
    worker = WorkflowWorker(
        "w", higher_digit_job(), BufferClient(buffer), engine_routes({"agent": {"e": FakeEngine(reply)}})
    )
    worker.set_opponents({"agent": OpponentTable("agent", (4,), (1.0,), latest_fraction=0.0)})
    report = asyncio.run(worker.run_group("g", 3, [Ticket(i, frozenset({"agent"})) for i in range(2)]))
    assert sorted(seen, key=str) == [4, 4, None, None]  # each episode's rival at the snapshot
    assert all([t.agent for t in e.turns] == ["player"] for e in buffer.episodes)
    assert [ep.opponents for ep in report.episodes] == [{"rival": OpponentRecord("agent", 4, 1.0)}] * 2
    assert all(ep.opponent_policies == frozenset({"agent"}) for ep in report.episodes)
    seen.clear()
    out = asyncio.run(worker.evaluate("ev", 1, RowRef("mem://", 0, {}), 2, True))
    assert seen == [None] * 4 and all(isinstance(o, dict) for o in out)  # eval: the latest version


def test_an_episode_whose_snapshot_is_gone_is_played_again_against_another_draw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "data"))
    tok = load_tokenizer("builtin://tiny-qwen2")
    seen: list[int | None] = []

    def reply(prompt: list[int], params: SamplingParams) -> list[int]:
        seen.append(params.snapshot)
        if params.snapshot == 4:  # evicted on the engine since the table was pushed
            raise UnknownSnapshotError("e", "agent", 4, (6,))
        return [tok.token_id("2")]

    buffer = FakeBuffer()
    worker = WorkflowWorker(
        "w", higher_digit_job(), BufferClient(buffer), engine_routes({"agent": {"e": FakeEngine(reply)}})
    )
    worker.set_opponents({"agent": OpponentTable("agent", (4,), (1.0,), latest_fraction=0.0)})
    report = asyncio.run(worker.run_group("g", 3, [Ticket(0, frozenset({"agent"}))]))
    (ep,) = report.episodes
    assert ep.ok and ep.replaced_snapshot == ("agent", 4), ep
    assert 4 in seen and seen[-2:] == [None, None]  # played again: its rival at the latest version
    assert ep.opponents == {} and len(buffer.episodes) == 1  # trained once, from the second play
    assert worker.opponent_tables["agent"].held == ()  # left out of this worker's draws
