"""Conversations: several `agent.chat` calls of one agent as ONE training sequence.

How a conversation is delimited: an agent keeps its latest conversation for the episode, and a
`chat(messages)` call continues it when `messages` starts with the messages of that conversation so
far (the previous call's messages plus the assistant reply it returned, compared by role and
content) and adds at least one, with the same tools. Anything else (another first message, a
shortened history, `new_conversation=True`) starts a new conversation, which is a sample of its own.
This is the OpenAI calling convention (the caller resends the whole history), so code written against
the OpenAI API continues conversations without knowing about them.

The sequence is built from token ids, never from decoded text: the first call's prompt is the chat
template's rendering of its messages; each reply appends the ids that were sampled (loss mask 1,
their behaviour logprobs and versions); a continuing call appends the context ids of what came since
(mask 0, version CONTEXT: experience/types.py). Those come from the template itself: the ids of the whole conversation
rendered with a generation prompt, minus the ids of the conversation up to the last assistant reply
(which must be a prefix of them: a template that renders earlier messages differently once more
follow, e.g. one that drops earlier reasoning, is refused with `TemplatePrefixError`). Between the
sampled ids and those context ids goes the template's closing of an assistant message (e.g.
`<|im_end|>` and a newline): the part the model did not sample itself, all of it if the reply was cut
by the length limit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polyrl_runtime.engines.api import Generation
from polyrl_runtime.experience.types import CONTEXT, Turn
from polyrl_runtime.models import Tokenizer
from polyrl_runtime.workflows.tools import ParsedReply, ReplyKind, ToolCall, WrittenCall, reply_kind


class TemplatePrefixError(ValueError):
    """The chat template does not render a conversation so far as a prefix of its continuation."""


def normalise(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as plain dicts: pydantic objects (the openai SDK's message types) are dumped."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        m = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else message
        if not isinstance(m, Mapping) or "role" not in m:
            raise ValueError(f"message {i} is not a mapping with a 'role': {m!r}")
        out.append(dict(m))
    return out


def _key(message: Mapping[str, Any]) -> tuple[str, str]:
    return str(message["role"]), str(message.get("content") or "")


@dataclass
class Conversation:
    """One agent's conversation so far: the messages it has seen and the sequence built from them."""

    agent: str
    policy: str
    messages: list[dict[str, Any]]  # up to and including the last assistant reply
    tools: list[dict[str, Any]] | None
    allowed_ids: tuple[int, ...]
    temperature: float  # every call's sampling temperature (one sequence is scored at one)
    turn_index: int  # where its Turn is in the episode's turns
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    ended_with_stop: bool = False

    def continued_by(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None) -> bool:
        n = len(self.messages)
        if len(messages) <= n or (list(tools) if tools else None) != self.tools:
            return False
        return all(_key(a) == _key(b) for a, b in zip(messages[:n], self.messages, strict=True))

    def sequence(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def turn(self) -> Turn:
        return Turn(
            agent=self.agent,
            policy=self.policy,
            prompt_ids=np.asarray(self.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(self.response_ids, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int32),
            allowed_ids=np.asarray(self.allowed_ids, dtype=np.int32),
            temperature=self.temperature,
        )


def context_ids(
    tok: Tokenizer, conv: Conversation, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None
) -> list[int]:
    """The ids that follow `conv`'s sampled ids when it continues with `messages` (see module doc)."""
    n = len(conv.messages)
    where = f"agent {conv.agent!r} (policy {conv.policy!r})"
    before = tok.apply_chat_template(messages[:n], tools=tools, add_generation_prompt=False)
    full = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    if full[: len(before)] != before:
        raise TemplatePrefixError(
            f"{where}: the chat template renders the first {n} messages differently once more follow "
            "(it is not prefix-stable), so the conversation cannot continue as one training sequence; "
            "start a new one (chat(..., new_conversation=True)) or use a template that keeps history as is"
        )
    stops = set(tok.stop_ids)
    ends = [i for i, t in enumerate(before) if t in stops]
    if not ends:
        raise TemplatePrefixError(
            f"{where}: the chat template does not close assistant messages with an end id "
            f"{sorted(stops)}; cannot tell where the sampled reply ends in the conversation"
        )
    closing = before[ends[-1] :]
    glue = closing[1:] if conv.ended_with_stop else closing
    return glue + full[len(before) :]


def extended(conv: Conversation, context: Sequence[int], gen: Generation, stop_ids: Sequence[int]) -> None:
    """Append `context` (mask 0) then the sampled `gen` (mask 1) to the conversation's sequence."""
    sampled = gen.token_ids.tolist()
    conv.response_ids += [*context, *sampled]
    conv.logprobs += [0.0] * len(context) + gen.logprobs.tolist()
    conv.versions += [CONTEXT] * len(context) + gen.versions.tolist()
    conv.ended_with_stop = bool(sampled) and sampled[-1] in set(stop_ids)


@dataclass(frozen=True)
class ChatReply:
    """The assistant message of one `chat` call.

    `text`: the reply without tool-call blocks (the whole reply when none were asked for, or when
    they did not parse: then `tool_error` says why); `tool_calls`: the parsed calls (with tools only);
    `written_calls`: every block as the model wrote it, malformed ones too (what the OpenAI client
    returns as `tool_calls`); `content`: the reply without its blocks, also when they did not parse;
    `token_ids`: the ids sampled in this call; `finish_reason`: "stop" or "length"."""

    text: str
    token_ids: list[int]
    finish_reason: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_error: str | None = None
    raw_text: str = ""
    written_calls: tuple[WrittenCall, ...] = ()
    content: str | None = None  # None: `text`

    @classmethod
    def of(cls, raw: str, ids: list[int], finish: str, parsed: ParsedReply | None) -> ChatReply:
        if parsed is None:
            return cls(raw, ids, finish, raw_text=raw)
        return cls(
            parsed.content, ids, finish, parsed.tool_calls, parsed.error, raw, parsed.written, parsed.outside
        )

    @property
    def kind(self) -> ReplyKind:
        """How the reply reads (workflows/tools.py): plain text, tool calls, or a malformed call."""
        return reply_kind(self.tool_calls, self.tool_error)

    @property
    def message(self) -> dict[str, Any]:
        """The reply as an assistant message to append to the history for the next call, in OpenAI's
        form: the text outside the tool-call blocks and every block as written (a malformed one too,
        so the history shows the call the model made and the tool's answer to it can follow)."""
        m: dict[str, Any] = {
            "role": "assistant",
            "content": self.text if self.content is None else self.content,
        }
        if self.written_calls:
            m["tool_calls"] = [c.as_openai() for c in self.written_calls]
        return m
