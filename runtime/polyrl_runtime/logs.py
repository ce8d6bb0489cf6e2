"""The runtime's log format: one JSON object per line in pods, a console renderer in `polyrl run`.

Pods log as the operator does (`polyrl_operator.cli.configure_logging`): structlog JSON lines with
`event`, `level`, `timestamp` (ISO, UTC) and the job's identity, so one cluster has one log format
that a log pipeline can index by `job`, `namespace`, `policy` and `role`. The identity comes from the
environment the operator gives every pod (docs/runtime-contract.md) and is added to every line by a
processor rather than bound in a context variable, so lines logged from threads carry it too.

Third-party libraries that log through the standard `logging` module (aiohttp, Ray's client,
DeepSpeed) go through the same renderer, at WARNING and above; our own loggers (`polyrl_runtime.*`)
log at `POLYRL_LOG_LEVEL` (default INFO). `POLYRL_LOG_FORMAT=console|json` overrides the default of
either entry point.

This module imports nothing heavy: a pod's process configures logging and says that it started before
it imports pydantic, aiohttp or Ray.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, Literal, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from polyrl_operator import pod_contract as contract

Format = Literal["json", "console"]
FORMAT_ENV = "POLYRL_LOG_FORMAT"
LEVEL_ENV = "POLYRL_LOG_LEVEL"
FORMATS: tuple[Format, ...] = ("json", "console")

# Pod environment variable -> log key; the keys match the operator's (job, namespace) and labels.
POD_FIELDS: dict[str, str] = {
    contract.ENV_JOB: "job",
    contract.ENV_NAMESPACE: "namespace",
    contract.ENV_POLICY: "policy",
    contract.ENV_POOL: "pool",
    contract.ENV_ROLE: "role",
    contract.ENV_POD_NAME: "pod",
}


class LogConfigError(ValueError):
    """A logging setting in the environment is not one we know; the message names the variable."""


def pod_fields(environ: Mapping[str, str]) -> dict[str, str]:
    """The pod's identity to add to every line: only the variables that are set and non-empty."""
    return {key: environ[var] for var, key in POD_FIELDS.items() if environ.get(var)}


def log_format(environ: Mapping[str, str], default: Format) -> Format:
    """The format `POLYRL_LOG_FORMAT` asks for, else `default`."""
    value = environ.get(FORMAT_ENV, "").strip().lower()
    if not value:
        return default
    if value not in FORMATS:
        raise LogConfigError(f"{FORMAT_ENV}={environ[FORMAT_ENV]!r}: expected one of {', '.join(FORMATS)}")
    return value


def log_level(environ: Mapping[str, str], level: str | None = None) -> int:
    name = (level or environ.get(LEVEL_ENV) or "INFO").strip().upper()
    value = logging.getLevelName(name)
    if not isinstance(value, int):
        raise LogConfigError(f"{LEVEL_ENV}={name!r}: expected DEBUG, INFO, WARNING or ERROR")
    return value


def _add_fields(fields: dict[str, str]) -> Processor:
    def add(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
        for key, value in fields.items():
            event_dict.setdefault(key, value)
        return event_dict

    return add


def _event_first(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """`event`, `level` and `timestamp` lead each line; a JSON line never starts with a payload key
    (the coordinator's last stdout line, its counters, is recognised by its first key)."""
    head = {k: event_dict.pop(k) for k in ("event", "level", "timestamp") if k in event_dict}
    return {**head, **event_dict}


class _StdoutHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to `sys.stdout` as it is at each record (test harnesses and redirections replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        # Not `setStream`: it flushes the stream it replaces, which a harness may have closed.
        self.stream = sys.stdout
        super().emit(record)


def configure_logging(
    default: Format = "json",
    *,
    level: str | None = None,
    environ: Mapping[str, str] | None = None,
    stream: TextIO | None = None,
    colors: bool = True,
) -> Format:
    """Configure structlog and the standard `logging` root for this process; returns the format used.
    `colors`: ANSI colours in the console format (`polyrl run` turns them off when its output is not a
    terminal, under --plain and with NO_COLOR).

    Idempotent: a second call replaces the first (tests and `polyrl run` after a pod's defaults)."""
    env = os.environ if environ is None else environ
    fmt = log_format(env, default)
    our_level = log_level(env, level)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_fields(pod_fields(env)),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    # The console renderer formats exceptions itself; JSON needs them as a string field.
    render: list[Processor] = (
        [structlog.processors.format_exc_info, _event_first, structlog.processors.JSONRenderer(default=str)]
        if fmt == "json"
        else [_event_first, structlog.dev.ConsoleRenderer(colors=colors)]
    )
    handler = _StdoutHandler() if stream is None else logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                *render,
            ],
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    for name in ("polyrl_runtime", "polyrl_operator", "__main__"):
        logging.getLogger(name).setLevel(our_level)
    return fmt


def started(command: str, **fields: Any) -> None:
    """The first line a pod's process logs: before any import or lock that could block."""
    structlog.get_logger("polyrl_runtime").info("runtime.started", command=command, pid=os.getpid(), **fields)
