"""What an episode's OpenAI HTTP endpoint (workflows/openai_server.py) costs against the in-process
client (`ctx.openai`), per call and under load.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/openai_endpoint.py [--calls 400] [--episodes 32]
        [--turns 4] [--tokens 16] [--model builtin://tiny-qwen2] [--rounds 3]

- Per call: `--calls` chat completions one after another, each a new conversation of one user
  message, answered at once by an engine that returns a fixed reply of `--tokens` tokens (no model:
  what is measured is the client's path alone). The in-process client against the openai SDK's own
  HTTP client on the loopback endpoint, alternating in rounds: median and p99 latency, and CPU time
  per call (this process's, which holds the client and the server alike). Added = endpoint minus
  in-process; the goal (from the issue) is <= 5 ms median added.
- Under load: `--episodes` concurrent episodes of `--turns` calls each, against a real torch engine
  serving `--model` (sampled, `--tokens` new tokens a call): generated tokens per second of wall
  time through the endpoint and in-process, and their ratio, median of `--rounds`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # polyrl_testenv

import numpy as np
import openai

from polyrl_runtime.engines.api import Generation, SamplingParams
from polyrl_runtime.engines.pool import EnginePool
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.models import load_tokenizer
from polyrl_runtime.workflows.api import EpisodeContext
from polyrl_testenv.inprocess import InProcessEngine, engine_routes

AGENT = "solver"
MESSAGES = [{"role": "user", "content": "What is 3+4? Answer with the number."}]


class _Instant:
    """An engine without a model: every request gets the same reply at once."""

    def __init__(self, tokens: list[int]) -> None:
        ids = np.asarray(tokens, np.int32)
        self.reply = Generation(ids, np.zeros(len(ids), np.float32), np.zeros(len(ids), np.int32), "stop")

    async def generate(self, prompt: list[int], params: SamplingParams) -> Generation:
        return self.reply


def _context(handle: InProcessEngine, uri: str, tokens: int, i: int = 0) -> EpisodeContext:
    pool = EnginePool(engine_routes({AGENT: {"e0": handle}}))
    sampling = {AGENT: SamplingParams(temperature=1.0, max_new_tokens=tokens)}
    return EpisodeContext(f"ep-{i}", f"g-{i}", 0, i, pool, {AGENT: load_tokenizer(uri)}, sampling)


async def _latencies(ctx: EpisodeContext, calls: int, http: bool) -> tuple[list[float], float]:
    """Per-call seconds of `calls` completions, and CPU seconds per call."""
    client: Any
    if http:
        client = openai.AsyncOpenAI(
            base_url=await ctx.openai_base_url(AGENT), api_key="unused", max_retries=0
        )
    else:
        client = ctx.openai(AGENT)
    out, cpu = [], time.process_time()
    for _ in range(calls):
        t0 = time.perf_counter()
        await client.chat.completions.create(model=AGENT, messages=MESSAGES)
        out.append(time.perf_counter() - t0)
    cpu = (time.process_time() - cpu) / calls
    if http:
        await client.close()
    ctx.turns.clear()
    ctx.conversations.clear()
    return out, cpu


def _p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99))


async def per_call(uri: str, calls: int, tokens: int, rounds: int) -> list[str]:
    tok = load_tokenizer(uri)
    ctx = _context(InProcessEngine(_Instant(tok.encode("7" * tokens)[:tokens] or [1])), uri, tokens)
    await _latencies(ctx, 20, True)  # warm up: the server starts, connections open
    await _latencies(ctx, 20, False)
    local: list[float] = []
    remote: list[float] = []
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for http in (False, True):
            xs, c = await _latencies(ctx, calls // rounds, http)
            (remote if http else local).extend(xs)
            cpu[http].append(c)
    rows = []
    for name, xs, c in (("in-process", local, cpu[False]), ("HTTP endpoint", remote, cpu[True])):
        rows.append(
            f"| {name} | {statistics.median(xs) * 1e3:.2f} ms | {_p99(xs) * 1e3:.2f} ms | "
            f"{statistics.median(c) * 1e3:.2f} ms |"
        )
    added = statistics.median(remote) - statistics.median(local)
    rows.append(
        f"| added | {added * 1e3:.2f} ms | {(_p99(remote) - _p99(local)) * 1e3:.2f} ms | "
        f"{(statistics.median(cpu[True]) - statistics.median(cpu[False])) * 1e3:.2f} ms |"
    )
    rows.append(
        f"\ngoal (median added <= 5 ms): {'met' if added <= 0.005 else 'not met'} ({added * 1e3:.2f} ms)"
    )
    return rows


async def _client(ctx: EpisodeContext, http: bool) -> Any:
    if http:
        return openai.AsyncOpenAI(base_url=await ctx.openai_base_url(AGENT), api_key="unused", max_retries=0)
    return ctx.openai(AGENT)


async def _episode(client: Any, turns: int) -> int:
    history: list[Any] = list(MESSAGES)
    tokens = 0
    for t in range(turns):
        reply = await client.chat.completions.create(model=AGENT, messages=history, temperature=1.0)
        tokens += reply.usage.completion_tokens if reply.usage else 0
        message = reply.choices[0].message.model_dump(exclude_none=True)
        history = [*history, message, {"role": "user", "content": f"and {t}?"}]
    return tokens


async def under_load(uri: str, episodes: int, turns: int, tokens: int, rounds: int) -> list[str]:
    engine = TorchEngine("bench", AGENT, uri, seed=1, dtype="float32", max_batch=episodes)
    handle = InProcessEngine(engine)
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds + 1):  # the first round warms up
        for http in (False, True):
            ctxs = [_context(handle, uri, tokens, i) for i in range(episodes)]
            # Made before the clock starts: the openai SDK takes about 25 ms to make a client (its
            # TLS context), a framework's cost once per episode, not the endpoint's per call.
            clients = [await _client(c, http) for c in ctxs]
            t0 = time.perf_counter()
            made = await asyncio.gather(*(_episode(c, turns) for c in clients))
            rates[http].append(sum(made) / (time.perf_counter() - t0))
            for c, ctx in zip(clients, ctxs, strict=True):
                if http:
                    await c.close()
                ctx.close_endpoints()
    local, remote = (statistics.median(rates[h][1:]) for h in (False, True))
    return [
        f"| in-process | {local:.0f} |",
        f"| HTTP endpoint | {remote:.0f} |",
        f"| ratio | {remote / local:.2f}x |",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--model", default="builtin://tiny-qwen2")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.calls < args.rounds or min(args.episodes, args.turns, args.tokens, args.rounds) < 1:
        ap.error("--calls >= --rounds; --episodes, --turns, --tokens, --rounds >= 1")
    print(f"# {len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.1f}; {args.model}")
    print(
        f"\n# per call: {args.calls} completions each way, a {args.tokens}-token reply from an engine without a model"
    )
    print("| client | median latency | p99 latency | CPU per call |")
    print("|---|---:|---:|---:|")
    print("\n".join(asyncio.run(per_call(args.model, args.calls, args.tokens, args.rounds))))
    print(
        f"\n# under load: {args.episodes} concurrent episodes x {args.turns} calls, {args.tokens} new tokens each, torch engine"
    )
    print("| client | tokens/s |")
    print("|---|---:|")
    print("\n".join(asyncio.run(under_load(args.model, args.episodes, args.turns, args.tokens, args.rounds))))


if __name__ == "__main__":
    main()
