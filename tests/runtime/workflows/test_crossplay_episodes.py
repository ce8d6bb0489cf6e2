"""Cross-play episodes in the workflow worker (workflows/crossplay.py): which version each agent of a
cell plays (`ctx.agent`, an `Agent` the workflow builds, `ctx.opponent`), the sides' rewards and
score, and nothing of them in the buffer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fakes import FakeBuffer, FakeEngine

from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.engines.pool import EnginePool
from polyrl_runtime.experience.client import BufferClient
from polyrl_runtime.models import load_tokenizer
from polyrl_runtime.workflows.api import Agent, EpisodeContext
from polyrl_runtime.workflows.crossplay import CrossPlayGame, CrossPlayResult, sides
from polyrl_runtime.workflows.runner import WorkflowWorker
from polyrl_testenv.inprocess import engine_routes
from polyrl_testenv.league_jobs import higher_digit_job

# the league policy against itself and against a frozen base: cross-play only (nothing asks ctx.opponent
# of the base)
_PAIRS = [{"row": "agent", "column": "agent"}, {"row": "agent", "column": "base"}]
_JOB = higher_digit_job(
    {"name": "base", "model": {"uri": "builtin://tiny-qwen2"}, "frozen": True},
    evaluation={"crossPlay": {"pairs": _PAIRS}},
)


def test_a_pair_of_two_policies_holds_each_to_its_version_everywhere() -> None:
    game = CrossPlayGame("solver", "judge", 4, None)
    assert game.agent_versions() == {"solver": 4}  # the judge's current weights: no snapshot
    # the row's opponents are played by the column: a self-play workflow meets it in that seat
    assert game.stand_ins() == {"solver": ("judge", None), "judge": ("judge", None)}


def test_a_policy_against_itself_plays_the_row_as_agent_and_the_column_as_opponent() -> None:
    game = CrossPlayGame("me", "me", 2, 5)
    assert game.agent_versions() == {"me": 2} and game.stand_ins() == {"me": ("me", 5)}
    assert CrossPlayGame("me", "me", None, 5).agent_versions() == {}


@pytest.mark.parametrize(
    ("game", "rewards", "opponents", "want"),
    [
        (CrossPlayGame("me", "me", 0, 1), {"p0": 1.0, "p1": 0.0}, ["p1"], (1.0, 0.0)),
        (CrossPlayGame("s", "j", 0, 1), {"a": 0.25, "b": 0.75, "c": 0.5}, [], (0.5, 0.5)),  # each side's mean
        (CrossPlayGame("s", "j", 0, 1), {"a": 1.0}, [], (1.0, None)),  # the judge never played
        (CrossPlayGame("me", "me", 0, 1), {"p0": 1.0, "p1": 0.0}, [], (0.5, None)),  # no ctx.opponent
    ],
)
def test_the_sides_are_each_policys_agents_or_the_agents_and_opponents(
    game: CrossPlayGame, rewards: dict[str, float], opponents: list[str], want: tuple[float, float | None]
) -> None:
    roster = {"p0": "me", "p1": "me", "a": "s", "b": "s", "c": "j"}
    assert sides(game, rewards, roster, opponents) == CrossPlayResult(*want)


@pytest.mark.parametrize(("row", "column", "want"), [(1.0, 0.0, 1.0), (0.5, 0.5, 0.5), (0.0, 1.0, 0.0)])
def test_a_score_compares_the_sides(row: float, column: float, want: float) -> None:
    assert CrossPlayResult(row, column).score == want
    assert CrossPlayResult(row, None).score is None


def test_every_agent_a_cell_makes_plays_its_policys_version() -> None:
    seen: list[tuple[str, int | None]] = []
    tok = load_tokenizer("builtin://tiny")

    def reply(prompt: list[int], params: SamplingParams) -> list[int]:
        seen.append(("call", params.snapshot))
        return [5]

    game = CrossPlayGame("solver", "judge", 3, None)
    ctx = EpisodeContext(
        "xp-0",
        "xp",
        0,
        1,
        EnginePool(engine_routes({p: {f"e-{p}": FakeEngine(reply)} for p in ("solver", "judge")})),
        {"solver": tok, "judge": tok},
        {p: SamplingParams(max_new_tokens=1) for p in ("solver", "judge")},
        versions=game.agent_versions(),
        stand_ins=game.stand_ins(),
    )

    async def go() -> None:
        await ctx.agent("solver").generate("x")  # the cell's snapshot: no turn recorded
        await Agent(ctx, "critic", "solver").generate("x")  # built by the workflow: the same version
        await ctx.agent("judge").generate("x")  # the judge's current weights: a turn, never sent on

    asyncio.run(go())
    assert [v for _, v in seen] == [3, 3, None]
    assert ctx.roster == {"solver": "solver", "critic": "solver", "judge": "judge"}
    assert [t.agent for t in ctx.turns] == ["judge"]


def test_the_worker_plays_a_cell_outside_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "data"))
    tok = load_tokenizer("builtin://tiny-qwen2")
    digits = {d: tok.token_id(d) for d in "0123"}
    seen: list[int | None] = []

    def reply(prompt: list[int], params: SamplingParams) -> list[int]:
        seen.append(params.snapshot)
        return [digits[str(params.snapshot or 0)]]  # a later version names a higher digit: it wins

    based = 0

    def base(prompt: list[int], params: SamplingParams) -> list[int]:
        nonlocal based
        based += 1
        return [digits["0"]]

    buffer = FakeBuffer()
    routes = engine_routes({"agent": {"e": FakeEngine(reply)}, "base": {"b": FakeEngine(base)}})
    worker = WorkflowWorker("w", _JOB, BufferClient(buffer), routes)
    out = asyncio.run(worker.cross_play("xp", 7, [None] * 3, True, CrossPlayGame("agent", "agent", 2, 1)))
    assert out == [CrossPlayResult(1.0, 0.0)] * 3 and sorted(seen) == [1, 1, 1, 2, 2, 2]
    seen.clear()
    out = asyncio.run(worker.cross_play("xp", 7, [None] * 2, True, CrossPlayGame("agent", "agent", None, 3)))
    assert [o.score for o in out if isinstance(o, CrossPlayResult)] == [0.0, 0.0]
    assert sorted(seen, key=str) == [3, 3, None, None]
    seen.clear()
    # a self-play workflow against a fixed opponent: the frozen base plays in the rival's seat
    out = asyncio.run(worker.cross_play("xp", 7, [None] * 2, True, CrossPlayGame("agent", "base", 2, None)))
    assert out == [CrossPlayResult(1.0, 0.0)] * 2 and seen == [2, 2] and based == 2
    assert buffer.episodes == []  # nothing is trained on cross-play


def test_a_failed_cell_episode_is_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "data"))

    def reply(prompt: list[int], params: SamplingParams) -> list[int]:
        raise RuntimeError("engine on fire")

    routes = engine_routes({"agent": {"e": FakeEngine(reply)}, "base": {"b": FakeEngine(reply)}})
    worker = WorkflowWorker("w", _JOB, BufferClient(FakeBuffer()), routes)
    out = asyncio.run(worker.cross_play("xp", 7, [None], True, CrossPlayGame("agent", "agent", None, None)))
    assert (
        len(out) == 1 and isinstance(out[0], str) and out[0].startswith("episode xpe0-0") and "fire" in out[0]
    )
