"""The workflow API: a multi-agent episode program, named in the job by an import path `module:attr`.

    class MyGame(Workflow):
        def __init__(self, rounds: int = 1, **args): ...
        async def run_episode(self, ctx: EpisodeContext) -> dict[str, float]:
            alice, bob = ctx.agent("alice"), ctx.agent("bob")
            a = await alice.generate("question: ...")
            b = await bob.generate(f"answer to {a.text}:")
            return {"alice": 1.0, "bob": 0.0}          # one reward per agent that acted

Agents talk in text with `agent.chat(messages, tools=...)` (the chat template, tool calls and
conversations over several calls as one training sequence: workflows/chat.py), through an
OpenAI-compatible client (`ctx.openai(name)`), or with raw prompts via `agent.generate`.

Agents are called by name; an agent acts with the policy of the same name unless the job's
`workflow.args.policies` maps it to another (several agents may share one policy). Every call is
recorded as a turn (prompt ids, response ids, behaviour logprobs, versions), any number of turns per
agent and any number of agents. Episodes of one GRPO group share `ctx.seed`, so use `ctx.rng` to
draw the task: every member of the group then plays the same task.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from polyrl_runtime.engines.api import Generation, PromptTooLongError, SamplingParams
from polyrl_runtime.engines.pool import EnginePool
from polyrl_runtime.experience.types import Turn
from polyrl_runtime.models import Tokenizer
from polyrl_runtime.rewards.load import ImportPathError, RewardError, import_object, score
from polyrl_runtime.workflows.chat import ChatReply, Conversation, context_ids, extended, normalise
from polyrl_runtime.workflows.opponents import OpponentTable, draw
from polyrl_runtime.workflows.tools import parse_tool_calls

if TYPE_CHECKING:
    from polyrl_runtime.workflows.openai_client import OpenAIClient


class WorkflowImportError(ImportError):
    """The entrypoint cannot be imported or is not a workflow class (`field` "entrypoint"), or it
    cannot be created with the job's args (`field` "args"); `reason` says why."""

    def __init__(self, entrypoint: str, reason: str, *, field: str = "entrypoint") -> None:
        super().__init__(f"workflow entrypoint {entrypoint!r}: {reason}")
        self.entrypoint, self.reason, self.field = entrypoint, reason, field


class Workflow:
    """Base class (optional: any class with an async `run_episode(ctx)` works)."""

    def __init__(self, **args: Any) -> None:
        if args:
            raise TypeError(f"{type(self).__name__} got unexpected workflow args: {sorted(args)}")

    async def run_episode(self, ctx: EpisodeContext) -> Mapping[str, float] | Outcome:
        raise NotImplementedError


class _WorkflowLike(Protocol):
    async def run_episode(self, ctx: EpisodeContext) -> Mapping[str, float] | Outcome: ...


@dataclass
class Outcome:
    """A richer return value: per-agent rewards, optional per-turn rewards, free-form metadata (kept
    with the episode).

    `turn_rewards[agent]`: rewards for that agent's chat calls (or `generate` turns), in order. They
    are summed into the agent's episode return (`returns()`), which is the one learning signal every
    sample of the agent carries, for GRPO (group-relative) and PPO (minus the batch baseline) alike:
    polyrl has no value model, so there is no per-token credit to place them on. They let a workflow
    reward intermediate steps (a tool call that ran) without computing the sum itself."""

    rewards: Mapping[str, float]
    metadata: dict[str, Any] = field(default_factory=dict)
    turn_rewards: Mapping[str, Sequence[float]] = field(default_factory=dict)

    def returns(self) -> dict[str, float]:
        """Each agent's episode return: its reward plus the sum of its per-turn rewards."""
        out = {str(k): float(v) for k, v in self.rewards.items()}
        for agent, rs in self.turn_rewards.items():
            out[str(agent)] = out.get(str(agent), 0.0) + float(sum(float(r) for r in rs))
        return out


def import_workflow(entrypoint: str) -> Any:
    """The class (or factory) `module:attr` names; a WorkflowImportError says which part failed."""
    try:
        return import_object(entrypoint)
    except ImportPathError as e:
        raise WorkflowImportError(entrypoint, str(e)) from e


def create_workflow(entrypoint: str, cls: Any, args: Mapping[str, Any] | None) -> tuple[Any, dict[str, str]]:
    """`cls` instantiated with `args` (minus `policies`), and the agent -> policy mapping. Whatever
    the constructor raises (unknown args, a check of its own) becomes a WorkflowImportError."""
    kwargs = dict(args or {})
    mapping = {str(k): str(v) for k, v in (kwargs.pop("policies", None) or {}).items()}
    try:
        instance = cls(**kwargs)
    except Exception as e:
        reason = f"cannot create it with args {kwargs}: {type(e).__name__}: {e}"
        raise WorkflowImportError(entrypoint, reason, field="args") from e
    if not callable(getattr(instance, "run_episode", None)):
        raise WorkflowImportError(entrypoint, "has no run_episode method")
    return instance, mapping


def load_workflow(entrypoint: str, args: Mapping[str, Any] | None) -> tuple[Any, dict[str, str]]:
    """Import `module:attr`, instantiate it with `args` (minus `policies`); return it and the
    agent -> policy mapping. Errors say which part failed."""
    return create_workflow(entrypoint, import_workflow(entrypoint), args)


@dataclass(frozen=True)
class CallRecord:
    """One generation call of an episode: the agent and policy, the turn its tokens went into (a
    conversation's calls share one), how many tokens it sampled, and whether it was cut at its
    maximum new tokens (finish reason "length")."""

    agent: str
    policy: str
    turn_index: int
    tokens: int
    truncated: bool

    @classmethod
    def of(cls, agent: str, policy: str, turn_index: int, gen: Generation) -> CallRecord:
        return cls(agent, policy, turn_index, len(gen.token_ids), gen.finish_reason == "length")


@dataclass(frozen=True)
class Reply:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str


class _Current:
    """The default version of an `Agent`: what the episode plays the policy at (module `Agent`)."""


CURRENT = _Current()


class Agent:
    """An agent of one episode: generates with its policy's engines and records each turn. An
    opponent at a past version (`snapshot`, from `ctx.opponent`) records none: it is never trained on."""

    def __init__(
        self, ctx: EpisodeContext, name: str, policy: str, snapshot: int | _Current | None = CURRENT
    ) -> None:
        self.ctx = ctx
        self.name = name
        self.policy = policy
        # By default the current weights, or in a cross-play episode the version the cell holds the
        # policy to (workflows/crossplay.py); `ctx.opponent` passes the version it drew.
        self.snapshot = ctx.versions.get(policy) if isinstance(snapshot, _Current) else snapshot
        ctx.roster[name] = policy
        self.tokenizer: Tokenizer = ctx.tokenizers[policy]

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int | None = None,
        allowed: Sequence[str] | Sequence[int] | None = None,
        stop: Sequence[str] | None = None,
        include_stop: bool = False,
        temperature: float | None = None,
    ) -> Reply:
        """One turn. `prompt` text is encoded with the tokenizer's special tokens (a leading BOS where
        the model has one), token ids are sent as they are (e.g. from `chat_prompt`); `allowed`
        restricts the tokens (text pieces or ids) the reply may use; generation stops at the
        model's end ids (EOS), at a `stop` string of any length (cut from the reply text unless
        `include_stop`; its tokens stay in the trained turn, since they were sampled), or after
        `max_new_tokens` (the policy's `sampling.maxNewTokens` by default); `temperature` (the
        policy's `sampling.temperature` by default) is recorded with the turn, which the trainer
        scores at it."""
        tok = self.tokenizer
        ids = tok.encode(prompt, bos=True) if isinstance(prompt, str) else [int(i) for i in prompt]
        allowed_ids = self._allowed(allowed)
        temp = self._temperature(temperature)
        gen = await self._sample(
            ids,
            allowed_ids,
            max_new_tokens=max_new_tokens,
            stop=stop,
            include_stop=include_stop,
            temperature=temp,
        )
        if self.snapshot is not None:  # a past version's turn: never trained on
            return Reply(self._text(gen, include_stop), gen.token_ids.tolist(), ids, gen.finish_reason)
        self.ctx.turns.append(
            Turn(
                agent=self.name,
                policy=self.policy,
                prompt_ids=np.asarray(ids, dtype=np.int32),
                response_ids=gen.token_ids,
                logprobs=gen.logprobs,
                versions=gen.versions,
                allowed_ids=np.asarray(allowed_ids, dtype=np.int32),
                temperature=temp,
            )
        )
        self.ctx.calls.append(CallRecord.of(self.name, self.policy, len(self.ctx.turns) - 1, gen))
        return Reply(self._text(gen, include_stop), gen.token_ids.tolist(), ids, gen.finish_reason)

    async def chat(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        new_conversation: bool = False,
        max_new_tokens: int | None = None,
        allowed: Sequence[str] | Sequence[int] | None = None,
        stop: Sequence[str] | None = None,
        temperature: float | None = None,
    ) -> ChatReply:
        """The assistant's reply to `messages` (OpenAI-style dicts, or the openai SDK's message
        objects), rendered with the policy's chat template (and `tools`, OpenAI function schemas;
        then tool calls in the reply are parsed, see workflows/tools.py). Successive calls whose
        messages extend the previous call's messages and reply continue one conversation, trained as
        one sequence: only the sampled ids have loss mask 1 (workflows/chat.py). Sampling arguments
        as in `generate`; `allowed` and the temperature must be the same for every call of a
        conversation."""
        msgs = normalise(messages)
        tool_list = [dict(t) for t in tools] if tools else None
        allowed_ids = self._allowed(allowed)
        temp = self._temperature(temperature)
        conv = None if new_conversation else self.ctx.conversations.get(self.name)
        if conv is not None and not conv.continued_by(msgs, tool_list):
            conv = None
        if conv is None:
            prompt = self.tokenizer.apply_chat_template(msgs, tools=tool_list, add_generation_prompt=True)
            conv = Conversation(
                agent=self.name,
                policy=self.policy,
                messages=msgs,
                tools=tool_list,
                allowed_ids=allowed_ids,
                temperature=temp,
                turn_index=len(self.ctx.turns),
                prompt_ids=prompt,
            )
            context: list[int] = []
        else:
            if allowed_ids != conv.allowed_ids:
                raise ValueError(
                    f"agent {self.name!r}: every chat call of one conversation must use the same `allowed` "
                    f"tokens (the trainer scores the whole sequence under one constraint); start a new "
                    f"conversation to change them"
                )
            if temp != conv.temperature:
                raise ValueError(
                    f"agent {self.name!r}: every chat call of one conversation must sample at the same "
                    f"temperature (the trainer scores the whole sequence at one): this call's is {temp}, "
                    f"the conversation's {conv.temperature}; start a new conversation to change it"
                )
            context = context_ids(self.tokenizer, conv, msgs, tool_list)
        gen = await self._sample(
            conv.sequence() + context,
            allowed_ids,
            max_new_tokens=max_new_tokens,
            stop=stop,
            include_stop=False,
            temperature=temp,
        )
        extended(conv, context, gen, self.tokenizer.stop_ids)
        if self.snapshot is None:  # a past version's conversation is never trained on
            turn = conv.turn()
            if conv.turn_index == len(self.ctx.turns):
                self.ctx.turns.append(turn)
            else:
                self.ctx.turns[conv.turn_index] = turn
            self.ctx.calls.append(CallRecord.of(self.name, self.policy, conv.turn_index, gen))
        raw = self._text(gen, False)
        prefix = f"call_{self.name}_{len(conv.versions)}"
        parsed = parse_tool_calls(raw, id_prefix=prefix, tools=tool_list) if tool_list else None
        reply = ChatReply.of(raw, gen.token_ids.tolist(), gen.finish_reason, parsed)
        conv.messages = [*msgs, reply.message]
        self.ctx.conversations[self.name] = conv
        return reply

    def _allowed(self, allowed: Sequence[str] | Sequence[int] | None) -> tuple[int, ...]:
        tok = self.tokenizer
        return tuple(tok.token_id(a) if isinstance(a, str) else int(a) for a in allowed or ())

    def _temperature(self, temperature: float | None) -> float:
        """A call's effective sampling temperature: its own, else its policy's (checked before
        anything is sampled: the turn records it, and the trainer divides by it)."""
        t = self.ctx.sampling[self.policy].temperature if temperature is None else float(temperature)
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"agent {self.name!r}: temperature must be finite and >= 0, got {t}")
        return t

    async def _sample(
        self,
        ids: list[int],
        allowed_ids: tuple[int, ...],
        *,
        max_new_tokens: int | None,
        stop: Sequence[str] | None,
        include_stop: bool,
        temperature: float,
    ) -> Generation:
        base = self.ctx.sampling[self.policy]
        params = SamplingParams(
            temperature=temperature,
            top_p=base.top_p,
            max_new_tokens=max_new_tokens or base.max_new_tokens,
            stop_ids=tuple(self.tokenizer.stop_ids),
            allowed_ids=allowed_ids,
            stop=tuple(stop or ()),
            include_stop_str=include_stop,
            seed=self.ctx.sampling_seed(self.name),
            snapshot=self.snapshot,
        )
        try:
            return await self.ctx.pool.generate(self.policy, ids, params)
        except PromptTooLongError as e:
            raise PromptTooLongError(e.policy, e.prompt_len, e.limit, agent=self.name) from None

    def _text(self, gen: Generation, include_stop: bool) -> str:
        text = self.tokenizer.decode(gen.token_ids.tolist())
        if gen.stop_str and not include_stop and gen.stop_str in text:
            text = text[: text.index(gen.stop_str)]
        return text

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of `messages` rendered with the policy's chat template (for `generate`)."""
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt
        )


@dataclass
class EpisodeContext:
    """What `run_episode` gets: agents by name, the group's seed and rng, and the tokenizers."""

    episode_id: str
    group_id: str
    index: int
    seed: int
    pool: EnginePool
    tokenizers: Mapping[str, Tokenizer]
    sampling: Mapping[str, SamplingParams]
    agent_policies: Mapping[str, str] = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    conversations: dict[str, Conversation] = field(default_factory=dict)  # each agent's latest
    calls: list[CallRecord] = field(default_factory=list)  # every generation call, in order
    # The group's prompt data row (spec.data; the same row for every member of the group), read-only;
    # None for a job without data.
    sample: Mapping[str, Any] | None = None
    # Per league policy, what its opponents are drawn from (workflows/opponents.py).
    opponent_tables: Mapping[str, OpponentTable] = field(default_factory=dict)
    # Agent -> (its policy, the snapshot version it plays; None: the latest), as `opponent` drew.
    opponents: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    # A cross-play episode's versions: policy -> the snapshot its agents play (workflows/crossplay.py).
    versions: Mapping[str, int] = field(default_factory=dict)
    # ... and policy -> (the policy, its version) that plays its `ctx.opponent` agents instead.
    stand_ins: Mapping[str, tuple[str, int | None]] = field(default_factory=dict)
    roster: dict[str, str] = field(default_factory=dict)  # every agent made so far -> its policy
    # The OpenAI endpoint's sessions of this episode (their keys: closed when it ends), and the
    # engine failures its requests met (workflows/openai_server.py).
    endpoint_keys: list[str] = field(default_factory=list)
    endpoint_errors: list[BaseException] = field(default_factory=list)

    def reward(self, name: str, completion: str, row: Mapping[str, Any] | None = None) -> float:
        """Score `completion` with reward function `name` (a built-in: exact_match, numeric, math; or
        `module:attr`) against `row` (default: `ctx.sample`). A function that raises fails this
        episode with a RewardError naming it and the episode (a counted drop, not a crash)."""
        data = self.sample if row is None else row
        if data is None:
            raise RewardError(
                f"episode {self.episode_id}: reward {name!r} needs a row, and the job has no data"
            )
        return score(name, completion, data, episode=self.episode_id)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)  # same in every episode of the group: same task
        self._turns_drawn: dict[str, int] = {}

    def sampling_seed(self, agent: str) -> int:
        """The sampling seed of `agent`'s next turn: a function of (group seed, episode index, agent,
        the agent's turn number) only, so a seeded job samples the same tokens whichever requests
        an engine happens to batch together (engines draw each seeded request from its own RNG)."""
        k = self._turns_drawn.get(agent, 0)
        self._turns_drawn[agent] = k + 1
        key = f"{self.seed}/{self.index}/{agent}/{k}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1

    def agent(self, name: str) -> Agent:
        policy = self.agent_policies.get(name, name)
        if policy not in self.tokenizers:
            raise KeyError(
                f"agent {name!r} acts with policy {policy!r}, which the job does not define "
                f"(policies: {sorted(self.tokenizers)}; map agents with workflow.args.policies)"
            )
        return Agent(self, name, policy)

    def opponent(self, name: str, policy: str | None = None) -> Agent:
        """Agent `name` as an opponent from its policy's league (`spec.policies[].league`): the latest
        version or a snapshot of a past one, drawn once per episode group (every episode of a group
        meets the same version). A snapshot's turns are never trained on; the latest version's are,
        as `agent(name)`'s. The episode records the version played (`EpisodeReport.opponents`).
        `policy`: the agent's policy, for a workflow that names its agents' policies itself (as
        `Agent(ctx, name, policy)` does); by default the one `agent(name)` acts with."""
        agent = self.agent(name) if policy is None else Agent(self, name, policy)
        stand_in = self.stand_ins.get(agent.policy)
        if stand_in is not None:  # a cross-play cell's column plays it (workflows/crossplay.py)
            self.opponents.setdefault(name, stand_in)
            return Agent(self, name, *self.opponents[name])
        table = self.opponent_tables.get(agent.policy)
        if table is None:
            raise KeyError(
                f"agent {name!r} acts with policy {agent.policy!r}, which has no league: set "
                f"spec.policies[].league on it to play its past versions (or call ctx.agent)"
            )
        if name not in self.opponents:
            self.opponents[name] = (agent.policy, draw(table, f"{self.group_id}/{name}"))
        return Agent(self, name, agent.policy, snapshot=self.opponents[name][1])

    def tokenizer(self, agent: str) -> Tokenizer:
        return self.agent(agent).tokenizer

    def openai(self, agent: str) -> OpenAIClient:
        """An OpenAI-compatible client whose chat completions are `agent`'s chat calls (trained)."""
        # Imported here: the openai SDK loads only in the workflows that use this client.
        from polyrl_runtime.workflows.openai_client import OpenAIClient

        return OpenAIClient(self.agent(agent))

    async def openai_base_url(self, *agents: str) -> str:
        """The base URL of an OpenAI-compatible HTTP endpoint (`/v1/chat/completions`, `/v1/models`)
        for this episode's `agents` (each by name, as its requests' `model`; default: every agent of
        the workflow's `policies`), for agent frameworks that take a `base_url`. Each completion is
        the agent's chat call, trained as `openai(agent)`'s; the URL stops working when the episode
        ends (workflows/openai_server.py)."""
        from polyrl_runtime.workflows.openai_server import endpoint_server

        names = agents or tuple(self.agent_policies)
        if not names:
            raise ValueError("openai_base_url: name the agents (the job's workflow.args.policies names none)")
        key, url = await endpoint_server().open(
            self.episode_id, {n: self.agent(n) for n in names}, self.endpoint_errors
        )
        self.endpoint_keys.append(key)
        return url

    def close_endpoints(self) -> None:
        """End the episode's endpoint sessions (the runner calls it when the episode ends)."""
        if self.endpoint_keys:
            from polyrl_runtime.workflows.openai_server import endpoint_server

            for key in self.endpoint_keys:
                endpoint_server().close(key)
            self.endpoint_keys.clear()
