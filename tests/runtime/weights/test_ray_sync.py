"""Trainer and engines as Ray actors (separate processes): sync, scale-out catch-up, a mismatched engine."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from polyrl_runtime.engines.client import EngineClient
from polyrl_runtime.trainers.client import TrainerRankClient
from polyrl_runtime.weights import VersionError, VersionRegistry, WeightMismatchError, WeightSyncError
from polyrl_runtime.weights.api import SyncReport, WeightManifest
from polyrl_runtime.weights.endpoints import EngineWeights, PolicyWeightSync, TrainerWeights
from polyrl_testenv.rayactors import kill


def _model(seed: int, width: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.0.weight": torch.randn(width, 5, generator=g).to(torch.bfloat16),
        "layer.0.bias": torch.randn(width, generator=g),
        "head.weight": torch.randn(3, width, generator=g),
        "step": torch.tensor(seed, dtype=torch.int64),
    }


class Trainer(TrainerWeights):
    def __init__(self, transport: str, kwargs: dict[str, Any]) -> None:
        self.step = 0
        self.init_weight_sender(transport, "alice", 48, **kwargs)

    def train_step(self) -> None:
        self.step += 1

    def weight_tensors(self) -> Mapping[str, torch.Tensor]:
        return _model(self.step)


class Engine(EngineWeights):
    def __init__(self, transport: str, width: int = 8) -> None:
        self.init_weight_receiver(transport, {k: torch.zeros_like(v) for k, v in _model(0, width).items()})

    def fingerprint(self) -> dict[str, list[int]]:
        t = self._weight_target.named_tensors()
        return {k: v.reshape(-1).view(torch.uint8).tolist() for k, v in t.items()}


def _sync(
    trainer: Any, engines: Mapping[str, Any], registry: VersionRegistry, **kwargs: Any
) -> PolicyWeightSync:
    """Policy "alice"'s sync over these actors, through the clients the driver calls them with."""
    engine_clients = {n: EngineClient(h) for n, h in engines.items()}
    return PolicyWeightSync("alice", TrainerRankClient(trainer), engine_clients, registry, **kwargs)


def _expected(seed: int) -> dict[str, list[int]]:
    return {k: v.reshape(-1).view(torch.uint8).tolist() for k, v in _model(seed).items()}


@pytest.mark.parametrize("transport", ["objectstore", "shm", "collective"])
def test_sync_and_scale_out_across_actors(ray_session: Any, transport: str) -> None:
    ray = ray_session
    # Actor classes live in this test module, which Ray workers cannot import by name.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    kwargs: dict[str, Any] = {"num_receivers": 1, "timeout_s": 60.0} if transport == "collective" else {}
    remote_trainer = ray.remote(num_cpus=0)(Trainer)
    remote_engine = ray.remote(num_cpus=0)(Engine)
    trainer = remote_trainer.remote(transport, kwargs)
    engines = {"e0": remote_engine.remote(transport)}
    actors = [trainer, *engines.values()]
    try:
        registry = VersionRegistry()
        wsync = _sync(trainer, engines, registry, transport=transport)
        for version in range(2):
            ray.get(trainer.train_step.remote())
            result = wsync.sync(version)
            assert not result.failures
            assert result.reports["e0"].control_messages == 1 and result.reports["e0"].applied
        assert ray.get(engines["e0"].fingerprint.remote()) == _expected(2)

        late = remote_engine.remote(transport)
        actors.append(late)
        with capture_logs() as logs:
            catch_up = wsync.add_engine("e1", EngineClient(late))
        assert catch_up is not None and not catch_up.failures
        (caught_up,) = [x for x in logs if x["event"] == "weights.engine_caught_up"]  # and how long it took
        assert caught_up["engine"] == "e1" and caught_up["version"] == 1 and caught_up["seconds"] >= 0
        assert ray.get(late.weight_version.remote()) == 1
        assert ray.get(late.fingerprint.remote()) == _expected(2)
        assert registry.ready("alice", "e1") and registry.ready("alice", "e0")

        # An engine whose model differs: it rejects, the others still move on to the new version.
        odd = remote_engine.remote(transport, 9)
        actors.append(odd)
        wsync.add_engine("odd", EngineClient(odd))
        ray.get(trainer.train_step.remote())
        result = wsync.sync(2)
        assert isinstance(result.failures["odd"], WeightMismatchError)
        assert set(result.reports) == {"e0", "e1"}
        assert ray.get(odd.weight_version.remote()) == -1
        assert registry.lagging("alice") == ["odd"]
        assert ray.get(late.fingerprint.remote()) == _expected(3)
    finally:
        ray.get(trainer.close_weights.remote())
        for a in actors:
            ray.kill(a)


@pytest.mark.parametrize("transport", ["objectstore", "shm", "collective"])
def test_a_failed_publish_raises_and_engines_keep_their_version(ray_session: Any, transport: str) -> None:
    """Engines are handed the publish's ref before it finished: if the publish fails, sync raises its
    error, no engine changes version, and the next publish goes through."""
    ray = ray_session
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    kwargs: dict[str, Any] = {"num_receivers": 1, "timeout_s": 60.0} if transport == "collective" else {}
    trainer = ray.remote(num_cpus=0)(Trainer).remote(transport, kwargs)
    engine = ray.remote(num_cpus=0)(Engine).remote(transport)
    try:
        registry = VersionRegistry()
        wsync = _sync(trainer, {"e0": engine}, registry, transport=transport)
        ray.get(trainer.train_step.remote())
        wsync.sync(1)
        ray.get(trainer.train_step.remote())
        with pytest.raises(VersionError, match="version 1 is not newer than the published 1"):
            wsync.sync(1)
        assert ray.get(engine.weight_version.remote()) == 1
        assert registry.latest_version("alice") == 1
        assert ray.get(engine.fingerprint.remote()) == _expected(1)
        result = wsync.sync(2)
        assert not result.failures and ray.get(engine.fingerprint.remote()) == _expected(2)
        assert ray.get(engine.weight_version.remote()) == 2
    finally:
        ray.get(trainer.close_weights.remote())
        for a in (trainer, engine):
            ray.kill(a)


class SlowJoiner(Engine):
    """An async engine actor (like TorchEngine) whose first update takes a second to apply."""

    async def receive_weights(self, manifest: WeightManifest) -> SyncReport:  # type: ignore[override]
        if not getattr(self, "_warm", False):
            self._warm = True
            await asyncio.sleep(1.0)
        return EngineWeights.receive_weights(self, manifest)


def test_a_catch_up_never_lands_after_a_newer_sync(ray_session: Any) -> None:
    """The driver syncs in one thread while housekeeping admits engines in another. A slow catch-up
    must not overtake, or be overtaken by, the next sync: that once downgraded a new engine to the
    older version and raised VersionError mid-training."""
    ray = ray_session
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = ray.remote(num_cpus=0)(Trainer).remote("objectstore", {})
    e0 = ray.remote(num_cpus=0)(Engine).remote("objectstore")
    late = ray.remote(num_cpus=0)(SlowJoiner).remote("objectstore")
    try:
        registry = VersionRegistry()
        wsync = _sync(trainer, {"e0": e0}, registry, transport="objectstore")
        for version in range(3):
            ray.get(trainer.train_step.remote())
            wsync.sync(version)
        ray.get(late.weight_version.remote())  # started
        with ThreadPoolExecutor(1) as pool:
            joining = pool.submit(wsync.add_engine, "late", EngineClient(late))  # catches up to 2, slowly
            time.sleep(0.3)
            ray.get(trainer.train_step.remote())
            result = wsync.sync(3)  # meanwhile, in the training thread
            caught_up = joining.result()
            assert caught_up is not None and not caught_up.failures and not result.failures
        assert ray.get(late.weight_version.remote()) == 3
        assert ray.get(late.fingerprint.remote()) == _expected(4)
        assert registry.ready("alice", "late") and registry.ready("alice", "e0")
    finally:
        ray.get(trainer.close_weights.remote())
        for a in (trainer, e0, late):
            ray.kill(a)


class LiveTrainer(TrainerWeights):
    """Publishes its own tensors and changes them in place, as a DeepSpeed trainer (ZeRO 0-2) does."""

    def __init__(self, transport: str, kwargs: dict[str, Any]) -> None:
        self.weights = _model(0)
        self.init_weight_sender(transport, "alice", 48, **kwargs)

    def optimizer_step(self, seed: int) -> None:
        self.begin_weight_update()
        for k, v in _model(seed).items():
            self.weights[k].copy_(v)

    def weight_tensors(self) -> Mapping[str, torch.Tensor]:
        return self.weights


@pytest.mark.parametrize("transport", ["objectstore", "shm", "collective"])
def test_an_engine_joining_mid_step_gets_a_whole_version(ray_session: Any, transport: str) -> None:
    """The trainer has begun its next step when an engine joins. Stores still hold version 0 and serve
    it; the collective sender kept no copy, so the engine waits for the step's publish and gets no
    work until then. Either way it never sees the half-changed tensors."""
    ray = ray_session
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    kwargs: dict[str, Any] = {"num_receivers": 1, "timeout_s": 60.0} if transport == "collective" else {}
    trainer = ray.remote(num_cpus=0)(LiveTrainer).remote(transport, kwargs)
    e0 = ray.remote(num_cpus=0)(Engine).remote(transport)
    late = ray.remote(num_cpus=0)(Engine).remote(transport)
    try:
        registry = VersionRegistry()
        wsync = _sync(trainer, {"e0": e0}, registry, transport=transport)
        ray.get(trainer.optimizer_step.remote(1))
        assert not wsync.sync(0).failures
        ray.get(trainer.optimizer_step.remote(2))  # step 2 under way: version 0 is gone from the trainer
        ray.get(late.weight_version.remote())  # started
        with ThreadPoolExecutor(1) as pool:
            joining = pool.submit(wsync.add_engine, "late", EngineClient(late))
            if transport == "collective":
                time.sleep(0.5)
                assert not joining.done() and ray.get(late.weight_version.remote()) == -1
                result = wsync.sync(1)
                caught_up = joining.result(60)
                assert caught_up is result and set(result.reports) == {"e0", "late"}
                assert ray.get(late.fingerprint.remote()) == _expected(2)
            else:
                caught_up = joining.result(60)
                assert caught_up is not None and set(caught_up.reports) == {"late"}
                assert ray.get(late.fingerprint.remote()) == _expected(1)
                assert not wsync.sync(1).failures
        assert ray.get(late.weight_version.remote()) == 1
        assert ray.get(late.fingerprint.remote()) == _expected(2)
        assert registry.ready("alice", "late") and registry.ready("alice", "e0")
    finally:
        ray.get(trainer.close_weights.remote())
        for a in (trainer, e0, late):
            ray.kill(a)


def test_close_releases_an_engine_waiting_for_a_publish(ray_session: Any) -> None:
    """The run ended mid-step (a failed step publishes nothing): the admission must not hang."""
    ray = ray_session
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = ray.remote(num_cpus=0)(LiveTrainer).remote(
        "collective", {"num_receivers": 1, "timeout_s": 60.0}
    )
    e0 = ray.remote(num_cpus=0)(Engine).remote("collective")
    late = ray.remote(num_cpus=0)(Engine).remote("collective")
    try:
        registry = VersionRegistry()
        wsync = _sync(trainer, {"e0": e0}, registry, transport="collective")
        assert not wsync.sync(0).failures
        ray.get(trainer.optimizer_step.remote(1))
        with ThreadPoolExecutor(1) as pool:
            joining = pool.submit(wsync.add_engine, "late", EngineClient(late))
            time.sleep(0.3)
            wsync.close()
            assert joining.result(30) is None
        assert ray.get(late.weight_version.remote()) == -1
        # With a timeout instead of a close, the caller is told which engine and why.
        wsync2 = _sync(trainer, {"e0": e0}, registry, transport="collective", admit_timeout_s=0.5)
        with pytest.raises(
            WeightSyncError, match="engine late joined while the trainer's weights were changing"
        ):
            wsync2.add_engine("late", EngineClient(late))
    finally:
        ray.get(trainer.close_weights.remote())
        for a in (trainer, e0, late):
            ray.kill(a)


def _collective_actors(ray: Any, n: int) -> tuple[Any, dict[str, Any]]:
    """A `LiveTrainer` and `n` engines on the collective transport, with gloo's full timeout (the
    tests that use this must not pass by timing out)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = ray.remote(num_cpus=0)(LiveTrainer).remote(
        "collective", {"num_receivers": n, "timeout_s": 600.0}
    )
    return trainer, {f"e{i}": ray.remote(num_cpus=0)(Engine).remote("collective") for i in range(n)}


# A hang guard (gloo's own timeout is 600 s), not a performance bound: this takes a few seconds.
@pytest.mark.timeout(90)
def test_an_engine_dying_between_syncs_does_not_hold_back_the_others(ray_session: Any) -> None:
    """gloo stops a broadcast at its first dead member, and the survivors would wait for bytes until
    the timeout. The sender closes the failed group at once and the sync resends to the survivors."""
    ray = ray_session
    trainer, engines = _collective_actors(ray, 3)
    try:
        registry = VersionRegistry()
        wsync = _sync(trainer, engines, registry, transport="collective")
        assert not wsync.sync(0).failures
        for victim in ("e0", "e2"):  # whichever rank gloo reaches first, one sync has it dead
            kill(engines[victim])
            ray.get(trainer.optimizer_step.remote(int(victim[1]) + 1))
            version = registry.latest("alice").version + 1  # type: ignore[union-attr]
            result = wsync.sync(version)
            assert set(result.failures) == {victim}
            assert isinstance(result.failures[victim], ray.exceptions.RayActorError)
            assert victim not in wsync.engines and result.reports
            for name in result.reports:
                assert ray.get(engines[name].weight_version.remote()) == version
        assert ray.get(engines["e1"].fingerprint.remote()) == _expected(3)
    finally:
        ray.get(trainer.close_weights.remote())
        for a in (trainer, *engines.values()):
            ray.kill(a)


# A hang guard (the group's timeout is 600 s), not a performance bound: this takes a few seconds.
@pytest.mark.timeout(90)
def test_an_engine_dead_before_the_groups_rendezvous_does_not_hold_back_the_others(
    ray_session: Any,
) -> None:
    """Building a group waits for every member. One that died before joining held the trainer and the
    survivors there until the timeout, with the trainer's store client, so the abort could not be
    sent either. Now members wait for each other's ranks, interruptibly, before building the group."""
    ray = ray_session
    trainer, engines = _collective_actors(ray, 2)
    try:
        registry = VersionRegistry()
        wsync = _sync(trainer, engines, registry, transport="collective")
        ray.get(engines["e1"].weight_version.remote())  # started
        kill(engines["e0"])  # dies before the first sync builds the group
        result = wsync.sync(0)
        assert set(result.failures) == {"e0"}
        assert isinstance(result.failures["e0"], ray.exceptions.RayActorError)
        assert list(wsync.engines) == ["e1"] and set(result.reports) == {"e1"}
        assert ray.get(engines["e1"].weight_version.remote()) == 0
        assert ray.get(engines["e1"].fingerprint.remote()) == _expected(0)
        ray.get(trainer.optimizer_step.remote(1))
        assert not wsync.sync(1).failures  # the next group is built without it
        assert ray.get(engines["e1"].fingerprint.remote()) == _expected(1)
    finally:
        ray.get(trainer.close_weights.remote())
        for a in (trainer, *engines.values()):
            ray.kill(a)


def _steady_model(step: int) -> dict[str, torch.Tensor]:
    """`_model(step)` but for a bias that never changes (its delta is empty: only its checksum)."""
    return {**_model(step), "layer.0.bias": _model(0)["layer.0.bias"]}


class SteadyTrainer(Trainer):
    def weight_tensors(self) -> Mapping[str, torch.Tensor]:
        return _steady_model(self.step)


class DamagedEngine(Engine):
    def damage(self) -> None:
        """Its weights stop being the version it records: the next delta's check fails."""
        self._weight_target.named_tensors()["layer.0.bias"][0] += 1


def test_an_engine_that_cannot_apply_collective_deltas_gets_the_whole_version(ray_session: Any) -> None:
    ray = ray_session
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    kwargs: dict[str, Any] = {"num_receivers": 2, "timeout_s": 60.0, "deltas": 1}
    trainer = ray.remote(num_cpus=0)(SteadyTrainer).remote("collective", kwargs)
    engines = {n: ray.remote(num_cpus=0)(DamagedEngine).remote("collective") for n in ("e0", "e1")}
    try:
        wsync = _sync(trainer, engines, VersionRegistry(), transport="collective")
        for version in range(2):  # the first whole, the second as deltas
            ray.get(trainer.train_step.remote())
            result = wsync.sync(version)
            assert not result.failures and all(r.applied for r in result.reports.values())
        assert result.manifest.deltas and result.reports["e0"].nbytes == result.manifest.deltas[0].nbytes
        ray.get(engines["e1"].damage.remote())
        ray.get(trainer.train_step.remote())
        with capture_logs() as logs:
            result = wsync.sync(2)
        # e1 rejected the deltas and got the whole version on the same group, e0 drained it
        assert not result.failures and result.manifest.deltas == ()
        (resent,) = [x for x in logs if x["event"] == "weights.sync.resent"]
        assert resent["rejected"] == ["e1"] and resent["dead"] == []
        for handle in engines.values():
            assert ray.get(handle.weight_version.remote()) == 2
            expected = {k: v.reshape(-1).view(torch.uint8).tolist() for k, v in _steady_model(3).items()}
            assert ray.get(handle.fingerprint.remote()) == expected
    finally:
        ray.get(trainer.close_weights.remote())
        for a in [trainer, *engines.values()]:
            ray.kill(a)
