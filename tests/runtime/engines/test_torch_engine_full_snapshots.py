"""Past versions of full weights in the torch engine (engines/full_snapshots.py): each snapshot a host
copy, served through serving copies of the model (an engine each), the least recently used idle copy
switched when another snapshot is asked for. A request naming a snapshot gets exactly what
transformers gives with that version's weights, and each token records that version."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import transformers

from polyrl_runtime.engines.api import Generation, RequestAbortedError, SamplingParams, UnknownSnapshotError
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_testenv.models import greedy_reply, lively_qwen2, moved_model, publish_full

PROMPTS = [[5 + (i * 37 + n) % 300 for i in range(n)] for n in (1, 3, 9, 20, 6, 14)]


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lively_qwen2(tiny_qwen2_dir, tmp_path_factory.mktemp("full") / "base", seed=1)


def _model(model_dir: Path, version: int) -> transformers.PreTrainedModel:
    model: transformers.PreTrainedModel = moved_model(model_dir, version)
    return model


def _engine(model_dir: Path, slots: int = 1) -> TorchEngine:
    return TorchEngine(
        "e0", "player", f"file://{model_dir}", transport="shm", seed=3, dtype="float32", snapshot_slots=slots
    )


async def _publish(eng: TorchEngine, model: Any, version: int) -> None:
    await publish_full(eng, model, version, "player")


def _greedy(n: int, snapshot: int | None, request_id: str = "") -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, snapshot=snapshot, request_id=request_id)


def _check(
    g: Generation, model: transformers.PreTrainedModel, prompt: list[int], n: int, version: int
) -> None:
    assert g.token_ids.tolist() == greedy_reply(model, prompt, n)
    assert (g.versions == version).all() and g.engine == "e0"


def test_snapshots_serve_their_versions_beside_the_current_one(model_dir: Path) -> None:
    eng, models = _engine(model_dir, slots=2), {v: _model(model_dir, v) for v in (1, 2, 3)}
    asks = [None, 1, 2, 1, None, 2]

    async def go() -> list[Generation]:
        await _publish(eng, models[1], 1)
        report = await eng.snapshot("player", 2)
        assert (report.version, report.held, report.evicted) == (1, (1,), ())
        model_bytes = sum(p.nbytes for p in models[1].parameters())
        assert report.nbytes == model_bytes  # one host copy; a CPU engine's serving copy shares it
        assert (await eng.snapshot("player", 2)).held == (1,)  # the same version again: nothing to do
        await _publish(eng, models[2], 2)
        assert (await eng.snapshot("player", 2)).held == (1, 2)
        await _publish(eng, models[3], 3)
        return list(
            await asyncio.gather(
                *(eng.generate(p, _greedy(10, s)) for p, s in zip(PROMPTS, asks, strict=True))
            )
        )

    gens = asyncio.run(go())
    for p, s, g in zip(PROMPTS, asks, gens, strict=True):
        version = 3 if s is None else s
        _check(g, models[version], p, 10, version)
    st = eng.stats()
    assert st.snapshots == {"player": [1, 2]} and st.version == 3 and st.in_flight == 0
    assert st.extra["snapshot_serving_copies"] == 2 and st.extra["snapshot_switches"] == 2
    assert st.extra["snapshot_host_bytes"] == 2 * sum(p.nbytes for p in models[1].parameters())


def test_one_serving_copy_switches_between_snapshots_least_recently_used(model_dir: Path) -> None:
    eng, models = _engine(model_dir, slots=1), {v: _model(model_dir, v) for v in (1, 2, 3)}

    async def go() -> None:
        for v in (1, 2):
            await _publish(eng, models[v], v)
            await eng.snapshot("player", 4)
        await _publish(eng, models[3], 3)
        # Both at once: one copy serves one snapshot at a time, the other's request waits for it.
        a, b = await asyncio.gather(
            eng.generate(PROMPTS[2], _greedy(8, 1)), eng.generate(PROMPTS[3], _greedy(8, 2))
        )
        _check(a, models[1], PROMPTS[2], 8, 1)
        _check(b, models[2], PROMPTS[3], 8, 2)
        assert eng.stats().extra["snapshot_switches"] == 2
        again = await eng.generate(PROMPTS[0], _greedy(4, 2))  # held by the copy: no switch
        _check(again, models[2], PROMPTS[0], 4, 2)
        assert eng.stats().extra["snapshot_switches"] == 2
        current = await eng.generate(PROMPTS[1], _greedy(4, None))  # the engine's own weights
        _check(current, models[3], PROMPTS[1], 4, 3)

    asyncio.run(go())


def test_an_evicted_snapshot_finishes_what_runs_and_refuses_the_rest(model_dir: Path) -> None:
    eng, models = _engine(model_dir), {v: _model(model_dir, v) for v in (1, 2)}

    async def go() -> None:
        await _publish(eng, models[1], 1)
        await eng.snapshot("player", 1)
        running = asyncio.create_task(eng.generate(PROMPTS[3], _greedy(40, 1)))
        while eng.stats().extra.get("snapshot_switches", 0) < 1:
            await asyncio.sleep(0.001)
        await _publish(eng, models[2], 2)
        report = await eng.snapshot("player", 1)
        assert (report.held, report.evicted) == ((2,), (1,))
        with pytest.raises(
            UnknownSnapshotError, match=r"no snapshot of policy 'player' at version 1 \(it holds: 2\)"
        ):
            await eng.generate(PROMPTS[0], _greedy(4, 1))
        _check(await running, models[1], PROMPTS[3], 40, 1)  # its copy kept version 1's weights
        _check(await eng.generate(PROMPTS[0], _greedy(4, 2)), models[2], PROMPTS[0], 4, 2)

    asyncio.run(go())


def test_an_engine_that_joins_serves_copies_of_anothers_snapshots(model_dir: Path) -> None:
    old, new, models = _engine(model_dir), _engine(model_dir), {v: _model(model_dir, v) for v in (1, 2)}

    async def go() -> None:
        for v in (1, 2):
            await _publish(old, models[v], v)
            await old.snapshot("player", 2)
        states = await old.snapshot_state("player", [1, 2])
        report = await new.load_snapshots("player", states, 1)  # keep 1: the newest only
        assert (report.held, report.evicted) == ((2,), ())
        _check(await new.generate(PROMPTS[4], _greedy(6, 2)), models[2], PROMPTS[4], 6, 2)
        with pytest.raises(UnknownSnapshotError, match="at version 0"):
            await old.snapshot_state("player", [0])

    asyncio.run(go())


def test_sleep_drops_the_serving_copies_and_snapshot_requests_wait_for_the_wake(model_dir: Path) -> None:
    eng, models = _engine(model_dir), {v: _model(model_dir, v) for v in (1, 2)}

    async def go() -> None:
        await _publish(eng, models[1], 1)
        await eng.snapshot("player", 2)
        await _publish(eng, models[2], 2)
        _check(await eng.generate(PROMPTS[1], _greedy(4, 1)), models[1], PROMPTS[1], 4, 1)
        assert eng.stats().extra["snapshot_serving_copies"] == 1
        await eng.sleep(1)
        assert eng.stats().extra["snapshot_serving_copies"] == 0
        waiting = asyncio.create_task(eng.generate(PROMPTS[2], _greedy(5, 1)))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await eng.wake_up()
        _check(await asyncio.wait_for(waiting, 60), models[1], PROMPTS[2], 5, 1)

    asyncio.run(go())


def test_a_snapshot_request_aborts_by_id_and_bad_calls_are_refused_by_name(model_dir: Path) -> None:
    eng, models = _engine(model_dir), {v: _model(model_dir, v) for v in (1,)}

    async def go() -> None:
        with pytest.raises(UnknownSnapshotError, match=r"version 0 \(it holds: none\)"):
            await eng.generate(PROMPTS[0], _greedy(4, 0))
        with pytest.raises(
            ValueError, match="engine e0 serves policy player's full weights: it holds no snapshots of judge"
        ):
            await eng.snapshot("judge", 2)
        with pytest.raises(ValueError, match="keep must be at least 1, got 0"):
            await eng.snapshot("player", 0)
        await _publish(eng, models[1], 1)
        await eng.snapshot("player", 1)
        task = asyncio.create_task(eng.generate(PROMPTS[3], _greedy(500, 1, request_id="r1")))
        while eng.stats().in_flight == 0 or eng.stats().extra.get("snapshot_switches", 0) < 1:
            await asyncio.sleep(0.001)
        await eng.abort(["r1"])
        with pytest.raises(RequestAbortedError):
            await task
        assert eng.stats().extra["snapshot_serving_copies"] == 1

    asyncio.run(go())
    with pytest.raises(ValueError, match="residentSnapshots must be at least 1, got 0"):
        asyncio.run(_engine(model_dir, slots=0).snapshot("player", 1))
