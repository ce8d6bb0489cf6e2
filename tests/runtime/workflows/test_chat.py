"""`Agent.chat` and the OpenAI-compatible client with a Hugging Face policy served by the real torch
engine (in process): replies come back as text and parsed tool calls; a conversation over several
calls is one turn whose ids are exactly the sampled ids and the template's context ids, with loss
mask, logprobs and versions on the sampled ids only; a template that is not prefix-stable is refused
naming the agent."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from openai.types.chat import ChatCompletion, ChatCompletionMessageToolCall

from polyrl_runtime.algorithms.losses import TokenBatch, sequence_logprobs
from polyrl_runtime.experience.types import CONTEXT
from polyrl_runtime.workflows.chat import TemplatePrefixError
from polyrl_runtime.workflows.openai_client import UnsupportedArgumentError
from polyrl_runtime.workflows.tools import CALCULATOR
from polyrl_testenv.inprocess import solver_context
from polyrl_testenv.models import lively_qwen2

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>'
QUESTION = [{"role": "user", "content": "what is 3+4?"}]


def _save(model: Any, tok: Any, out: Path) -> Path:
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def lively_dir(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 with larger random weights, so greedy replies vary from token to token."""
    return lively_qwen2(tiny_qwen2_dir, tmp_path_factory.mktemp("chat") / "lively", seed=5)


@pytest.fixture(scope="module")
def caller_dir(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 fitted (a few hundred Adam steps) to answer QUESTION, with the calculator's
    schema in the prompt, with a calculator call."""
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_qwen2_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32)
    prompt = tok.apply_chat_template(
        QUESTION, tools=[CALCULATOR], add_generation_prompt=True, return_dict=False
    )
    target = [*tok.encode(CALL, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    ids = torch.tensor([prompt + target])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        loss = model(ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if float(loss) < 1e-3:
            break
    return _save(model, tok, tmp_path_factory.mktemp("chat") / "caller")


def test_chat_returns_the_reply_text(lively_dir: Path) -> None:
    async def go() -> None:
        ctx = solver_context(f"file://{lively_dir}", max_new_tokens=8)
        agent = ctx.agent("solver")
        reply = await agent.chat(QUESTION)
        assert reply.finish_reason == "length" and len(reply.token_ids) == 8
        assert reply.text == agent.tokenizer.decode(reply.token_ids) and reply.text
        assert reply.tool_calls == () and reply.tool_error is None
        assert reply.message == {"role": "assistant", "content": reply.text}
        [turn] = ctx.turns
        assert turn.prompt_ids.tolist() == agent.chat_prompt(QUESTION)
        assert turn.loss_mask.all()  # a single reply: every response token was sampled

    asyncio.run(go())


@pytest.mark.parametrize("stop_first", [False, True], ids=["cut-by-length", "ended-by-eos"])
def test_a_conversation_with_a_tool_result_is_one_sequence(lively_dir: Path, stop_first: bool) -> None:
    uri = f"file://{lively_dir}"
    hf = transformers.AutoTokenizer.from_pretrained(str(lively_dir))
    # The first reply either runs to the length limit or is the end id alone (the only allowed id).
    allowed = [hf.convert_tokens_to_ids("<|im_end|>")] if stop_first else None

    async def go() -> None:
        ctx = solver_context(uri, max_new_tokens=8, temperature=1.0)
        agent = ctx.agent("solver")
        first = await agent.chat(QUESTION, allowed=allowed)  # sampled
        history = [*QUESTION, first.message, {"role": "tool", "content": "7"}]
        second = await agent.chat(history, allowed=allowed)  # one conversation: one temperature
        assert first.finish_reason == ("stop" if stop_first else "length")
        [turn] = ctx.turns  # one sample for the whole conversation
        assert turn.temperature == 1.0
        # What the template puts between the first reply and the second: the closing of the reply
        # (its end id only when the model did not sample it), the tool message, the generation prompt.
        closing = "\n" if stop_first else "<|im_end|>\n"
        context = hf.encode(f"{closing}<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n")
        assert turn.prompt_ids.tolist() == hf.apply_chat_template(
            QUESTION, add_generation_prompt=True, return_dict=False
        )
        assert turn.response_ids.tolist() == first.token_ids + context + second.token_ids
        sampled = [True] * len(first.token_ids) + [False] * len(context) + [True] * len(second.token_ids)
        assert turn.loss_mask.tolist() == sampled
        assert (turn.versions[~turn.loss_mask] == CONTEXT).all() and (
            turn.versions[turn.loss_mask] == -1
        ).all()
        assert (turn.logprobs[~turn.loss_mask] == 0).all()
        if not stop_first:  # sampled from the whole vocabulary at temperature 1
            assert (turn.logprobs[: len(first.token_ids)] < 0).all()
        # Both replies were sampled from exactly that sequence: scoring it as the trainer does gives
        # the behaviour logprob of every sampled id.
        model = transformers.AutoModelForCausalLM.from_pretrained(str(lively_dir), dtype=torch.float32)
        tb = TokenBatch.build(
            [turn.prompt_ids], [turn.response_ids], [turn.allowed_ids], [turn.loss_mask], [turn.temperature]
        )
        with torch.no_grad():
            scored = sequence_logprobs(model, tb)[0].numpy()
        np.testing.assert_allclose(
            scored[turn.loss_mask], turn.logprobs[turn.loss_mask], rtol=1e-4, atol=1e-4
        )

    asyncio.run(go())


def test_a_history_that_does_not_extend_the_conversation_starts_a_new_one(lively_dir: Path) -> None:
    async def go() -> None:
        ctx = solver_context(f"file://{lively_dir}", max_new_tokens=3)
        agent = ctx.agent("solver")
        first = await agent.chat(QUESTION)
        await agent.chat([{"role": "user", "content": "another task"}])
        await agent.chat(
            [*QUESTION, {"role": "assistant", "content": "edited"}, {"role": "user", "content": "?"}]
        )
        await agent.chat([*QUESTION, first.message], new_conversation=True)
        assert len(ctx.turns) == 4 and all(t.loss_mask.all() for t in ctx.turns)

    asyncio.run(go())


def test_a_template_that_is_not_prefix_stable_is_refused_naming_the_agent(
    lively_dir: Path, tmp_path: Path
) -> None:
    # A real template that hides earlier assistant replies once the conversation goes on.
    tok = transformers.AutoTokenizer.from_pretrained(str(lively_dir))
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    out = _save(transformers.AutoModelForCausalLM.from_pretrained(str(lively_dir)), tok, tmp_path / "m")

    async def go() -> None:
        agent = solver_context(f"file://{out}", max_new_tokens=8).agent("solver")
        first = await agent.chat(QUESTION)
        with pytest.raises(
            TemplatePrefixError, match=r"agent 'solver' \(policy 'solver'\).*not prefix-stable"
        ):
            await agent.chat([*QUESTION, first.message, {"role": "user", "content": "and?"}])

    asyncio.run(go())


def test_a_conversation_keeps_one_decoding_constraint(lively_dir: Path) -> None:
    async def go() -> None:
        agent = solver_context(f"file://{lively_dir}", max_new_tokens=2).agent("solver")
        first = await agent.chat(QUESTION, allowed=["1", "2"])
        with pytest.raises(ValueError, match="agent 'solver': every chat call of one conversation"):
            await agent.chat([*QUESTION, first.message, {"role": "user", "content": "?"}], allowed=["3"])

    asyncio.run(go())


def test_tool_calls_come_back_parsed_and_as_openai_types(caller_dir: Path) -> None:
    async def go() -> None:
        ctx = solver_context(f"file://{caller_dir}", max_new_tokens=100)
        reply = await ctx.agent("solver").chat(QUESTION, tools=[CALCULATOR])
        assert reply.raw_text == CALL and reply.finish_reason == "stop"
        [call] = reply.tool_calls
        assert (call.name, call.arguments) == ("calculator", {"expression": "3+4"})
        # The same through the OpenAI client (a new episode: the same greedy reply).
        client = solver_context(f"file://{caller_dir}", max_new_tokens=100).openai("solver")
        completion = await client.chat.completions.create(
            messages=QUESTION, tools=[CALCULATOR], temperature=0.0
        )
        assert isinstance(completion, ChatCompletion)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""
        [tc] = choice.message.tool_calls or []
        assert isinstance(tc, ChatCompletionMessageToolCall)
        assert tc.function.name == "calculator" and json.loads(tc.function.arguments) == {"expression": "3+4"}
        assert completion.usage is not None and completion.usage.completion_tokens == len(reply.token_ids)

    asyncio.run(go())


def test_openai_client_continues_the_conversation_with_sdk_messages(lively_dir: Path) -> None:
    async def go() -> None:
        ctx = solver_context(f"file://{lively_dir}", max_new_tokens=4)
        client = ctx.openai("solver")
        first = await client.chat.completions.create(messages=QUESTION, max_tokens=3)
        assert first.choices[0].finish_reason == "length" and first.usage is not None
        assert first.usage.completion_tokens == 3
        history = [*QUESTION, first.choices[0].message, {"role": "user", "content": "sure?"}]
        await client.chat.completions.create(
            messages=history, max_tokens=3, stop=["\n\n"], tool_choice="auto"
        )
        [turn] = ctx.turns
        assert int(turn.loss_mask.sum()) == 6 and not turn.loss_mask.all()

    asyncio.run(go())


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"n": 2}, "n=2"),
        ({"stream": True}, "stream=True"),
        ({"logit_bias": {}}, "logit_bias"),
        ({"tool_choice": "required"}, "tool_choice='required'"),
        ({"tool_choice": {"type": "function", "function": {"name": "calc"}}}, "tool_choice=.*calc"),
        ({"tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f"}}]}, "'none' only"),
    ],
)
def test_openai_client_refuses_what_it_cannot_honour(
    lively_dir: Path, kwargs: dict[str, Any], named: str
) -> None:
    async def go() -> None:
        client = solver_context(f"file://{lively_dir}", max_new_tokens=8).openai("solver")
        with pytest.raises(UnsupportedArgumentError, match=rf"agent 'solver': .*{named}"):
            await client.chat.completions.create(messages=QUESTION, **kwargs)

    asyncio.run(go())


def test_turn_loss_mask_ignores_nothing_for_single_replies() -> None:
    from polyrl_runtime.experience.types import Turn

    t = Turn("a", "p", np.array([1]), np.array([2, 3]), np.array([-0.1, -0.2]), np.array([4, 5]))
    assert t.loss_mask.tolist() == [True, True] and t.min_version == 4
