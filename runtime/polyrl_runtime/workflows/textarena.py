"""TextArena's two-player text games as a workflow: each player is a policy, an episode is one game.

    workflow:
      entrypoint: polyrl_runtime.workflows.textarena:TextArenaGame
      args: {env: TicTacToe-v0, players: [alice, bob], max_turns: 12, max_new_tokens: 24}

`players` names the policy of player 0 and of player 1; the same policy twice is self-play (its two
agents, `player0` and `player1`, are normalised apart as any two agents of one policy are). Each
player's side of the game is one chat conversation, trained as one sequence: the game's messages since
the player's last move come as a user message (the game's prompt first), its reply is its move, so
only the tokens it sampled carry loss (workflows/chat.py). The game is TextArena's own, unwrapped
(the `-raw` form of the id): what counts as a move, what an invalid move costs (TextArena's rule: the
first in a row is refused and the player moves again, the second loses the game) and the final
rewards (+1 win, -1 loss, 0 draw, per player; Poker's chip counts) are the game's. `max_turns` caps
the moves of both players together (a game still going then is a draw: 0 each, metadata
`ended: turn_cap`); `max_new_tokens` caps each move. The group's seed seeds the game, so a group's
members play the same deal or board.

With `league_player` (0 or 1) that player is drawn from its policy's league (`ctx.opponent`:
`spec.policies[].league`): the latest version or a snapshot of a past one plays it, and a snapshot's
moves are never trained on. Self-play against past versions is `players: [me, me]` with
`league_player: 1` on a policy with a league.

Two arguments shape the rules for models still learning a game's format: `error_allowance` (how
many invalid moves in a row a player may make and move again; the game's own is 1) and
`invalid_move_penalty`, subtracted from a player's reward per refused move (a format reward: a
group whose games all end alike still ranks its members by how often they wrote a move the game
could read).

Refused when the workflow is created, naming `workflow.args.env`: an id TextArena does not have (with
the closest ids), a game for another number of players, and a game that needs the network or data
TextArena downloads at run time (nltk corpora, a model behind OpenRouter): no pod may reach them.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import random
from typing import Any

from polyrl_runtime.workflows.api import Agent, EpisodeContext, Outcome, Workflow

TASKS_EXTRA = "tasks"
# What a game's source does when it needs more than the wheel: downloads (nltk's corpora, files
# fetched with requests) or a model behind an online API. Found in the game's module source.
_NEEDS_NETWORK = {
    "nltk.download": "downloads nltk corpora",
    "EnglishDictionary": "reads nltk's word lists, which it downloads",
    "OpenRouter": "calls a model through OpenRouter (network access and an API key)",
    "requests.get": "downloads data with requests",
    "load_dataset": "downloads a Hugging Face dataset",
}


def _textarena() -> Any:
    try:
        return importlib.import_module("textarena")
    except ImportError as e:
        raise ValueError(
            f"workflow TextArenaGame needs the textarena package: pip install 'polyrl-runtime[{TASKS_EXTRA}]'"
        ) from e


def _raw_id(env: str) -> str:
    base = env.removesuffix("-raw").removesuffix("-train")
    return f"{base}-raw"


def check_env(env: str) -> str:
    """The unwrapped id of TextArena game `env` after checking that it can run here (see the module
    doc); a ValueError naming `workflow.args.env` otherwise."""
    ta = _textarena()
    registry: dict[str, Any] = ta.envs.registration.ENV_REGISTRY
    raw = _raw_id(env)
    if raw not in registry:
        close = difflib.get_close_matches(
            env, [k for k in registry if not k.endswith(("-raw", "-train"))], n=5
        )
        hint = (
            f"the closest: {', '.join(close)}"
            if close
            else "textarena.envs.registration.ENV_REGISTRY lists them"
        )
        raise ValueError(f"workflow.args.env {env!r}: TextArena has no such game ({hint})")
    module_name = str(registry[raw].entry_point).partition(":")[0]
    try:
        module = importlib.import_module(module_name)
        source = inspect.getsource(module)
    except Exception as e:  # a game whose module does not import on this Python (a SyntaxError)
        raise ValueError(f"workflow.args.env {env!r}: TextArena's game does not import here: {e}") from e
    for needle, what in _NEEDS_NETWORK.items():
        if needle in source:
            raise ValueError(
                f"workflow.args.env {env!r}: the game {what}, and a job's pods may not reach the network; "
                "choose a game that runs offline (TicTacToe-v0, KuhnPoker-v0, ConnectFour-v0, Nim-v0, ...)"
            )
    game = ta.make(raw)
    try:
        game.reset(num_players=2, seed=0)
    except Exception as e:
        raise ValueError(f"workflow.args.env {env!r}: the game cannot be played by 2 players: {e}") from e
    return raw


def _render(messages: list[tuple[int, str, Any]], me: int) -> str:
    """The game's messages to player `me` since its last move, as one text (its own moves are left
    out: they are its replies already)."""
    lines = []
    for sender, text, _kind in messages:
        if sender == me:
            continue
        who = "GAME" if sender < 0 else f"Player {sender}"
        lines.append(f"[{who}] {text}")
    return "\n".join(lines)


class TextArenaGame(Workflow):
    def __init__(
        self,
        env: str = "TicTacToe-v0",
        players: list[str] | None = None,
        max_turns: int = 20,
        max_new_tokens: int | None = None,
        *,
        error_allowance: int | None = None,
        invalid_move_penalty: float = 0.0,
        league_player: int | None = None,
        **args: Any,
    ) -> None:
        super().__init__(**args)
        if not players or len(players) != 2 or not all(isinstance(p, str) and p for p in players):
            raise ValueError(
                f"workflow.args.players {players!r}: name two policies, player 0's then player 1's "
                "(the same one twice for self-play)"
            )
        if max_turns < 1:
            raise ValueError(f"workflow.args.max_turns {max_turns}: must be at least 1")
        if error_allowance is not None and (isinstance(error_allowance, bool) or error_allowance < 0):
            raise ValueError(f"workflow.args.error_allowance {error_allowance!r}: must be an integer >= 0")
        if not (isinstance(invalid_move_penalty, int | float) and 0 <= invalid_move_penalty < float("inf")):
            raise ValueError(
                f"workflow.args.invalid_move_penalty {invalid_move_penalty!r}: must be a number >= 0"
            )
        if league_player is not None and (isinstance(league_player, bool) or league_player not in (0, 1)):
            raise ValueError(f"workflow.args.league_player {league_player!r}: must be 0 or 1 (a player)")
        self.league_player = league_player
        self.env = check_env(env)
        self.error_allowance, self.invalid_move_penalty = error_allowance, float(invalid_move_penalty)
        self.players, self.max_turns, self.max_new_tokens = list(players), max_turns, max_new_tokens

    async def run_episode(self, ctx: EpisodeContext) -> Outcome:
        for p in self.players:
            if p not in ctx.tokenizers:
                raise KeyError(
                    f"workflow.args.players: {p!r} is not a policy of the job ({sorted(ctx.tokenizers)})"
                )
        agents = [
            ctx.opponent(f"player{i}", policy)
            if i == self.league_player
            else Agent(ctx, f"player{i}", policy)
            for i, policy in enumerate(self.players)
        ]
        history: list[list[dict[str, Any]]] = [[], []]
        ta = _textarena()
        game = ta.make(self.env)
        # TextArena seeds the module-level `random` on reset: keep the process's own draws as they were.
        state = random.getstate()
        try:
            game.reset(num_players=2, seed=ctx.seed)
        finally:
            random.setstate(state)
        if self.error_allowance is not None:
            game.state.error_allowance = self.error_allowance
        done, turns, refused = False, 0, [0, 0]
        while not done and turns < self.max_turns:
            pid, observation = game.get_observation()
            history[pid].append({"role": "user", "content": _render(observation, pid)})
            reply = await agents[pid].chat(history[pid], max_new_tokens=self.max_new_tokens)
            history[pid].append(reply.message)
            errors = getattr(game.state, "error_count", 0)
            done, _info = game.step(reply.text)
            refused[pid] += getattr(game.state, "error_count", 0) > errors  # refused, to be moved again
            turns += 1
        rewards, info = game.close()
        info = info if isinstance(info, dict) else {}
        lost = [f"player{i}" for i in range(2) if info.get(i, {}).get("invalid_move")]
        meta = {
            "env": self.env,
            "turns": turns,
            "ended": "game" if rewards is not None else "turn_cap",
            "refused_moves": {f"player{i}": refused[i] for i in range(2)},
            "lost_on_invalid_move": lost,
            "reason": str(info.get(0, {}).get("reason", "")),
            # The job's success_mean: the share of games played out by the rules (no loss on an
            # invalid move, no turn cap), what two players learning a game's format raise first.
            "success": float(rewards is not None and not lost),
        }
        scores = {
            f"player{i}": (float(rewards[i]) if rewards is not None else 0.0)
            - self.invalid_move_penalty * refused[i]
            for i in range(2)
        }
        return Outcome(scores, meta)
