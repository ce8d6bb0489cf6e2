"""TextArena games as a workflow, with the tiny Qwen2 on the real torch engine: one episode is one game
between two agents (here one policy in self-play), each side one multi-turn conversation with loss
only on the sampled moves, rewards from the game, TextArena's invalid-move rule, the turn cap; and
the games refused when the workflow is created."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeEngine

from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.engines.pool import EnginePool
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.models import load_tokenizer
from polyrl_runtime.workflows.api import EpisodeContext, Outcome
from polyrl_runtime.workflows.opponents import OpponentTable
from polyrl_runtime.workflows.textarena import TextArenaGame, _render
from polyrl_testenv.inprocess import engine_routes


class _Method:
    def __init__(self, fn: Callable[..., Awaitable[Any]]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Awaitable[Any]:
        return self.fn(*args)


def _play(uri: str, game: TextArenaGame, seed: int) -> tuple[Outcome, EpisodeContext]:
    engine = TorchEngine("e0", "me", uri, transport="shm", seed=1, dtype="float32")
    handle = type("H", (), {"generate": _Method(engine.generate)})()

    async def go() -> tuple[Outcome, EpisodeContext]:
        ctx = EpisodeContext(
            "ep-1",
            "g-1",
            0,
            seed,
            EnginePool(engine_routes({"me": {"e0": handle}})),
            {"me": load_tokenizer(uri)},
            {"me": SamplingParams(temperature=1.0, max_new_tokens=6)},
        )
        return await game.run_episode(ctx), ctx

    return asyncio.run(go())


def test_a_game_is_one_episode_with_a_conversation_per_player(tiny_qwen2_dir: Path) -> None:
    uri = f"file://{tiny_qwen2_dir}"
    outcome, ctx = _play(uri, TextArenaGame(env="TicTacToe-v0", players=["me", "me"], max_turns=12), seed=3)
    # The untrained model writes no valid move: TextArena refuses the first, and the second in a row
    # loses the game for the player who wrote it.
    assert outcome.metadata["ended"] == "game"
    assert outcome.metadata["lost_on_invalid_move"] == ["player0"]
    assert outcome.metadata["success"] == 0.0  # not played out by the rules
    assert outcome.rewards == {"player0": -1.0, "player1": 1.0}
    assert outcome.metadata["refused_moves"] == {"player0": 1, "player1": 0}
    [turn] = ctx.turns  # player 0 moved twice in one conversation; player 1 never moved
    assert turn.agent == "player0" and turn.policy == "me"
    mask = turn.loss_mask
    assert mask[0] and mask[-1] and not mask.all()  # move, the game's refusal (context), move
    tok = load_tokenizer(uri)
    prompt = tok.decode(turn.prompt_ids.tolist(), skip_special=False)
    assert "[GAME] You are Player 0 in Tic Tac Toe." in prompt and "Available Moves:" in prompt
    context = tok.decode(turn.response_ids[~mask].tolist(), skip_special=False)
    assert "[GAME]" in context and "<|im_start|>user\n" in context


def test_a_game_still_going_at_the_turn_cap_is_a_draw(tiny_qwen2_dir: Path) -> None:
    outcome, ctx = _play(
        f"file://{tiny_qwen2_dir}",
        TextArenaGame(env="TicTacToe-v0", players=["me", "me"], max_turns=1),
        seed=3,
    )
    assert outcome.metadata["ended"] == "turn_cap" and outcome.metadata["turns"] == len(ctx.turns) == 1
    assert outcome.metadata["success"] == 0.0
    assert outcome.rewards == {"player0": 0.0, "player1": 0.0}


def _kuhn_poker(tiny_qwen2_dir: Path, moves: Callable[[int], str], game: TextArenaGame) -> Outcome:
    """One game of Kuhn Poker in self-play whose n-th move (over both players) is `moves(n)`."""
    uri = f"file://{tiny_qwen2_dir}"
    tok = load_tokenizer(uri)
    calls = iter(range(1000))
    engine = FakeEngine(
        lambda prompt, params: [*tok.encode(moves(next(calls)), bos=False), *tok.stop_ids[:1]]
    )

    async def go() -> Outcome:
        ctx = EpisodeContext(
            "ep-1",
            "g-1",
            0,
            5,
            EnginePool(engine_routes({"me": {"e0": engine}})),
            {"me": tok},
            {"me": SamplingParams(temperature=1.0, max_new_tokens=6)},
        )
        return await game.run_episode(ctx)

    return asyncio.run(go())


def test_a_game_played_out_by_the_rules_is_a_success(tiny_qwen2_dir: Path) -> None:
    """Both players always check: every round of Kuhn Poker ends at the showdown, no move is refused."""
    game = TextArenaGame(env="KuhnPoker-v0", players=["me", "me"], max_turns=12)
    outcome = _kuhn_poker(tiny_qwen2_dir, lambda n: "[check]", game)
    assert outcome.metadata["ended"] == "game" and outcome.metadata["lost_on_invalid_move"] == []
    assert outcome.metadata["refused_moves"] == {"player0": 0, "player1": 0}
    assert outcome.metadata["turns"] == 6  # 3 rounds of check, check
    assert outcome.metadata["success"] == 1.0


def test_an_error_allowance_lets_a_player_move_again_and_each_refused_move_costs_the_penalty(
    tiny_qwen2_dir: Path,
) -> None:
    """The first player to move writes two moves the game cannot read before it checks: under
    TextArena's own rule the second loses the game; with `error_allowance: 2` it moves again, the game is played out,
    and its reward is the game's less `invalid_move_penalty` per refused move."""
    moves = lambda n: "no idea" if n < 2 else "[check]"  # noqa: E731
    strict = TextArenaGame(env="KuhnPoker-v0", players=["me", "me"], max_turns=12)
    lost = _kuhn_poker(tiny_qwen2_dir, moves, strict)
    [first] = lost.metadata["lost_on_invalid_move"]
    other = "player1" if first == "player0" else "player0"
    assert lost.rewards == {first: -1.0, other: 1.0}
    plain = TextArenaGame(env="KuhnPoker-v0", players=["me", "me"], max_turns=12, error_allowance=2)
    played = _kuhn_poker(tiny_qwen2_dir, moves, plain)
    assert played.metadata["success"] == 1.0 and played.metadata["turns"] == 8  # 2 refused + 6
    assert played.metadata["refused_moves"] == {first: 2, other: 0}
    penalised = TextArenaGame(
        env="KuhnPoker-v0", players=["me", "me"], max_turns=12, error_allowance=2, invalid_move_penalty=0.25
    )
    shaped = _kuhn_poker(tiny_qwen2_dir, moves, penalised)
    assert shaped.rewards == {first: played.rewards[first] - 0.5, other: played.rewards[other]}


def test_the_game_messages_a_player_sees_leave_out_its_own_moves() -> None:
    msgs = [(-1, "Board", None), (0, "[4]", None), (1, "[0]", None)]
    assert _render(msgs, 0) == "[GAME] Board\n[Player 1] [0]"
    assert _render(msgs, 1) == "[GAME] Board\n[Player 0] [4]"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"env": "TicTacTo-v0"},
            r"workflow.args.env 'TicTacTo-v0': TextArena has no such game \(the closest: TicTacToe-v0",
        ),
        (
            {"env": "WordChains-v0"},
            r"workflow.args.env 'WordChains-v0': the game downloads nltk corpora, .* may not reach the network",
        ),
        (
            {"env": "Debate-v0"},
            r"workflow.args.env 'Debate-v0': the game calls a model through OpenRouter",
        ),
        (
            {"env": "Mastermind-v0"},
            r"workflow.args.env 'Mastermind-v0': the game cannot be played by 2 players",
        ),
        ({"players": ["me"]}, r"workflow.args.players \['me'\]: name two policies"),
        ({"max_turns": 0}, r"workflow.args.max_turns 0: must be at least 1"),
        ({"error_allowance": -1}, r"workflow.args.error_allowance -1: must be an integer >= 0"),
        ({"invalid_move_penalty": -0.5}, r"workflow.args.invalid_move_penalty -0.5: must be a number >= 0"),
        ({"invalid_move_penalty": "x"}, r"workflow.args.invalid_move_penalty 'x': must be a number >= 0"),
    ],
)
def test_a_game_that_cannot_run_here_is_refused_naming_the_argument(
    args: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TextArenaGame(**{"players": ["me", "me"], **args})


def test_a_league_player_is_drawn_from_its_policys_league_and_never_trained_on() -> None:
    tok = load_tokenizer("builtin://tiny-qwen2")
    moves = iter(["[0]", "[4]", "[1]", "[5]", "[2]", "[8]"] * 2)  # player 0 wins on the top row
    snapshots: list[int | None] = []

    def reply(prompt: list[int], params: SamplingParams) -> list[int]:
        snapshots.append(params.snapshot)
        return tok.encode(next(moves), bos=False)

    async def go() -> tuple[Outcome, EpisodeContext]:
        ctx = EpisodeContext(
            "ep-1",
            "g-1",
            0,
            3,
            EnginePool(engine_routes({"me": {"e0": FakeEngine(reply)}})),
            {"me": tok},
            {"me": SamplingParams(temperature=1.0, max_new_tokens=6)},
            opponent_tables={"me": OpponentTable("me", (7,), (1.0,), latest_fraction=0.0)},
        )
        game = TextArenaGame(env="TicTacToe-v0", players=["me", "me"], max_turns=9, league_player=1)
        return await game.run_episode(ctx), ctx

    outcome, ctx = asyncio.run(go())
    assert snapshots == [None, 7, None, 7, None]  # player 1, the league's, at snapshot 7
    assert {t.agent for t in ctx.turns} == {"player0"} and ctx.opponents == {"player1": ("me", 7)}
    assert outcome.rewards == {"player0": 1.0, "player1": -1.0}
    with pytest.raises(ValueError, match=r"workflow\.args\.league_player 2: must be 0 or 1"):
        TextArenaGame(env="TicTacToe-v0", players=["me", "me"], league_player=2)
