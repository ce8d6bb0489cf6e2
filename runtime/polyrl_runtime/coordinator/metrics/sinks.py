"""Optional metric sinks: TensorBoard, Weights & Biases and MLflow (RLJob `spec.metrics.sinks`).

Each sink's package is imported only when the job names it; a missing one is a clear error naming
the sink and the extra that installs it. Every row goes to a sink as `<policy>/<metric>` at that
policy's step, so policies with different step counts share one run. Credentials are never passed
here: each client reads its own environment (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, ...), which the
operator fills from `spec.metrics.credentialsSecret`.

A sink that raises is logged (naming it) and, after `max_failures` failures in a row, disabled:
training never stops for a metrics sink (`GuardedSink`).
"""

from __future__ import annotations

import importlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import structlog

from polyrl_operator.api import RLJob
from polyrl_operator.api.metrics import MetricsSink
from polyrl_runtime import storage

log = structlog.get_logger(__name__)

EXTRA = "polyrl-runtime[metrics]"


class SinkError(RuntimeError):
    """A sink the job names cannot be used (its package is missing); the message says which."""


class Sink(Protocol):
    name: str

    def log(self, policy: str, step: int, values: dict[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of a row (not its policy, step or missing values)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k not in ("policy", "step") and isinstance(v, int | float) and not isinstance(v, bool)
    }


def _need(module: str, sink: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise SinkError(
            f"spec.metrics.sinks: the {sink} sink needs the {module.partition('.')[0]!r} package: "
            f"pip install '{EXTRA}' ({e})"
        ) from e


class TensorBoardSink:
    """Event files under `log_dir`; an object-store `log_dir` is written locally and uploaded at
    each flush (event files are append-only files, which object stores cannot hold open)."""

    name = "tensorboard"

    def __init__(self, log_dir: str, resume_step: int) -> None:
        _need("tensorboard", self.name)
        tb = _need("torch.utils.tensorboard", self.name)
        self.target = log_dir
        self._staging = tempfile.mkdtemp(prefix="polyrl-tb-") if storage.is_object_store(log_dir) else None
        local = self._staging or log_dir
        Path(local).mkdir(parents=True, exist_ok=True)
        # purge_step: TensorBoard hides events at and after it from earlier files (the steps a
        # resumed job trains again), so a resumed series has one value per step.
        self.writer = tb.SummaryWriter(log_dir=local, purge_step=resume_step + 1 if resume_step else None)

    def log(self, policy: str, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(f"{policy}/{k}", v, global_step=step)

    def flush(self) -> None:
        self.writer.flush()
        if self._staging is not None:
            storage.put_tree(Path(self._staging), self.target)

    def close(self) -> None:
        self.writer.close()
        if self._staging is not None:
            storage.put_tree(Path(self._staging), self.target)


class WandbSink:
    """One W&B run per job (its id from the job's name, so a resumed job continues it); each
    policy's metrics are plotted against that policy's own step (`<policy>/step`)."""

    name = "wandb"

    def __init__(self, cfg: MetricsSink, job: RLJob, directory: str, policies: list[str]) -> None:
        wandb = _need("wandb", self.name)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            dir=directory,
            name=job.metadata.name,
            id=_run_id(job),
            resume="allow",
            config={"policies": policies, "mode": job.spec.mode},
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )
        for p in policies:
            self.run.define_metric(f"{p}/step", hidden=True)
            self.run.define_metric(f"{p}/*", step_metric=f"{p}/step")

    def log(self, policy: str, step: int, values: dict[str, float]) -> None:
        self.run.log({f"{policy}/step": step, **{f"{policy}/{k}": v for k, v in values.items()}})

    def flush(self) -> None:
        """W&B's own process sends in the background."""

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """One MLflow run per job in `experiment`, found again by its `polyrl.job` tag on resume."""

    name = "mlflow"

    def __init__(self, cfg: MetricsSink, job: RLJob) -> None:
        tracking = _need("mlflow.tracking", self.name)
        if str(cfg.tracking_uri).startswith("file://"):
            # MLflow 3 refuses its file store unless asked; the job asked by naming a file:// URI.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        entities = _need("mlflow.entities", self.name)
        self._metric = entities.Metric
        self.client = tracking.MlflowClient(tracking_uri=cfg.tracking_uri)
        name = cfg.experiment or job.metadata.name
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        tag = _run_id(job)
        found = self.client.search_runs([exp_id], filter_string=f"tags.`polyrl.job` = '{tag}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
        else:
            run = self.client.create_run(exp_id, run_name=job.metadata.name, tags={"polyrl.job": tag})
            self.run_id = run.info.run_id

    def log(self, policy: str, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(f"{policy}/{k}", v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def flush(self) -> None:
        """Each `log` is one request already."""

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _run_id(job: RLJob) -> str:
    """The same for every attempt of the job (a resumed job continues its run)."""
    ns = job.metadata.namespace
    return f"{ns}-{job.metadata.name}" if ns else job.metadata.name


def build_sink(cfg: MetricsSink, job: RLJob, metrics_dir: str, out_dir: Path, resume_step: int) -> Sink:
    """The sink `cfg` names. Raises SinkError for a missing package; a client's own errors
    (an unreachable server) are the caller's to report."""
    if cfg.type == "tensorboard":
        log_dir = _local_or_uri(cfg.log_dir) if cfg.log_dir else storage.join(metrics_dir, "tensorboard")
        return TensorBoardSink(log_dir, resume_step)
    if cfg.type == "wandb":
        return WandbSink(cfg, job, str(out_dir), [p.name for p in job.spec.policies])
    return MlflowSink(cfg, job)


def _local_or_uri(uri: str) -> str:
    return uri if storage.is_object_store(uri) else str(storage.local_path(uri))


class GuardedSink:
    """A sink whose failures are logged and counted; disabled after `max_failures` in a row."""

    def __init__(self, sink: Sink, max_failures: int) -> None:
        self.sink, self.name, self.max_failures = sink, sink.name, max_failures
        self.failures = 0
        self.disabled = False

    def _call(self, what: str, fn: Callable[[], None]) -> None:
        if self.disabled:
            return
        try:
            fn()
        except Exception as e:
            self.failures += 1
            # The first line only: a client's error can carry a request dump, never a credential here
            # (they stay in the environment), but long dumps drown the log.
            error = (str(e).splitlines() or [repr(e)])[0][:300]
            log.warning("metrics.sink_failed", sink=self.name, call=what, error=error, failures=self.failures)
            if self.failures >= self.max_failures:
                self.disabled = True
                log.warning("metrics.sink_disabled", sink=self.name, failures=self.failures)
        else:
            self.failures = 0

    def log(self, row: dict[str, Any]) -> None:
        self._call("log", lambda: self.sink.log(str(row["policy"]), int(row["step"]), scalars(row)))

    def flush(self) -> None:
        self._call("flush", self.sink.flush)

    def close(self) -> None:
        self._call("close", self.sink.close)
