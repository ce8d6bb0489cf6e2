"""Per-call temperatures: `generate`, `chat` and the OpenAI client record the temperature a call
sampled at (its own, else its policy's) on the turn, and scoring the turn at it, as the trainer does,
gives back the engine's behaviour logprobs; a conversation samples at one temperature."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from polyrl_runtime.algorithms.losses import TokenBatch, sequence_logprobs
from polyrl_runtime.experience.types import Turn
from polyrl_testenv.inprocess import solver_context
from polyrl_testenv.models import lively_qwen2

QUESTION = [{"role": "user", "content": "what is 3+4?"}]
POLICY_TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def lively_dir(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 with larger random weights: its distributions are far from uniform, so the
    temperature changes every logprob noticeably."""
    return lively_qwen2(tiny_qwen2_dir, tmp_path_factory.mktemp("temperature") / "lively", seed=5)


def _scored(model_dir: Path, turn: Turn, temperature: float | None = None) -> np.ndarray:
    """The turn's sampled-token logprobs as the trainer computes them: at the turn's temperature
    (`temperature`: at that one instead)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    temps = [turn.temperature if temperature is None else temperature]
    tb = TokenBatch.build([turn.prompt_ids], [turn.response_ids], [turn.allowed_ids], [turn.loss_mask], temps)
    with torch.no_grad():
        # The call's temperature (99) is only for rows without one: this row has its own.
        lp = sequence_logprobs(model, tb, 99.0)[0].numpy()
    return np.asarray(lp[turn.loss_mask])


def _assert_on_policy(model_dir: Path, turn: Turn) -> None:
    behaviour = turn.logprobs[turn.loss_mask]
    np.testing.assert_allclose(_scored(model_dir, turn), behaviour, rtol=1e-4, atol=1e-4)
    # At the policy's temperature instead (what the trainer did before): another distribution.
    assert np.abs(_scored(model_dir, turn, POLICY_TEMPERATURE) - behaviour).max() > 1e-2


def test_generate_records_the_calls_temperature(lively_dir: Path) -> None:
    async def go() -> None:
        ctx = solver_context(f"file://{lively_dir}", max_new_tokens=6, temperature=POLICY_TEMPERATURE)
        agent = ctx.agent("solver")
        await agent.generate("question: 3+4=")
        await agent.generate("question: 3+4=", temperature=0.4)
        await agent.generate("question: 3+4=", temperature=0)  # greedy
        default, own, greedy = ctx.turns
        assert (default.temperature, own.temperature, greedy.temperature) == (POLICY_TEMPERATURE, 0.4, 0.0)
        _assert_on_policy(lively_dir, own)
        np.testing.assert_allclose(_scored(lively_dir, default), default.logprobs, rtol=1e-4, atol=1e-4)

    asyncio.run(go())


def test_chat_and_the_openai_client_record_the_calls_temperature(lively_dir: Path) -> None:
    async def go() -> None:
        ctx = solver_context(f"file://{lively_dir}", max_new_tokens=4, temperature=POLICY_TEMPERATURE)
        agent = ctx.agent("solver")
        first = await agent.chat(QUESTION, temperature=0.5)
        await agent.chat([*QUESTION, first.message, {"role": "user", "content": "sure?"}], temperature=0.5)
        [conversation] = ctx.turns  # two calls, one turn at their one temperature
        assert conversation.temperature == 0.5 and not conversation.loss_mask.all()
        _assert_on_policy(lively_dir, conversation)

        other = solver_context(f"file://{lively_dir}", max_new_tokens=4, temperature=POLICY_TEMPERATURE)
        await other.openai("solver").chat.completions.create(messages=QUESTION, temperature=0.3)
        [turn] = other.turns
        assert turn.temperature == 0.3
        _assert_on_policy(lively_dir, turn)

    asyncio.run(go())


def test_a_conversations_calls_must_share_one_temperature(lively_dir: Path) -> None:
    async def go() -> None:
        ctx = solver_context(f"file://{lively_dir}", max_new_tokens=2, temperature=POLICY_TEMPERATURE)
        agent = ctx.agent("solver")
        first = await agent.chat(QUESTION, temperature=0.7)
        history = [*QUESTION, first.message, {"role": "user", "content": "?"}]
        with pytest.raises(
            ValueError,
            match=r"agent 'solver': every chat call of one conversation must sample at the same "
            r"temperature .*this call's is 1\.0, the conversation's 0\.7",
        ):
            await agent.chat(history)  # the policy's temperature, not the conversation's
        assert len(ctx.turns) == 1 and ctx.turns[0].temperature == 0.7  # nothing sampled or recorded
        await agent.chat(history, temperature=0.7)  # the same one continues it
        await agent.chat(history, new_conversation=True)  # a new conversation may change it
        assert [t.temperature for t in ctx.turns] == [0.7, POLICY_TEMPERATURE]
        for bad in (float("nan"), -0.5):  # refused before anything is sampled
            with pytest.raises(ValueError, match="agent 'solver': temperature must be finite and >= 0"):
                await agent.generate("3+4=", temperature=bad)
        assert len(ctx.turns) == 2

    asyncio.run(go())
