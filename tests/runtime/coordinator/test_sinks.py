"""Metric sinks (coordinator/metrics/sinks.py) in their offline and file modes, fed by a real job:
TensorBoard event files, a Weights & Biases offline run, an MLflow file store; read back with each
tool's own reader. The job checkpoints to S3, so the same run shows the JSONL series next to the
checkpoints and its continuation after a resume."""

from __future__ import annotations

import asyncio
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog
from driver_harness import make_job

from polyrl_operator.api import RLJob
from polyrl_operator.api.metrics import MetricsSink
from polyrl_runtime import storage
from polyrl_runtime.coordinator.checkpoints.store import checkpoint_root
from polyrl_runtime.coordinator.driver import Driver, DriverOptions
from polyrl_runtime.coordinator.metrics.files import read_metrics
from polyrl_runtime.coordinator.metrics.sinks import GuardedSink, MlflowSink, SinkError, build_sink
from polyrl_runtime.coordinator.report import RunSummary


def _wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """The history rows of a W&B offline run file: a LevelDB-style log (a 7-byte header, then
    records of checksum, length, type in 32 KiB blocks) of `wandb_internal_pb2.Record`s."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file}: not a W&B run file"
    pos, chunks, rows = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left  # a block's padding
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        chunks = chunk if kind in (1, 2) else chunks + chunk
        if kind in (1, 4):  # FULL or LAST: one record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                )
    return rows


def _job(bucket: str, tmp: Path, total: int) -> RLJob:
    sinks = [
        {"type": "tensorboard"},  # default: <metrics dir>/tensorboard, here in S3
        {"type": "wandb", "project": "polyrl-test", "mode": "offline"},
        {"type": "mlflow", "trackingUri": f"file://{tmp}/mlruns", "experiment": "tiny"},
    ]
    return make_job(
        training={"totalSteps": total},
        checkpoint={"uri": f"s3://{bucket}/jobs/sinks", "everySteps": 1, "keep": 2},
        metrics={"sinks": sinks},
    )


def _run(job: RLJob, tmp: Path) -> RunSummary:
    opts = DriverOptions(
        out_dir=tmp,
        checkpoint_root=checkpoint_root(job.spec.checkpoint.uri, tmp),
        place_by_resource=False,
        poll_s=0.2,
    )
    return asyncio.run(Driver(job, opts).run())


def test_every_sink_receives_the_steps_of_a_job_and_a_resumed_job_continues_the_series(
    ray_local: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    first = _run(_job(bucket, tmp_path, 2), tmp_path)
    assert first.state == "done", first.message
    series = f"s3://{bucket}/jobs/sinks/metrics"
    assert [r["step"] for r in read_metrics(series)] == [1, 2]
    # The pod died after writing step 3's row but before its checkpoint: the resumed job trains
    # step 3 again and its row replaces that one.
    parts = storage.list_names(series)
    assert all(p.startswith("part-") for p in parts if p != "tensorboard"), parts
    last = f"{series}/{sorted(p for p in parts if p.startswith('part-'))[-1]}"
    orphan = {"policy": "agent", "step": 3, "loss": 123.0}
    storage.write_bytes(last, storage.read_bytes(last) + (json.dumps(orphan) + "\n").encode())

    second = _run(_job(bucket, tmp_path, 4), tmp_path)
    assert second.state == "done", second.message
    assert [r.step for r in second.records] == [3, 4]
    rows = read_metrics(series)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    records = first.records + second.records
    assert [r["loss"] for r in rows] == [r.loss for r in records]  # the orphan is gone
    raw = b"".join(
        storage.read_bytes(f"{series}/{p}") for p in storage.list_names(series) if p.startswith("part-")
    )
    assert len(raw.decode().splitlines()) == 4  # stored once each

    # TensorBoard: the event files, uploaded next to the series
    tb = tmp_path / "tb"
    storage.get_tree(f"{series}/tensorboard", tb)
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in acc.Scalars("agent/loss")] == [
        (r.step, pytest.approx(r.loss)) for r in records
    ]
    assert [e.step for e in acc.Scalars("agent/reward_mean")] == [1, 2, 3, 4]

    # Weights & Biases: two offline run directories of one run id, each policy against its step
    runs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2 and all(r.name == "run-selfplay.wandb" for r in runs), runs
    history = [h for r in runs for h in _wandb_history(r)]
    assert [(h["agent/step"], pytest.approx(h["agent/loss"])) for h in history] == [
        (r.step, pytest.approx(r.loss)) for r in records
    ]

    # MLflow: one run in the experiment, found again on resume
    client = MlflowClient(tracking_uri=f"file://{tmp_path}/mlruns")
    exp = client.get_experiment_by_name("tiny")
    assert exp is not None
    [run] = client.search_runs([exp.experiment_id])
    losses = client.get_metric_history(run.info.run_id, "agent/loss")
    assert [(m.step, pytest.approx(m.value)) for m in losses] == [
        (r.step, pytest.approx(r.loss)) for r in records
    ]
    assert run.data.tags["polyrl.job"] == "selfplay"


def _mlflow_job(tmp: Path) -> tuple[MetricsSink, RLJob]:
    cfg = MetricsSink.model_validate({"type": "mlflow", "trackingUri": f"file://{tmp}/mlruns"})
    return cfg, make_job(metrics={"sinks": [cfg.model_dump(by_alias=True, exclude_none=True)]})


def test_a_failing_sink_is_reported_by_name_and_disabled_after_max_failures(tmp_path: Path) -> None:
    cfg, job = _mlflow_job(tmp_path)
    sink = build_sink(cfg, job, str(tmp_path / "metrics"), tmp_path, 0)
    assert isinstance(sink, MlflowSink)
    guarded = GuardedSink(sink, max_failures=3)
    row = {"policy": "agent", "step": 1, "loss": 0.5, "reward_mean": None}
    guarded.log(row)
    assert guarded.failures == 0
    storage.remove_tree(str(tmp_path / "mlruns"))  # the store is gone: every call fails from now on
    with structlog.testing.capture_logs() as logs:
        for step in range(2, 7):
            guarded.log({**row, "step": step})  # never raises
    failed = [e for e in logs if e["event"] == "metrics.sink_failed"]
    assert len(failed) == 3 and all(e["sink"] == "mlflow" for e in failed), logs
    assert [e["event"] for e in logs].count("metrics.sink_disabled") == 1
    assert guarded.disabled


@pytest.mark.parametrize(
    ("sink", "module"), [("wandb", "wandb"), ("mlflow", "mlflow"), ("tensorboard", "tensorboard")]
)
def test_a_sink_whose_package_is_missing_names_the_sink_and_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sink: str, module: str
) -> None:
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # what `import` sees when it is not installed
    cfg = MetricsSink.model_validate(
        {"type": sink, "project": "p", "trackingUri": f"file://{tmp_path}/m", "mode": "offline"}
    )
    with pytest.raises(
        SinkError,
        match=rf"the {sink} sink needs the '{module}' package: pip install 'polyrl-runtime\[metrics\]'",
    ):
        build_sink(cfg, make_job(), str(tmp_path), tmp_path, 0)
