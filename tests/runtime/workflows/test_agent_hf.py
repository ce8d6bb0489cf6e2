"""`Agent.generate` and `Agent.chat_prompt` with a Hugging Face policy served by the real torch engine
(in process): the model's end ids stop a reply, stop strings of several tokens end it and are cut
from the text but not from the trained tokens, and chat prompts use the model's template."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import transformers

from polyrl_runtime.engines.api import PromptTooLongError
from polyrl_testenv.inprocess import solver_context
from polyrl_testenv.models import lively_qwen2


@pytest.fixture(scope="module")
def lively_dir(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 with larger random weights, so greedy replies vary from token to token."""
    return lively_qwen2(tiny_qwen2_dir, tmp_path_factory.mktemp("agent-hf") / "m", seed=5)


def test_stop_strings_cut_the_text_and_keep_the_trained_tokens(lively_dir: Path) -> None:
    uri = f"file://{lively_dir}"

    async def go() -> None:
        ctx = solver_context(uri, max_new_tokens=12)
        agent = ctx.agent("solver")
        free = await agent.generate("the answer is")
        assert free.finish_reason == "length" and len(free.token_ids) == 12
        # A stop string spanning the 4th..6th generated tokens (greedy: the same reply again).
        tok = agent.tokenizer
        head, span = tok.decode(free.token_ids[:3]), tok.decode(free.token_ids[3:6])
        assert span.strip() and len(free.token_ids[3:6]) == 3
        stopped = await agent.generate("the answer is", stop=[span])
        assert stopped.finish_reason == "stop"
        assert stopped.text == head and stopped.token_ids == free.token_ids[:6]
        kept = await agent.generate("the answer is", stop=[span], include_stop=True)
        assert kept.text == head + span
        # Every generated token is in the turns the trainer gets, the stop string's included.
        assert [len(t.response_ids) for t in ctx.turns] == [12, 6, 6]

    asyncio.run(go())


def test_chat_prompts_use_the_template_and_end_ids_stop_replies(lively_dir: Path) -> None:
    uri = f"file://{lively_dir}"

    async def go() -> None:
        ctx = solver_context(uri, max_new_tokens=40)
        agent = ctx.agent("solver")
        ids = agent.chat_prompt([{"role": "user", "content": "see:3"}])
        hf = transformers.AutoTokenizer.from_pretrained(str(lively_dir))
        assert ids == hf.apply_chat_template(
            [{"role": "user", "content": "see:3"}], add_generation_prompt=True, return_dict=False
        )
        # Force an end id as the first reply token: generation stops right there.
        eos = agent.tokenizer.stop_ids[0]
        reply = await agent.generate(ids, allowed=[eos, *agent.tokenizer.encode("abc")], temperature=0.0)
        ended = [i for i, t in enumerate(reply.token_ids) if t in agent.tokenizer.stop_ids]
        assert reply.finish_reason == "stop" and ended == [len(reply.token_ids) - 1]

    asyncio.run(go())


def test_a_prompt_too_long_names_the_agent_and_the_lengths(lively_dir: Path) -> None:
    uri = f"file://{lively_dir}"

    async def go() -> None:
        agent = solver_context(uri, max_new_tokens=12).agent("solver")
        with pytest.raises(
            PromptTooLongError, match=r"agent solver \(policy solver\): a prompt of 2100 tokens"
        ):
            await agent.generate([5] * 2100)

    asyncio.run(go())
