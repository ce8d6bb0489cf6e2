"""An OpenAI-compatible HTTP endpoint per episode: agent frameworks that take a `base_url` (the OpenAI
Agents SDK, LangGraph, smolagents, AutoGen, CrewAI) run unchanged inside a polyrl episode, and every
call they make is an agent's chat call, traced into training.

    base_url = await ctx.openai_base_url("solver")      # this episode's agent solver
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    await client.chat.completions.create(model="solver", messages=history, tools=tools)

One server per workflow worker process (aiohttp, started at the first `openai_base_url`), on the
loopback (`POLYRL_ENDPOINT_HOST` to bind another address, such as the pod's), at a free port. Each
`openai_base_url` call opens a session whose random key is part of the URL
(`http://127.0.0.1:PORT/k/<key>/v1`): the key names the episode and the agents it may call, so the
framework's own HTTP client needs nothing but the URL (its API key is not read). The session ends
with the episode; a request with an unknown or ended key is refused (401), and the requests it was
still answering are cancelled (their engine requests aborted).

Routes: `GET /v1/models` (the agents of the session, by name) and `POST /v1/chat/completions`, which
is `OpenAIClient`'s `create` (workflows/openai_client.py) for the agent the request's `model` names:
messages, tools, tool_choice, temperature, max_tokens / max_completion_tokens, stop, `n` (each
completion a conversation of its own, so a sample of its own), `stream` (server-sent events of the
finished completion: the engine answers a generation whole). Anything else is refused with the
parameter named, never ignored.

Training: each completion is the agent's `chat` call, so a conversation the framework continues
(resending the history with the reply and new messages) is one training sequence built from the
sampled token ids, and a history that does not extend it (a rewritten or branched one) starts a new
sequence; never re-tokenised text. The calls of one agent are served one at a time, in arrival
order (a conversation is extended by one call at a time). A request that repeats one of the
session's earlier requests byte for byte (a framework's retry after a timeout) gets that request's
answer, awaited if still running, and is not trained twice.

Errors are OpenAI error objects (`{"error": {"message", "type", "param", "code"}}`) with its status
codes: 400 for a malformed or unsupported request (and a prompt longer than the context:
`context_length_exceeded`), 401 for a bad key, 404 for an unknown model or route, 503 when an engine
fails. An engine failure is also kept on the episode (`ctx.endpoint_errors`): an episode that then
fails is counted as `engine_error`, as if the workflow had called the agent itself.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web

from polyrl_runtime.engines.api import EngineUnavailableError, PromptTooLongError, RequestAbortedError
from polyrl_runtime.workflows.openai_client import ChatAgent, OpenAIClient, UnsupportedArgumentError

log = structlog.get_logger(__name__)

ENV_HOST = "POLYRL_ENDPOINT_HOST"
MAX_N = 16  # completions one request may ask for
_ENDED_KEPT = 4096  # ended keys remembered, to say so rather than "unknown key"


class EndpointError(Exception):
    """A request answered with an OpenAI error object."""

    def __init__(
        self, status: int, message: str, *, kind: str, code: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param

    def response(self) -> web.Response:
        body = {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status)


def _bad_request(message: str, *, param: str | None = None, code: str | None = None) -> EndpointError:
    return EndpointError(400, message, kind="invalid_request_error", param=param, code=code)


@dataclass
class Session:
    """One `openai_base_url` call's key: the episode, the agents by model name, and its requests."""

    episode: str
    agents: Mapping[str, ChatAgent]
    errors: list[BaseException]  # the episode's `endpoint_errors`
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    answers: dict[str, asyncio.Future[tuple[int, Any]]] = field(default_factory=dict)  # body digest ->
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)  # requests being answered
    requests: int = 0
    repeats: int = 0


class EndpointServer:
    """The worker process's endpoint: sessions by key, served by one aiohttp app."""

    def __init__(self, host: str | None = None) -> None:
        self.host = host or os.environ.get(ENV_HOST, "127.0.0.1")
        self.port = 0
        self.sessions: dict[str, Session] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # key -> its episode
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: asyncio.Lock | None = None

    async def start(self) -> None:
        """Listen (once per event loop: a server of a finished loop is started again)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._runner, self._starting = loop, None, asyncio.Lock()
        assert self._starting is not None
        async with self._starting:
            if self._runner is not None:
                return
            app = web.Application(client_max_size=64 * 2**20)
            app.router.add_get("/k/{key}/v1/models", self._models)
            app.router.add_post("/k/{key}/v1/chat/completions", self._completions)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
            sock.bind((self.host, 0))  # a free port, known before the site starts
            await web.SockSite(runner, sock).start()
            self.port = int(sock.getsockname()[1])
            self._runner = runner
            log.info("endpoint.listening", host=self.host, port=self.port)

    async def open(
        self, episode: str, agents: Mapping[str, ChatAgent], errors: list[BaseException]
    ) -> tuple[str, str]:
        """A session for `agents` (model name -> agent) of `episode`: its key and base URL."""
        await self.start()
        key = secrets.token_urlsafe(18)
        self.sessions[key] = Session(episode, dict(agents), errors)
        return key, f"http://{self.host}:{self.port}/k/{key}/v1"

    def close(self, key: str) -> None:
        """End a session: its key is refused from now on."""
        session = self.sessions.pop(key, None)
        if session is None:
            return
        ended = _error(
            f"episode {session.episode} has ended", "invalid_request_error", code="invalid_api_key"
        )
        for answer in session.answers.values():  # repeats still waiting are told
            if not answer.done():
                answer.set_result((401, ended))
        for task in session.tasks:  # and what is still generating stops: its engine requests abort
            task.cancel()
        self._ended[key] = session.episode
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)

    # -- routes --------------------------------------------------------------------------------

    def _session(self, request: web.Request) -> Session:
        key = request.match_info["key"]
        session = self.sessions.get(key)
        if session is not None:
            return session
        ended = self._ended.get(key)
        message = (
            f"episode {ended} has ended: its endpoint takes no more requests"
            if ended is not None
            else "unknown endpoint key: use the base URL ctx.openai_base_url returned, in the episode"
        )
        raise EndpointError(401, message, kind="invalid_request_error", code="invalid_api_key")

    async def _models(self, request: web.Request) -> web.Response:
        try:
            session = self._session(request)
        except EndpointError as e:
            return e.response()
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "polyrl"} for name in session.agents
        ]
        return web.json_response({"object": "list", "data": data})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session(request)
            raw = await request.read()
            body = _parse(raw)
        except EndpointError as e:
            return e.response()
        session.requests += 1
        digest = hashlib.sha256(raw).hexdigest()
        answer = session.answers.get(digest)
        if answer is not None:  # a retry of an earlier request: its answer, not a second sample
            session.repeats += 1
            log.info("endpoint.repeated_request", episode=session.episode, model=body.get("model"))
            status, payload = await asyncio.shield(answer)
        else:
            answer = asyncio.get_running_loop().create_future()
            session.answers[digest] = answer
            task = asyncio.current_task()
            assert task is not None
            session.tasks.add(task)
            try:
                status, payload = await self._answer(session, body)
            finally:
                session.tasks.discard(task)
            if status != 200:  # nothing was trained: a retry is served afresh
                session.answers.pop(digest, None)
            if not answer.done():
                answer.set_result((status, payload))
        if status != 200 or not body.get("stream"):
            return web.json_response(payload, status=status)
        return await _stream(request, payload, body)

    async def _answer(self, session: Session, body: dict[str, Any]) -> tuple[int, Any]:
        """(status, JSON body) of one chat completions request."""
        try:
            agent = _agent(session, body)
            args, n = _arguments(body)
            lock = session.locks.setdefault(agent.name, asyncio.Lock())
            async with lock:  # one call of an agent at a time: each may extend its conversation
                client = OpenAIClient(agent)
                completions = [await client.chat.completions.create(**args) for _ in range(n)]
        except EndpointError as e:
            return e.status, {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": e.code}}
        except UnsupportedArgumentError as e:
            return 400, _error(str(e), "invalid_request_error", param=_named_param(str(e)))
        except PromptTooLongError as e:
            return 400, _error(
                str(e), "invalid_request_error", code="context_length_exceeded", param="messages"
            )
        except (EngineUnavailableError, RequestAbortedError) as e:
            session.errors.append(e)
            log.warning("endpoint.engine_error", episode=session.episode, error=str(e))
            return 503, _error(str(e), "server_error", code="engine_unavailable")
        except ValueError as e:  # bad messages, a conversation's temperature changed, ...
            return 400, _error(str(e), "invalid_request_error")
        except Exception as e:  # the episode learns of it; the framework gets a server error
            session.errors.append(e)
            log.exception("endpoint.failed", episode=session.episode)
            return 500, _error(f"{type(e).__name__}: {e}", "server_error")
        first = completions[0].model_dump(exclude_none=True)
        first["choices"] = [
            {**c.model_dump(exclude_none=True)["choices"][0], "index": i} for i, c in enumerate(completions)
        ]
        usage = [c.usage for c in completions if c.usage is not None]
        if usage:
            first["usage"] = {
                "prompt_tokens": usage[0].prompt_tokens,
                "completion_tokens": sum(u.completion_tokens for u in usage),
                "total_tokens": usage[0].prompt_tokens + sum(u.completion_tokens for u in usage),
            }
        return 200, first

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


_PASSED = ("messages", "tools", "tool_choice", "temperature", "max_tokens", "max_completion_tokens", "stop")
# Accepted without effect on sampling (as the in-process client accepts them), or handled here.
_HANDLED = frozenset(
    {"model", "n", "stream", "stream_options", "user", "metadata", "store", "parallel_tool_calls"}
)


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise _bad_request("the request body must be a JSON object")
    return body


def _agent(session: Session, body: Mapping[str, Any]) -> ChatAgent:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad_request("model is required: the agent to call", param="model")
    agent = session.agents.get(model)
    if agent is None:
        raise EndpointError(
            404,
            f"the model {model!r} does not exist for episode {session.episode}: this endpoint serves "
            f"{', '.join(sorted(session.agents))}",
            kind="invalid_request_error",
            code="model_not_found",
            param="model",
        )
    return agent


def _arguments(body: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """`create`'s keyword arguments, and how many completions (`n`) to make."""
    unknown = sorted(set(body) - set(_PASSED) - _HANDLED)
    if unknown:
        raise _bad_request(
            f"unsupported parameter(s) {', '.join(unknown)} (supported: model, {', '.join(_PASSED)}, n, "
            "stream, stream_options)",
            param=unknown[0],
        )
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise _bad_request("messages must be a non-empty list", param="messages")
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise _bad_request(f"n must be an integer from 1 to {MAX_N}, got {n!r}", param="n")
    options = body.get("stream_options")
    if options is not None and (not body.get("stream") or not isinstance(options, dict)):
        raise _bad_request("stream_options needs stream: true and an object", param="stream_options")
    return {k: body[k] for k in _PASSED if body.get(k) is not None}, n


def _error(message: str, kind: str, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _named_param(message: str) -> str | None:
    """The parameter an `UnsupportedArgumentError` names (`name=value` or `argument(s) name`)."""
    for name in ("n", "stream", "tool_choice"):
        if f" {name}=" in message:
            return name
    return None


async def _stream(
    request: web.Request, completion: Mapping[str, Any], body: Mapping[str, Any]
) -> web.StreamResponse:
    """The completion as server-sent `chat.completion.chunk` events, then `[DONE]`."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    async for chunk in _chunks(completion, bool((body.get("stream_options") or {}).get("include_usage"))):
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _chunks(completion: Mapping[str, Any], usage: bool) -> AsyncIterator[dict[str, Any]]:
    base = {
        "id": completion["id"],
        "object": "chat.completion.chunk",
        "created": completion.get("created", int(time.time())),
        "model": completion["model"],
    }
    for choice in completion["choices"]:
        message = choice["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(message["tool_calls"])]
        yield {**base, "choices": [{"index": choice["index"], "delta": delta, "finish_reason": None}]}
        yield {
            **base,
            "choices": [{"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}],
        }
    if usage and "usage" in completion:
        yield {**base, "choices": [], "usage": completion["usage"]}


@functools.cache
def endpoint_server() -> EndpointServer:
    """The process's endpoint server (made at the first call)."""
    return EndpointServer()
