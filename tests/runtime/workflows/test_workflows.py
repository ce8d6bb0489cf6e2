"""Workflows against fake engines: imports and their errors, the shipped games' rewards, the worker's
group handling (GRPO signals, failures counted with episode ids, engine loss retried)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import ray
from fakes import DetachedEngine, FakeBuffer, FakeEngine

from polyrl_operator.api import RLJob
from polyrl_runtime.engines.api import EngineUnavailableError, SamplingParams
from polyrl_runtime.engines.pool import EnginePool
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.experience.client import BufferClient
from polyrl_runtime.experience.types import Ticket
from polyrl_runtime.models import CharTokenizer
from polyrl_runtime.workflows.api import EpisodeContext, Workflow, WorkflowImportError, load_workflow
from polyrl_runtime.workflows.failure import PolicyFailure
from polyrl_runtime.workflows.proposer_solver import ProposerSolver
from polyrl_runtime.workflows.runner import WorkflowWorker, failure_rewards
from polyrl_runtime.workflows.signal import SignalGame
from polyrl_testenv.inprocess import engine_routes

TOK = CharTokenizer()


def _last_char(prompt: list[int]) -> str:
    return TOK.decode(prompt[-1:])


def speaker_code(prompt: list[int], params: SamplingParams) -> list[int]:  # digit d -> letter a+d
    return [TOK.token_id("abcdefgh"["0123456789".index(_last_char(prompt))])]


def listener_decode(prompt: list[int], params: SamplingParams) -> list[int]:
    return [TOK.token_id(str("abcdefgh".index(_last_char(prompt))))]


def _ctx(
    routes: dict[str, dict[str, Any]], policies: dict[str, str] | None = None, seed: int = 1
) -> EpisodeContext:
    names = set(routes)
    return EpisodeContext(
        "ep-1",
        "g-1",
        0,
        seed,
        EnginePool(engine_routes(routes)),
        {p: TOK for p in names},
        {p: SamplingParams(max_new_tokens=4) for p in names},
        policies or {},
    )


def test_load_workflow_reports_what_is_wrong() -> None:
    wf, mapping = load_workflow(
        "polyrl_runtime.workflows.signal:SignalGame",
        {"vocab": 4, "policies": {"speaker": "a", "listener": "a"}},
    )
    assert isinstance(wf, SignalGame) and mapping == {"speaker": "a", "listener": "a"}
    with pytest.raises(WorkflowImportError, match="cannot import module 'no_such_mod'"):
        load_workflow("no_such_mod:X", None)
    with pytest.raises(WorkflowImportError, match="has no 'Nope'"):
        load_workflow("polyrl_runtime.workflows.signal:Nope", None)
    with pytest.raises(WorkflowImportError, match="unexpected workflow args"):
        load_workflow("polyrl_runtime.workflows.signal:SignalGame", {"colour": 1})
    with pytest.raises(WorkflowImportError, match="no run_episode"):
        load_workflow(
            "polyrl_runtime.workflows.api:Reply",
            {"text": "", "token_ids": [], "prompt_ids": [], "finish_reason": ""},
        )


def test_signal_game_rewards_agreement_and_records_constrained_turns() -> None:
    game = SignalGame(vocab=8, symbols=4)
    routes = {"speaker": {"s": FakeEngine(speaker_code)}, "listener": {"l": FakeEngine(listener_decode)}}
    ctx = _ctx(routes)
    out = asyncio.run(game.run_episode(ctx))
    assert out.rewards == {"speaker": 1.0, "listener": 1.0}
    assert [t.agent for t in ctx.turns] == ["speaker", "listener"]
    assert TOK.decode(ctx.turns[0].allowed_ids.tolist()) == "abcdefgh"
    assert TOK.decode(ctx.turns[1].allowed_ids.tolist()) == "0123"
    wrong = {"speaker": routes["speaker"], "listener": {"l": FakeEngine(lambda p, s: [TOK.token_id("9")])}}
    assert asyncio.run(game.run_episode(_ctx(wrong))).rewards == {"speaker": 0.0, "listener": 0.0}


def test_signal_game_latency_waits_without_blocking_and_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []

    async def fake_sleep(seconds: float) -> None:  # records the wait: a yield, not CPU
        waits.append(seconds)

    monkeypatch.setattr("polyrl_runtime.workflows.signal.asyncio.sleep", fake_sleep)
    routes = {"speaker": {"s": FakeEngine(speaker_code)}, "listener": {"l": FakeEngine(listener_decode)}}
    out = asyncio.run(SignalGame(vocab=8, symbols=4, latency_s=0.25).run_episode(_ctx(routes)))
    assert waits == [0.25] and out.rewards["listener"] == 1.0
    asyncio.run(SignalGame(vocab=8, symbols=4).run_episode(_ctx(routes)))
    assert waits == [0.25]  # no latency by default
    with pytest.raises(ValueError, match="latency_s must be >= 0"):
        SignalGame(latency_s=-1)


def test_agents_can_share_one_policy() -> None:
    both = FakeEngine(
        lambda p, s: speaker_code(p, s) if TOK.decode(p).startswith("target") else listener_decode(p, s)
    )
    ctx = _ctx({"agent": {"e": both}}, {"speaker": "agent", "listener": "agent"})
    assert asyncio.run(SignalGame().run_episode(ctx)).rewards["listener"] == 1.0
    assert {t.policy for t in ctx.turns} == {"agent"} and both.calls == 2
    with pytest.raises(KeyError, match="does not define"):
        _ctx({"agent": {"e": both}}).agent("speaker")


@pytest.mark.parametrize(
    ("mode", "answer", "expected"),
    [
        ("mixed", "3", {"proposer": 1.0, "solver": 1.0}),
        ("mixed", "0", {"proposer": 0.0, "solver": 0.0}),
        ("competitive", "3", {"proposer": 0.0, "solver": 1.0}),
        ("competitive", "4", {"proposer": 1.0, "solver": 0.0}),
    ],
)
def test_proposer_solver_rewards_depend_on_each_other(
    mode: str, answer: str, expected: dict[str, float]
) -> None:
    game = ProposerSolver(base=5, mode=mode)  # type: ignore[arg-type]
    routes = {
        "proposer": {"p": FakeEngine(lambda p, s: TOK.encode("12"))},
        "solver": {"s": FakeEngine(lambda p, s: TOK.encode(answer))},
    }
    assert asyncio.run(game.run_episode(_ctx(routes))).rewards == expected


def test_pool_retries_on_another_engine_when_one_dies() -> None:
    dead = FakeEngine(lambda p, s: [])

    def boom(*_: Any) -> Any:
        raise ray.exceptions.RayActorError()

    dead.generate.fn = boom
    good = FakeEngine(lambda p, s: [5])
    pool = EnginePool(engine_routes({"p": {"dead": dead, "good": good}}))

    async def go() -> None:
        for _ in range(3):
            assert (await pool.generate("p", [1], SamplingParams())).token_ids.tolist() == [5]

    asyncio.run(go())
    assert pool.take_dead() == {"dead"} and good.calls == 3
    lonely = EnginePool(engine_routes({"p": {"dead": dead}}), retries=3)
    with pytest.raises(EngineUnavailableError, match="no live engine for policy 'p'"):
        asyncio.run(lonely.generate("p", [1], SamplingParams()))


class FlakyGame(SignalGame):
    async def run_episode(self, ctx: EpisodeContext) -> Any:
        if ctx.index == 1:
            raise RuntimeError("the workflow broke")
        return await super().run_episode(ctx)


class NaNGame(SignalGame):
    async def run_episode(self, ctx: EpisodeContext) -> Any:
        outcome = await super().run_episode(ctx)
        if ctx.index == 2:
            outcome.rewards["listener"] = float("nan")
        return outcome


class MalformedGame(SignalGame):
    """Member 1 plays, then gives up on what its policies wrote; member 3 gives up before a turn."""

    async def run_episode(self, ctx: EpisodeContext) -> Any:
        if ctx.index == 3:
            raise PolicyFailure("nothing to read")
        outcome = await super().run_episode(ctx)
        if ctx.index == 1:
            raise PolicyFailure("the listener's guess is not a symbol")
        return outcome


def _job(entrypoint: str, **workflow: Any) -> str:
    doc = {
        "apiVersion": "polyrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "t"},
        "spec": {
            "training": {"totalSteps": 1},
            "workflow": {"entrypoint": entrypoint, **workflow},
            "policies": [
                {
                    "name": n,
                    "model": {"uri": "builtin://tiny"},
                    "algorithm": {"groupSize": 4},
                    "rollout": {"engine": "torch", "gpus": 0},
                }
                for n in ("speaker", "listener")
            ],
        },
    }
    return RLJob.model_validate(doc).model_dump_json(by_alias=True)


def test_worker_puts_group_relative_episodes_and_counts_failures() -> None:
    routes = {"speaker": {"s": FakeEngine(speaker_code)}, "listener": {"l": FakeEngine(listener_decode)}}
    buffer = FakeBuffer()
    worker = WorkflowWorker("w", _job(f"{__name__}:FlakyGame"), BufferClient(buffer), engine_routes(routes))
    tickets = [Ticket(i, frozenset({"speaker", "listener"})) for i in range(4)]
    report = asyncio.run(worker.run_group("g7", 11, tickets))
    failed = [e for e in report.episodes if not e.ok]
    assert [(e.episode_id, e.reason) for e in failed] == [("g7-1", "workflow_error")]
    assert "the workflow broke" in failed[0].error
    assert buffer.released == [tickets[1]] and len(buffer.episodes) == 3
    # every member succeeded: the group-relative signal is 0, the raw reward stays in metadata
    assert all(
        e.rewards["speaker"] == 0.0 and e.metadata["rewards"]["speaker"] == 1.0 for e in buffer.episodes
    )
    # same seed, same task: all members of the group share the target
    assert len({e.metadata["target"] for e in buffer.episodes}) == 1
    assert worker.stats().in_flight == 0


def test_a_non_finite_reward_fails_its_episode_and_never_reaches_the_buffer() -> None:
    """One NaN in a group's baseline would make every signal of the group, then every advantage of
    the policy's step, NaN: the episode fails (reward_error, naming it, the agent and the value)."""
    routes = {"speaker": {"s": FakeEngine(speaker_code)}, "listener": {"l": FakeEngine(listener_decode)}}
    buffer = FakeBuffer()
    worker = WorkflowWorker("w", _job(f"{__name__}:NaNGame"), BufferClient(buffer), engine_routes(routes))
    tickets = [Ticket(i, frozenset({"speaker", "listener"})) for i in range(4)]
    report = asyncio.run(worker.run_group("g3", 11, tickets))
    [failed] = [e for e in report.episodes if not e.ok]
    assert failed.episode_id == "g3-2" and failed.reason == "reward_error"
    assert "episode g3-2: workflow" in failed.error and "{'listener': nan}" in failed.error
    assert buffer.released == [tickets[2]] and len(buffer.episodes) == 3
    assert all(math.isfinite(v) for e in buffer.episodes for v in e.rewards.values())


@pytest.mark.parametrize("failure_reward", [None, -1.0])
def test_an_episode_past_the_spec_timeout_fails_and_is_trained_on_or_dropped(
    failure_reward: float | None,
) -> None:
    """Both members time out after their turns: with no finished member to take the lowest
    reward from, they are dropped (tickets released); with `failureReward` their turns are trained
    on at that reward."""
    routes = {"speaker": {"s": FakeEngine(speaker_code)}, "listener": {"l": FakeEngine(listener_decode)}}
    buffer = FakeBuffer()
    extra = {} if failure_reward is None else {"failureReward": failure_reward}
    job = _job(
        "polyrl_runtime.workflows.signal:SignalGame",
        args={"latency_s": 30.0},
        episodeTimeoutSeconds=0.2,
        **extra,
    )
    worker = WorkflowWorker("w", job, BufferClient(buffer), engine_routes(routes))
    tickets = [Ticket(i, frozenset({"speaker", "listener"})) for i in range(2)]
    report = asyncio.run(worker.run_group("g5", 11, tickets))
    assert [(e.reason, e.error) for e in report.episodes] == [
        ("timeout", "episode exceeded workflow.episodeTimeoutSeconds (0.2 s)")
    ] * 2
    if failure_reward is None:
        assert buffer.released == tickets and buffer.episodes == []
    else:
        assert buffer.released == [] and len(buffer.episodes) == 2
        assert all(e.metadata["rewards"] == {"speaker": -1.0, "listener": -1.0} for e in buffer.episodes)


class LongTurn(Workflow):
    """One speaker turn of up to 40 tokens."""

    async def run_episode(self, ctx: EpisodeContext) -> dict[str, float]:
        await ctx.agent("speaker").generate("target:1", max_new_tokens=40, allowed=["a", "b"])
        return {"speaker": 1.0}


@pytest.mark.parametrize("end", ["timeout", "cancelled"])
def test_a_timed_out_or_cancelled_episodes_requests_are_aborted_on_the_engine(end: str) -> None:
    """The speaker's engine is paused, so each episode's request waits on it (and would generate its
    40 tokens on resume): the episode timing out, or its group's call being cancelled, aborts it
    there; the engine counts the aborts and the tokens they freed, and serves the next request."""
    engine = TorchEngine("s", "speaker", "builtin://tiny", transport="shm", seed=1)
    routes = {"speaker": {"s": DetachedEngine(engine)}, "listener": {"l": FakeEngine(listener_decode)}}
    timeout = 0.3 if end == "timeout" else 300.0
    job = _job(f"{__name__}:LongTurn", episodeTimeoutSeconds=timeout)
    buffer = FakeBuffer()
    worker = WorkflowWorker("w", job, BufferClient(buffer), engine_routes(routes))
    tickets = [Ticket(i, frozenset({"speaker"})) for i in range(2)]

    async def go() -> Any:
        await engine.pause()
        group = asyncio.create_task(worker.run_group("g9", 11, tickets))
        while engine.stats().queued < 2:
            await asyncio.sleep(0.01)
        if end == "cancelled":
            group.cancel()
        result = await asyncio.gather(group, return_exceptions=True)
        for _ in range(500):
            if engine.stats().aborted == 2:
                break
            await asyncio.sleep(0.01)
        await engine.resume()
        after = await engine.generate([1, 5], SamplingParams(max_new_tokens=3))
        return result[0], len(after.token_ids)

    report, after = asyncio.run(go())
    st = engine.stats()
    assert (st.aborted, st.freed_tokens, st.in_flight) == (2, 80, 0)
    assert st.tokens == after == 3  # the aborted requests never generated
    if end == "timeout":
        assert [(e.reason, e.error) for e in report.episodes] == [
            ("timeout", "episode exceeded workflow.episodeTimeoutSeconds (0.3 s)")
        ] * 2
        assert buffer.released == tickets
    else:
        assert isinstance(report, asyncio.CancelledError)
    assert worker.pool.outstanding() == {}


def test_failure_rewards_are_fixed_or_each_agents_lowest_finished_reward() -> None:
    finished = [{"a": 1.0, "b": 0.5}, {"a": -2.0}]
    assert failure_rewards(finished, ["a", "b"], None) == {"a": -2.0, "b": 0.5}
    assert failure_rewards(finished, ["a", "b"], -1.0) == {"a": -1.0, "b": -1.0}
    assert failure_rewards(finished, ["a", "c"], None) is None  # no finished episode of c: dropped
    assert failure_rewards([], ["a"], 0.0) == {"a": 0.0}


@pytest.mark.parametrize("failure_reward", [None, -3.0])
def test_an_episode_a_policy_made_fail_is_trained_on_with_the_failure_reward(
    failure_reward: float | None,
) -> None:
    """A policy that emits output its workflow cannot use is penalised, not forgotten: the episode's
    turns go to the buffer with the failure reward (default: the group's lowest), the failure is
    counted by its reason; one that failed before any turn is dropped and its ticket released."""
    routes = {"speaker": {"s": FakeEngine(speaker_code)}, "listener": {"l": FakeEngine(listener_decode)}}
    buffer = FakeBuffer()
    extra = {} if failure_reward is None else {"failureReward": failure_reward}
    job = _job(f"{__name__}:MalformedGame", **extra)
    worker = WorkflowWorker("w", job, BufferClient(buffer), engine_routes(routes))
    tickets = [Ticket(i, frozenset({"speaker", "listener"})) for i in range(4)]
    report = asyncio.run(worker.run_group("g2", 11, tickets))
    by_id = {e.episode_id: e for e in report.episodes}
    assert (by_id["g2-1"].ok, by_id["g2-1"].reason, by_id["g2-1"].penalised) == (
        False,
        "policy_failure",
        True,
    )
    assert by_id["g2-1"].error == "the listener's guess is not a symbol"
    assert (by_id["g2-3"].reason, by_id["g2-3"].penalised) == ("policy_failure", False)
    assert buffer.released == [tickets[3]]
    put = {e.episode_id: e for e in buffer.episodes}
    assert sorted(put) == ["g2-0", "g2-1", "g2-2"]
    # The finished members all succeed (reward 1): the default failure reward is that lowest 1.
    want = 1.0 if failure_reward is None else failure_reward
    assert put["g2-1"].metadata["rewards"] == {"speaker": want, "listener": want}
    assert put["g2-1"].metadata["failed"] == "policy_failure"
    assert by_id["g2-1"].policy_rewards == {"speaker": want, "listener": want}
    mean = (2 * 1.0 + want) / 3  # group-relative over the three trained members
    assert put["g2-1"].rewards["speaker"] == pytest.approx(want - mean)


def test_worker_runs_several_groups_in_one_call_and_reports_each() -> None:
    routes = {"speaker": {"s": FakeEngine(speaker_code)}, "listener": {"l": FakeEngine(listener_decode)}}
    buffer = FakeBuffer()
    put = buffer.put

    def put_unless_g2(items: Any) -> None:
        if any(e.episode_id.startswith("g2-") for _, e in items):
            raise RuntimeError("buffer refused g2")
        put.fn(items)

    buffer.put = type(put)(put_unless_g2)
    worker = WorkflowWorker(
        "w", _job("polyrl_runtime.workflows.signal:SignalGame"), BufferClient(buffer), engine_routes(routes)
    )
    both = frozenset({"speaker", "listener"})
    groups = [(f"g{g}", 100 + g, [Ticket(4 * g + i, both) for i in range(4)], None) for g in range(3)]
    results = asyncio.run(worker.run_groups(groups))
    assert [r.group_id for r in results[:2] if not isinstance(r, str)] == ["g0", "g1"]
    assert results[2] == "RuntimeError: buffer refused g2"  # the driver releases g2's tickets
    assert sorted(e.episode_id for e in buffer.episodes) == [f"g{g}-{i}" for g in (0, 1) for i in range(4)]
    # each group keeps its own seed (task) and its own group-relative signal
    assert all(
        len({e.metadata["target"] for e in buffer.episodes if e.metadata["group"] == g}) == 1
        for g in ("g0", "g1")
    )
    assert worker.stats().in_flight == 0


def test_debate_runs_three_agents_over_several_rounds(tmp_path: Any) -> None:
    from polyrl_runtime.workflows.debate import Debate

    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "2+3", "answer": "5"}\n')
    game = Debate(rounds=3, dataset=f"file://{data}")
    answers = iter(["4", "5", "5"])  # wrong first, fixed after the critique
    routes = {
        "proposer": {"p": FakeEngine(lambda p, s: TOK.encode(next(answers)))},
        "critic": {"c": FakeEngine(lambda p, s: TOK.encode("recheck"))},
        "judge": {"j": FakeEngine(lambda p, s: [TOK.token_id("y")])},
    }
    ctx = _ctx(routes)
    out = asyncio.run(game.run_episode(ctx))
    assert out.rewards == {"proposer": 1.0, "critic": 1.0, "judge": 1.0}
    assert out.metadata["first_right"] is False
    assert [t.agent for t in ctx.turns] == ["proposer", "critic", "proposer", "critic", "proposer", "judge"]
    with pytest.raises(ValueError, match="needs 'question' and 'answer'"):
        (tmp_path / "bad.jsonl").write_text('{"q": 1}\n')
        Debate(dataset=f"file://{tmp_path / 'bad.jsonl'}")


def test_guessing_gives_each_agent_its_own_reward() -> None:
    from polyrl_runtime.workflows.guessing import Guessing

    right = FakeEngine(lambda p, s: TOK.encode(str((int(TOK.decode(p)[-1]) + 1) % 4)))
    wrong = FakeEngine(lambda p, s: TOK.encode(TOK.decode(p)[-1]))
    out = asyncio.run(Guessing(agents=["a", "b"]).run_episode(_ctx({"a": {"e": right}, "b": {"e": wrong}})))
    assert out.rewards == {"a": 1.0, "b": 0.0} and out.metadata["success"] == 0.5
