"""An OpenAI-compatible client for one agent: agent code written against the OpenAI API runs unchanged
inside a workflow, and what it generates is trained.

    client = ctx.openai("solver")
    completion = await client.chat.completions.create(messages=history, tools=tools, temperature=1.0)
    message = completion.choices[0].message          # openai.types.chat.ChatCompletionMessage
    history.append(message)                          # then tool results, and call again

Each `create` is the agent's `chat` call (workflows/chat.py): resending the history with the last
reply and new messages continues one conversation, trained as one sequence. The responses are the
`openai` SDK's own types (`ChatCompletion`, tool calls as `ChatCompletionMessageToolCall`), as
AReaL's `ArealOpenAI` does. Arguments a rollout cannot honour (`n` > 1, `stream`, ...) raise
`UnsupportedArgumentError` naming the argument instead of being silently ignored.

Tool calls are read by the one parser `agent.chat` uses (workflows/tools.py), so both classify a
reply alike. A malformed call is never returned as plain text: like the OpenAI API, which returns a
call's `arguments` as the model generated them and never parses them, the message lists every block
the model wrote as a tool call, with its `arguments` as the model wrote them (`json.loads` fails on
them when they are not JSON) and `finish_reason` "tool_calls". What is wrong is in the message's
extra field `tool_error` (and each malformed call's `error`), read with `tool_error(message)`.
The message is `reply.message` of `agent.chat`, so the next call's history continues the
conversation either way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionMessageToolCall
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_function_tool_call import Function
from openai.types.completion_usage import CompletionUsage

from polyrl_runtime.workflows.chat import ChatReply, Conversation


class ConversationLog(Protocol):
    """Each agent's latest conversation, by agent name (an `EpisodeContext`)."""

    @property
    def conversations(self) -> Mapping[str, Conversation]: ...


class ChatAgent(Protocol):
    """What the client serves completions from (a workflow's `Agent`): the agent's chat call and the
    log holding the conversation that call continued."""

    @property
    def name(self) -> str: ...

    @property
    def policy(self) -> str: ...

    @property
    def ctx(self) -> ConversationLog: ...

    async def chat(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        max_new_tokens: int | None = None,
        stop: Sequence[str] | None = None,
        temperature: float | None = None,
    ) -> ChatReply: ...


class UnsupportedArgumentError(ValueError):
    """A `create` argument the rollout cannot honour."""


# Accepted and ignored: they do not change what is sampled.
_IGNORED = frozenset({"model", "user", "metadata", "store", "parallel_tool_calls"})
# What `tool_choice` may be: what the model does with free sampling. Forcing a call ("required", a
# named function) needs constrained decoding, and "none" with tools offered needs the reply kept
# from being read as calls; neither is done, so both are refused rather than ignored.
_TOOL_CHOICES = (None, "auto")


def tool_error(message: ChatCompletionMessage) -> str | None:
    """Why the tool calls of a completion's message are malformed (None: they are well-formed, or
    there are none). The SDK's message has no such field: it is an extra one of this client."""
    error = (message.model_extra or {}).get("tool_error")
    return None if error is None else str(error)


def completion_of(reply: ChatReply, *, model: str, prompt_tokens: int, created: int) -> ChatCompletion:
    """The OpenAI `ChatCompletion` for one chat reply: the content and tool calls of `reply.message`."""
    calls = [
        ChatCompletionMessageToolCall(
            id=c.id,
            type="function",
            function=Function(name=c.name, arguments=c.arguments),
            **({"error": c.error} if c.error is not None else {}),
        )
        for c in reply.written_calls
    ]
    extra = {"tool_error": reply.tool_error} if reply.tool_error is not None else {}
    message = ChatCompletionMessage(
        role="assistant", content=reply.message["content"], tool_calls=calls or None, **extra
    )
    finish = "tool_calls" if calls else ("length" if reply.finish_reason == "length" else "stop")
    n = len(reply.token_ids)
    return ChatCompletion(
        id=f"chatcmpl-{model}-{created}-{prompt_tokens}-{n}",
        object="chat.completion",
        created=created,
        model=model,
        choices=[Choice(index=0, finish_reason=finish, message=message, logprobs=None)],
        usage=CompletionUsage(
            prompt_tokens=prompt_tokens, completion_tokens=n, total_tokens=prompt_tokens + n
        ),
    )


class _Completions:
    def __init__(self, agent: ChatAgent) -> None:
        self._agent = agent

    async def create(
        self,
        *,
        messages: Sequence[Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
        temperature: float | None = None,
        max_tokens: int | None = None,
        max_completion_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        n: int | None = None,
        stream: bool | None = None,
        tool_choice: Any = None,
        **other: Any,
    ) -> ChatCompletion:
        if n not in (None, 1):
            raise UnsupportedArgumentError(
                f"agent {self._agent.name!r}: n={n} is not supported (one completion per call; "
                "GRPO groups come from groupSize)"
            )
        if stream:
            raise UnsupportedArgumentError(f"agent {self._agent.name!r}: stream=True is not supported")
        if tool_choice not in _TOOL_CHOICES and not (tool_choice == "none" and not tools):
            raise UnsupportedArgumentError(
                f"agent {self._agent.name!r}: tool_choice={tool_choice!r} is not supported (the model "
                "chooses whether to call a tool: 'auto', the default; 'none' only without tools)"
            )
        unknown = sorted(set(other) - _IGNORED)
        if unknown:
            raise UnsupportedArgumentError(
                f"agent {self._agent.name!r}: unsupported argument(s) {', '.join(unknown)} "
                "(supported: messages, tools, tool_choice, temperature, max_tokens, max_completion_tokens, stop)"
            )
        reply = await self._agent.chat(
            messages,
            tools=tools,
            temperature=temperature,
            max_new_tokens=max_completion_tokens or max_tokens,
            stop=[stop] if isinstance(stop, str) else stop,
        )
        conv = self._agent.ctx.conversations[self._agent.name]
        prompt_tokens = len(conv.sequence()) - len(reply.token_ids)
        return completion_of(
            reply, model=self._agent.policy, prompt_tokens=prompt_tokens, created=int(time.time())
        )


class _Chat:
    def __init__(self, agent: ChatAgent) -> None:
        self.completions = _Completions(agent)


class OpenAIClient:
    """`client.chat.completions.create(...)` as in `openai.AsyncOpenAI`, served by one agent."""

    def __init__(self, agent: ChatAgent) -> None:
        self.agent = agent
        self.chat = _Chat(agent)
