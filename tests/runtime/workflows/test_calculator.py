"""The calculator workflow: one episode on the real torch engine is ONE sample (two sampled replies
around the tool's result). The shipped example trains it under `polyrl run`
(tests/runtime/local/test_examples_learn.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.engines.pool import EnginePool
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.models import load_tokenizer
from polyrl_runtime.workflows.api import EpisodeContext
from polyrl_runtime.workflows.calculator import Calculator
from polyrl_runtime.workflows.tools import ToolCall, run_calculator
from polyrl_testenv.inprocess import engine_routes


class _Method:
    def __init__(self, fn: Callable[..., Awaitable[Any]]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Awaitable[Any]:
        return self.fn(*args)


def test_an_episode_is_one_sample_with_the_tool_result_as_context(tiny_qwen2_dir: Path) -> None:
    uri = f"file://{tiny_qwen2_dir}"
    engine = TorchEngine("e0", "solver", uri, transport="shm", seed=1, dtype="float32")
    handle = type("H", (), {"generate": _Method(engine.generate)})()

    async def go() -> None:
        ctx = EpisodeContext(
            "ep-1",
            "g-1",
            0,
            7,
            EnginePool(engine_routes({"solver": {"e0": handle}})),
            {"solver": load_tokenizer(uri)},
            {"solver": SamplingParams(temperature=1.0, max_new_tokens=4)},
        )
        outcome = await Calculator().run_episode(ctx)
        [turn] = ctx.turns
        mask = turn.loss_mask
        assert mask[0] and mask[-1] and not mask.all()  # reply, context, reply
        tok = load_tokenizer(uri)
        context = tok.decode(turn.response_ids[~mask].tolist(), skip_special=False)
        assert "<|im_start|>tool\n" in context and context.endswith("<|im_start|>assistant\n")
        assert set(outcome.returns()) == {"solver"} and len(outcome.turn_rewards["solver"]) == 2

    asyncio.run(go())


@pytest.mark.parametrize(
    ("expression", "content", "ok"),
    [
        ("3+4", "7", True),
        ("2*3-1", "5", True),
        ("3++", "error: not an expression: '3++'", False),
        ("__import__('os')", "error: unsupported element Call", False),
        ("9" * 13 + "*9", "error: result exceeds", False),
    ],
)
def test_calculator_tool(expression: str, content: str, ok: bool) -> None:
    result = run_calculator(ToolCall("c0", "calculator", {"expression": expression}))
    assert result.ok is ok and result.content.startswith(content)
    assert result.message() == {"role": "tool", "tool_call_id": "c0", "content": result.content}
