"""The buffer as a Ray actor: producers and a trainer in other processes; a trainer crash redelivers."""

from __future__ import annotations

import sys
from typing import Any

from polyrl_runtime.experience import Episode, PolicyConfig, Turn
from polyrl_runtime.experience.actor import create_experience_actor
from polyrl_runtime.experience.wire import EpisodeBatch, TicketBatch


def _episode(i: int) -> Episode:
    return Episode(
        f"e{i}",
        (
            Turn("s", "speaker", [1, 2, 3], [4, 5], [-0.1, -0.2], [0, 0]),
            Turn("l", "listener", [6], [7, 8, 9], [-0.3] * 3, [0, 0, 0]),
        ),
        {"s": 1.0, "l": 0.0},
        {"i": i},
    )


def test_actor_streams_and_redelivers_after_trainer_crash(ray_session: Any) -> None:
    ray = ray_session
    # The tasks below use this module's helpers; Ray workers cannot import a test module by name.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    configs = [PolicyConfig("speaker", 4, 1), PolicyConfig("listener", 4, 1)]
    buf = create_experience_actor(configs, 16)

    @ray.remote(num_cpus=0)
    def workflow(buf: Any, start: int, n: int, wire: bool = True) -> int:
        tickets = ray.get(buf.acquire.remote(["speaker", "listener"], n, None))
        assert isinstance(tickets, TicketBatch)
        items = [(t, _episode(start + k)) for k, t in enumerate(tickets)]
        ray.get(buf.put.remote(EpisodeBatch(items) if wire else items))  # both forms are accepted
        return len(tickets)

    @ray.remote(num_cpus=0)
    def trainer(buf: Any, policy: str, consumer: str, n: int, ack: bool) -> list[str]:
        lease = ray.get(buf.pull.remote(policy, consumer, n, None))
        if ack:
            ray.get(buf.ack.remote([lease.lease_id]))
        return list(lease.batch.sample_ids)

    try:
        assert (
            sum(ray.get([workflow.remote(buf, 0, 4), workflow.remote(buf, 100, 4, False)], timeout=120)) == 8
        )
        # A trainer takes 3 speaker samples and dies before acking; they come back first.
        lost = ray.get(trainer.remote(buf, "speaker", "t-1", 3, False), timeout=120)
        assert ray.get(buf.consumer_failed.remote("t-1")) == 3
        again = ray.get(trainer.remote(buf, "speaker", "t-2", 8, True), timeout=120)
        assert again[:3] == lost and len(again) == 8 == len(set(again))
        ray.get(trainer.remote(buf, "listener", "t-3", 8, True), timeout=120)
        stats = ray.get(buf.stats.remote())
        for s in stats.values():
            assert s.consumed == 8 and s.buffered == 0 and s.leased == 0 and sum(s.dropped.values()) == 0
        assert stats["speaker"].redelivered == 3
        # Both trainers stepped: credit for one more version's episodes.
        ray.get([buf.advance.remote("speaker", 1), buf.advance.remote("listener", 1)])
        # The snapshot restores into a fresh actor with nothing lost.
        ray.get(workflow.remote(buf, 200, 1), timeout=120)
        snap = ray.get(buf.snapshot.remote())
        restored = create_experience_actor(configs, 16, snapshot=snap)
        assert ray.get(restored.stats.remote())["speaker"].buffered == 1
        ray.kill(restored)
    finally:
        ray.kill(buf)
