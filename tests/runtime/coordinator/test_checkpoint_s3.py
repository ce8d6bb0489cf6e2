"""Checkpoints in an object store (a genuine S3 server on loopback): the store's invariants, and a job
that checkpoints to s3:// and resumes from it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from driver_harness import make_job, policy

from polyrl_runtime import storage
from polyrl_runtime.coordinator.checkpoints.store import BUFFER, STATE, CheckpointStore, checkpoint_root
from polyrl_runtime.coordinator.driver import Driver, DriverOptions
from polyrl_runtime.experience.buffer import BufferSnapshot


def _snapshot(marker: int) -> BufferSnapshot:
    return BufferSnapshot((), marker, {}, {}, {}, False)


def _write(store: CheckpointStore, step: int, *, complete: bool = True) -> str:
    location = store.begin(step)
    with storage.staged_dir(storage.join(location, "trainers", "agent")) as d:  # what a rank does
        (d / "ckpt").mkdir()
        (d / "ckpt" / "model.pt").write_bytes(b"w" * 1000)
    if complete:
        store.commit(location, {"step": step, "policies": {}}, _snapshot(step))
    else:  # the writer is gone: what it wrote is a leftover
        store.abandon(location)
    return location


def test_an_s3_store_lists_only_complete_checkpoints_and_prunes_old_ones(bucket: str) -> None:
    root = f"s3://{bucket}/jobs/a/"
    store = CheckpointStore(root, keep=2)
    assert store.latest() is None
    for step in (1, 2):
        _write(store, step)
    assert [r.step for r in store.all()] == [1, 2]
    _write(store, 3, complete=False)  # a crash while checkpointing: no state.json
    latest = store.latest()
    assert latest is not None and latest.step == 2  # the incomplete one is ignored
    assert latest.location == f"s3://{bucket}/jobs/a/step-000002"
    assert latest.buffer().capacity_episodes == 2
    assert storage.list_names(latest.trainer_dir("agent")) == ["ckpt"]
    with pytest.raises(ValueError, match="an object-store checkpoint has no local path"):
        _ = latest.path
    _write(store, 4)  # keep 2: step 1 and the incomplete step 3 are deleted
    assert storage.list_names(f"s3://{bucket}/jobs/a") == ["step-000002", "step-000004"]
    assert [r.step for r in CheckpointStore(root, keep=2).all()] == [2, 4]
    names = storage.list_names(f"s3://{bucket}/jobs/a/step-000004")
    assert names == [BUFFER, STATE, "trainers"]


def test_a_checkpoint_begun_again_at_a_step_loses_its_state_first(bucket: str) -> None:
    store = CheckpointStore(f"s3://{bucket}/jobs/b", keep=3)
    _write(store, 5)
    store.begin(5)  # a new attempt at the same step: the old one is no longer complete
    assert store.latest() is None
    assert storage.list_names(f"s3://{bucket}/jobs/b") == []


def test_checkpoint_root_keeps_object_store_uris_and_maps_local_ones(tmp_path: Path) -> None:
    assert checkpoint_root("s3://bkt/jobs/x/", tmp_path) == "s3://bkt/jobs/x"
    assert checkpoint_root(f"file://{tmp_path}/c", tmp_path) == tmp_path / "c"
    assert checkpoint_root(None, tmp_path) == tmp_path / "checkpoints"
    with pytest.raises(ValueError, match=r"checkpoint\.uri gs://b/x: use file://, pvc:// or s3://"):
        checkpoint_root("gs://b/x", tmp_path)


def _run(uri: str, tmp: Path, total: int) -> tuple[Driver, Any]:
    job = make_job(training={"totalSteps": total}, checkpoint={"uri": uri, "everySteps": 1, "keep": 3})
    opts = DriverOptions(
        out_dir=tmp,
        checkpoint_root=checkpoint_root(job.spec.checkpoint.uri, tmp),
        place_by_resource=False,
        poll_s=0.2,
    )
    driver = Driver(job, opts)
    return driver, asyncio.run(driver.run())


def test_a_job_checkpoints_to_s3_and_a_second_run_resumes_from_it(
    ray_local: Any, bucket: str, tmp_path: Path
) -> None:
    uri = f"s3://{bucket}/jobs/selfplay"
    _, first = _run(uri, tmp_path, total=2)
    assert first.state == "done", first.message
    store = CheckpointStore(uri, keep=3)
    refs = store.all()
    assert [r.step for r in refs] == [1, 2]
    assert first.checkpoint == f"{uri}/step-000002"
    trainer = refs[-1].trainer_dir("agent")
    assert "ckpt" in storage.list_names(trainer)  # the rank's DeepSpeed files were uploaded
    assert storage.list_names(storage.join(trainer, "ckpt")), "no DeepSpeed files under the tag"
    assert not any(tmp_path.rglob("step-*")), "checkpoints were written locally"
    produced = refs[-1].buffer().policies["agent"]["produced"]
    assert isinstance(produced, int)

    _, second = _run(uri, tmp_path, total=4)
    assert second.state == "done", second.message
    assert [r.step for r in second.records] == [3, 4]  # continues after the checkpoint, no repeats
    assert second.episodes > first.episodes
    latest = store.latest()
    assert latest is not None and latest.step == 4
    assert latest.state["policies"]["agent"]["step"] == 4
    resumed = latest.buffer().policies["agent"]["produced"]
    assert isinstance(resumed, int) and resumed > produced


def test_a_model_uri_with_nothing_behind_it_fails_the_job_naming_the_policy_and_uri(
    ray_local: Any, bucket: str, tmp_path: Path
) -> None:
    model = f"s3://{bucket}/models/not-uploaded"
    job = make_job(policies=[policy(model={"uri": model})])
    driver = Driver(
        job, DriverOptions(out_dir=tmp_path, checkpoint_root=tmp_path / "ckpt", place_by_resource=False)
    )
    summary = asyncio.run(driver.run())
    assert summary.state == "failed" and not driver.retryable
    assert f"policy agent: {model}: no objects under this prefix" in summary.message, summary.message
