"""The built-in tiny Qwen2's chat template: with `tools` it renders a system block listing each
tool's JSON schema (Qwen2.5's layout), without them plain ChatML (so token counts of tool-less chats
do not change), and a cached model directory of an older build is rebuilt, not reused."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from polyrl_runtime.models import load_tokenizer
from polyrl_runtime.models.tiny_qwen2 import BUILD, materialise
from polyrl_runtime.workflows.tools import CALCULATOR

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}
QUESTION = [{"role": "user", "content": "compute 3+4"}]


def _render(model_dir: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    tok = load_tokenizer(f"file://{model_dir}")
    return tok.decode(tok.apply_chat_template(messages, tools=tools), skip_special=False)


def test_tools_are_listed_in_a_system_block(tiny_qwen2_dir: Path) -> None:
    text = _render(tiny_qwen2_dir, QUESTION, [CALCULATOR, SEARCH])
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n# Tools\n\n<tools>\n")
    listed = re.search(r"<tools>\n(.*)\n</tools>", system, re.DOTALL)
    assert listed is not None
    assert [json.loads(line) for line in listed.group(1).splitlines()] == [CALCULATOR, SEARCH]
    # the format the parser reads (workflows/tools.py)
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert rest == "<|im_start|>user\ncompute 3+4<|im_end|>\n<|im_start|>assistant\n"


def test_a_leading_system_message_opens_the_tools_block(tiny_qwen2_dir: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION]
    text = _render(tiny_qwen2_dir, messages, [CALCULATOR])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n<tools>\n")
    assert text.count("<|im_start|>system") == 1 and text.count("Be brief.") == 1


@pytest.mark.parametrize("tools", [None, []])
def test_without_tools_the_rendering_is_plain_chatml(tiny_qwen2_dir: Path, tools: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION]
    assert _render(tiny_qwen2_dir, messages, tools) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\ncompute 3+4<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_conversation_with_tools_renders_prefix_stably(tiny_qwen2_dir: Path) -> None:
    # what agent.chat needs to continue a conversation as one sequence (workflows/chat.py)
    tok = load_tokenizer(f"file://{tiny_qwen2_dir}")
    history = [*QUESTION, {"role": "assistant", "content": "3+4"}]
    before = tok.apply_chat_template(history, tools=[CALCULATOR], add_generation_prompt=False)
    after = tok.apply_chat_template(
        [*history, {"role": "tool", "content": "7"}], tools=[CALCULATOR], add_generation_prompt=True
    )
    assert after[: len(before)] == before


def test_a_cached_directory_of_an_older_build_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_qwen2_dir: Path
) -> None:
    monkeypatch.setenv("POLYRL_CACHE", str(tmp_path))
    stale = tmp_path / "models" / f"tiny-qwen2-b{BUILD - 1}"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # an earlier build, whose template ignored tools
    path = materialise("tiny-qwen2")
    assert path.name == f"tiny-qwen2-b{BUILD}" and path != stale
    assert _render(path, QUESTION, [CALCULATOR]) == _render(tiny_qwen2_dir, QUESTION, [CALCULATOR])
