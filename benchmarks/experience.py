"""Experience streaming through the buffer actor vs raw Ray transfer of the same bytes, in one run.

    .venv/bin/python benchmarks/experience.py [--episodes 10000] [--pairs 5] [--response 2048] [--batch 32]
                                              [--in-flight 1[,2]]

Workflow -> buffer actor -> one trainer per policy, all separate Ray actor processes. Each episode has
one turn per policy (two policies). The raw baseline moves the same bytes over the same hops with the
same number of calls: the producer sends one numpy array per policy per batch to a relay actor, and
each consumer takes one array per call. Runs alternate (raw, buffer, raw, buffer, ...) so both paths
see the same machine load; the ratio is taken within each pair and its median, min and max reported,
with each process's CPU seconds. Each value of `--in-flight` is a set of pairs: with 1 the producer
waits for every call before it builds the next batch (a call's latency is on the path); with 2 it
builds the next batch while the previous call is in flight, as a workflow worker does (it puts each
group without waiting for the others), on both paths alike. Then the producer is made 10x faster than
the trainers, and the buffer's peak resident episodes (its memory bound) and the producer's blocked
time are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np
import ray

from polyrl_runtime.experience import Episode, PolicyConfig, Turn
from polyrl_runtime.experience.actor import create_experience_actor
from polyrl_runtime.experience.wire import EpisodeBatch

POLICIES = ("a", "b")


def make_turns(prompt: int, response: int) -> dict[str, Turn]:
    rng = np.random.default_rng(0)
    return {
        p: Turn(
            f"agent-{p}",
            p,
            rng.integers(0, 32000, prompt),
            rng.integers(0, 32000, response),
            rng.standard_normal(response).astype(np.float32),
            np.zeros(response, dtype=np.int32),
        )
        for p in POLICIES
    }


def turn_bytes(t: Turn) -> int:
    return int(t.prompt_ids.nbytes + t.response_ids.nbytes + t.logprobs.nbytes + t.versions.nbytes)


@dataclass
class Run:
    wall: float
    cpu: dict[str, float]  # CPU seconds each process spent during the run
    blocked: float = 0.0  # the producer's time waiting in `exchange`
    peak: int = 0  # peak resident episodes seen by the trainers
    stale: int = 0  # maximum staleness of a trained sample


def _cpu(_actor: Any) -> float:
    """Run inside an actor (`__ray_call__`): its process's CPU time, all threads."""
    return time.process_time()


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self, prompt: int, response: int) -> None:
        self.turns = make_turns(prompt, response)
        self.blocked_s = 0.0

    def _episode(self, i: int, versions: dict[str, int]) -> Episode:
        turns = tuple(
            Turn(
                t.agent,
                p,
                t.prompt_ids,
                t.response_ids,
                t.logprobs,
                np.full_like(t.versions, versions[p]),
                temperature=t.temperature,
            )
            for p, t in self.turns.items()
        )
        return Episode(f"ep{i}", turns, {t.agent: 1.0 for t in turns})

    def run(self, buf: Any, episodes: int, batch: int, in_flight: int) -> float:
        """One `exchange` call per batch: put the finished episodes, get credit for the next ones.

        With `in_flight` > 1 the producer builds the next batch while earlier calls are still in flight
        (as a workflow worker does: it puts each group without waiting for the others)."""
        done, asked = 0, 0  # tickets received; tickets asked for and not known to be short
        self.blocked_s = 0.0
        pending: deque[tuple[int, Any]] = deque()

        def call(items: list[tuple[Any, Episode]]) -> None:
            nonlocal asked
            n = min(batch, episodes - asked)
            asked += n
            pending.append((n, buf.exchange.remote(EpisodeBatch(items), POLICIES, n, None)))

        for _ in range(in_flight):
            call([])
        while pending:
            n, ref = pending.popleft()
            t = time.perf_counter()
            tickets, versions = ray.get(ref)
            self.blocked_s += time.perf_counter() - t
            asked -= n - len(tickets)  # credit may come short of a batch (the capacity bound)
            if tickets:
                # Stamped with the version each policy's engines would be serving now.
                call([(tk, self._episode(done + k, versions)) for k, tk in enumerate(tickets)])
                done += len(tickets)
            elif asked < episodes:
                call([])
        return self.blocked_s

    def run_raw(self, relay: Any, episodes: int, batch: int, in_flight: int) -> None:
        pending: deque[Any] = deque()
        for start in range(0, episodes, batch):
            n = min(batch, episodes - start)
            arrays = {p: np.tile(np.frombuffer(self._bytes(p), dtype=np.uint8), n) for p in POLICIES}
            if len(pending) >= in_flight:
                ray.get(pending.popleft())
            pending.append(relay.put.remote(arrays))
        ray.get(list(pending))

    def _bytes(self, p: str) -> bytes:
        t = self.turns[p]
        return t.prompt_ids.tobytes() + t.response_ids.tobytes() + t.logprobs.tobytes() + t.versions.tobytes()


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.v = 0

    def run(
        self, buf: Any, samples: int, micro: int, per_version: int, step_s: float, *, watch: bool
    ) -> dict[str, float]:
        """One `pull` call per step: it acks the previous lease and reports a new version if any."""
        got, peak, since, nbytes = 0, 0, 0, 0
        self.v = 0  # a fresh buffer per run starts at version 0
        ack: list[int] = []
        new_version: int | None = None
        while got < samples:
            lease = ray.get(
                buf.pull.remote(
                    self.policy, f"trainer-{self.policy}", micro, None, ack=ack, version=new_version
                )
            )
            if step_s:
                time.sleep(step_s)  # the "optimizer step" of a trainer 10x slower than the producer
            ack, new_version = [lease.lease_id], None
            got += len(lease.batch)
            nbytes += lease.batch.nbytes
            since += len(lease.batch)
            if since >= per_version:
                since -= per_version
                self.v += 1
                new_version = self.v
            if watch:
                peak = max(peak, ray.get(buf.resident_episodes.remote()))
        ray.get(buf.ack.remote(ack))
        return {"bytes": nbytes, "peak_resident": peak}

    def run_raw(self, relay: Any, calls: int) -> int:
        nbytes = 0
        for _ in range(calls):
            nbytes += int(ray.get(relay.pull.remote(self.policy)).nbytes)
        return nbytes


@ray.remote(num_cpus=0, max_concurrency=8)
class Relay:
    """The raw baseline: a queue per policy, no accounting."""

    def __init__(self) -> None:
        self.q: dict[str, deque[Any]] = {p: deque() for p in POLICIES}

    def put(self, arrays: dict[str, Any]) -> None:
        for p, a in arrays.items():
            self.q[p].append(a)

    def pull(self, policy: str) -> Any:
        while not self.q[policy]:
            time.sleep(0.0005)
        return self.q[policy].popleft()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=10000, help="episodes per run (each path, each pair)")
    ap.add_argument("--pairs", type=int, default=5, help="interleaved (raw, buffer) pairs of runs")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32, help="episodes per put = samples per trainer pull")
    ap.add_argument("--capacity", type=int, default=128, help="resident-episode bound of the buffer")
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument(
        "--in-flight",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1],
        help="producer calls in flight, one set of pairs per value (both paths); 1 waits for each call",
    )
    ap.add_argument(
        "--bound-episodes", type=int, default=2000, help="episodes of the 10x-faster-producer run"
    )
    args = ap.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")

    turns = make_turns(args.prompt, args.response)
    ep_bytes = sum(turn_bytes(t) for t in turns.values())
    per_version = 4 * args.batch
    cfgs = [PolicyConfig(p, per_version, args.max_staleness) for p in POLICIES]
    producer = Producer.remote(args.prompt, args.response)
    trainers = {p: Trainer.remote(p) for p in POLICIES}
    ray.get([producer.__ray_ready__.remote(), *(t.__ray_ready__.remote() for t in trainers.values())])
    workers = {"producer": producer, **{f"trainer {p}": t for p, t in trainers.items()}}

    def cpu(actors: dict[str, Any]) -> dict[str, float]:
        return dict(zip(actors, ray.get([a.__ray_call__.remote(_cpu) for a in actors.values()]), strict=True))

    def buffered(episodes: int, step_s: float, in_flight: int) -> Run:
        buf = create_experience_actor(cfgs, args.capacity)
        ray.get(buf.__ray_ready__.remote())
        actors = {**workers, "relay/buffer": buf}
        cpu0 = cpu(actors)
        t = time.perf_counter()
        prod = producer.run.remote(buf, episodes, args.batch, in_flight)
        outs = ray.get(
            [
                tr.run.remote(buf, episodes, args.batch, per_version, step_s, watch=step_s > 0)
                for tr in trainers.values()
            ]
        )
        blocked = ray.get(prod)
        wall = time.perf_counter() - t
        cpu1 = cpu(actors)
        stats = ray.get(buf.stats.remote())
        for s in stats.values():
            assert s.consumed == episodes and sum(s.dropped.values()) == 0 and s.buffered == 0, s
        assert sum(o["bytes"] for o in outs) == ep_bytes * episodes
        ray.kill(buf)
        return Run(
            wall,
            {k: cpu1[k] - cpu0[k] for k in actors},
            blocked,
            max(int(o["peak_resident"]) for o in outs),
            max(s.staleness_max for s in stats.values()),
        )

    def raw(episodes: int, in_flight: int) -> Run:
        relay = Relay.remote()
        ray.get(relay.__ray_ready__.remote())
        actors = {**workers, "relay/buffer": relay}
        cpu0 = cpu(actors)
        calls = -(-episodes // args.batch)
        t = time.perf_counter()
        prod = producer.run_raw.remote(relay, episodes, args.batch, in_flight)
        got = ray.get([tr.run_raw.remote(relay, calls) for tr in trainers.values()])
        ray.get(prod)
        wall = time.perf_counter() - t
        cpu1 = cpu(actors)
        assert sum(got) == ep_bytes * episodes
        ray.kill(relay)
        return Run(wall, {k: cpu1[k] - cpu0[k] for k in actors})

    warm = min(args.episodes, 500)
    raw(warm, 1)  # warm-up: worker processes, code paths
    buffered(warm, 0.0, 1)
    mb = ep_bytes * args.episodes / 1e6
    print(
        f"experience: {args.episodes} episodes x 2 policies per run, {ep_bytes / 1e3:.1f} kB/episode, "
        f"batch {args.batch}, {args.pairs} interleaved pairs (raw, buffer) per mode"
    )
    buf_s = 0.0
    for in_flight in args.in_flight:
        load0 = os.getloadavg()
        pairs = [
            (raw(args.episodes, in_flight), buffered(args.episodes, 0.0, in_flight))
            for _ in range(args.pairs)
        ]
        load1 = os.getloadavg()
        ratios = [r.wall / b.wall for r, b in pairs]
        med = statistics.median(ratios)
        mode = "each call waited for" if in_flight == 1 else "pipelined"
        print(f"\nproducer calls in flight: {in_flight} ({mode})")
        print(f"load (1/5/15 min): {_load(load0)} before, {_load(load1)} after")
        print(f"{'pair':>5} {'raw s':>7} {'buffer s':>9} {'ratio':>6}")
        for i, ((r, b), q) in enumerate(zip(pairs, ratios, strict=True), 1):
            print(f"{'#' + str(i):>5} {r.wall:>7.2f} {b.wall:>9.2f} {q:>6.2f}")
        raw_s = statistics.median(r.wall for r, _ in pairs)
        med_buf = statistics.median(b.wall for _, b in pairs)
        buf_s = buf_s or med_buf  # the first mode's pace sets the memory-bound run's trainer step
        print(f"{'path':>8} {'episodes/s':>11} {'MB/s':>8}   (median run)")
        print(f"{'raw ray':>8} {args.episodes / raw_s:>11.0f} {mb / raw_s:>8.1f}")
        print(f"{'buffer':>8} {args.episodes / med_buf:>11.0f} {mb / med_buf:>8.1f}")
        print(
            f"ratio (raw wall / buffer wall, per pair): median {med:.2f}, min {min(ratios):.2f}, "
            f"max {max(ratios):.2f}"
        )
        print("CPU seconds per run (mean over pairs), by process:")
        for name in pairs[0][0].cpu:
            r_cpu = statistics.mean(r.cpu[name] for r, _ in pairs)
            b_cpu = statistics.mean(b.cpu[name] for _, b in pairs)
            print(f"{name:>14}  raw {r_cpu:6.2f}  buffer {b_cpu:6.2f}")

    # Producer 10x faster than the trainers: each trainer step takes 10x the producer's time per batch.
    n = min(args.episodes, args.bound_episodes)
    step = 10 * buf_s / (args.episodes / args.batch)
    bound = buffered(n, step, 1)
    print(
        f"\nproducer 10x faster than trainers ({n} episodes, trainer step {step * 1e3:.1f} ms "
        f"per {args.batch} samples)"
    )
    print(
        f"{'capacity':>9} {'peak resident':>14} {'peak MB':>8} {'producer blocked':>17} {'max staleness':>14}"
    )
    print(
        f"{args.capacity:>9} {bound.peak:>14} {bound.peak * ep_bytes / 1e6:>8.1f} "
        f"{bound.blocked / bound.wall:>16.0%} {bound.stale:>8} (<= {args.max_staleness})"
    )
    ray.shutdown()


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.2f}" for x in avg)


if __name__ == "__main__":
    main()
