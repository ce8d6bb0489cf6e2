"""One log format: JSON lines in pods with the operator's keys, the console renderer on request."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from polyrl_runtime.logs import LogConfigError, configure_logging, log_format, pod_fields, started

POD_ENV = {
    "POLYRL_JOB": "debate",
    "POLYRL_NAMESPACE": "team-a",
    "POLYRL_POLICY": "speaker",
    "POLYRL_ROLE": "trainer",
    "POLYRL_POD_NAME": "debate-speaker-trainer-0",
}


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """Each test configures the process's logging; put back what the suite had."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    config = structlog.get_config()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(**config)


@pytest.mark.parametrize(
    ("environ", "default", "expected"),
    [
        ({}, "json", "json"),
        ({}, "console", "console"),
        ({"POLYRL_LOG_FORMAT": "console"}, "json", "console"),
        ({"POLYRL_LOG_FORMAT": " JSON "}, "console", "json"),
        ({"POLYRL_LOG_FORMAT": ""}, "console", "console"),
    ],
)
def test_the_format_is_the_entry_points_default_unless_the_environment_asks(
    environ: dict[str, str], default: str, expected: str
) -> None:
    assert log_format(environ, default) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"POLYRL_LOG_FORMAT": "xml"}, "POLYRL_LOG_FORMAT='xml': expected one of json, console"),
        ({"POLYRL_LOG_LEVEL": "loud"}, "POLYRL_LOG_LEVEL='LOUD': expected DEBUG, INFO, WARNING or ERROR"),
    ],
)
def test_an_unknown_setting_is_an_error_naming_the_variable(environ: dict[str, str], message: str) -> None:
    with pytest.raises(LogConfigError) as err:
        configure_logging(environ=environ, stream=io.StringIO())
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        (
            POD_ENV,
            {
                "job": "debate",
                "namespace": "team-a",
                "policy": "speaker",
                "role": "trainer",
                "pod": "debate-speaker-trainer-0",
            },
        ),
        (
            {**POD_ENV, "POLYRL_POLICY": ""},
            {"job": "debate", "namespace": "team-a", "role": "trainer", "pod": "debate-speaker-trainer-0"},
        ),
        ({}, {}),  # polyrl run: no pod
    ],
)
def test_the_pods_identity_comes_from_its_environment(
    environ: dict[str, str], expected: dict[str, str]
) -> None:
    assert pod_fields(environ) == expected


def test_a_pod_logs_json_lines_with_the_operators_keys() -> None:
    out = io.StringIO()
    assert configure_logging("json", environ=POD_ENV, stream=out) == "json"
    started("worker", role="trainer")
    structlog.get_logger("polyrl_runtime.pods.entry").info("worker.joined", address="h:6379")
    structlog.get_logger("polyrl_runtime.pods.entry").debug("hidden")  # below INFO
    logging.getLogger("aiohttp.server").warning("a library's warning")  # the stdlib bridge
    logging.getLogger("aiohttp.server").info("a library's chatter")  # below WARNING
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        structlog.get_logger("polyrl_runtime.x").exception("failed")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(line["event"], line["level"]) for line in lines] == [
        ("runtime.started", "info"),
        ("worker.joined", "info"),
        ("a library's warning", "warning"),
        ("failed", "error"),
    ]
    for line in lines:
        assert list(line)[:3] == ["event", "level", "timestamp"] and line["timestamp"].endswith("Z")
        assert {k: line[k] for k in ("job", "namespace", "policy", "role", "pod")} == pod_fields(POD_ENV)
    assert lines[1]["address"] == "h:6379" and lines[2]["logger"] == "aiohttp.server"
    assert "RuntimeError: boom" in lines[3]["exception"]


def test_the_console_renderer_on_request() -> None:
    out = io.StringIO()
    configure_logging("json", environ={"POLYRL_LOG_FORMAT": "console"}, stream=out)
    structlog.get_logger("polyrl_runtime.local").info("job.resumed", steps={"agent": 4})
    text = out.getvalue()
    assert "job.resumed" in text and "steps" in text and not text.startswith("{")


def test_the_entry_points_refuse_an_unknown_format_naming_the_variable(tmp_path: Path) -> None:
    env = {**os.environ, "POLYRL_LOG_FORMAT": "xml"}
    job = Path(__file__).parent / "data" / "selfplay-tiny.yaml"
    for argv in (
        [str(Path(sys.executable).parent / "polyrl"), "run", str(job), "--out", str(tmp_path)],
        [
            str(Path(sys.executable).parent / "polyrl-runtime"),
            "worker",
            "--config",
            str(job),
            "--role",
            "workflow",
        ],
    ):
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
        assert (r.returncode, r.stderr.strip()) == (
            2,
            "error: POLYRL_LOG_FORMAT='xml': expected one of json, console",
        )


def test_the_stdout_handler_follows_stdout_past_a_closed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from polyrl_runtime.logs import _StdoutHandler

    handler = _StdoutHandler()
    gone = io.TextIOWrapper(io.BytesIO())  # like pytest's capture: flushing it once closed raises
    monkeypatch.setattr(sys, "stdout", gone)
    handler.emit(logging.LogRecord("t", logging.WARNING, __file__, 1, "first", None, None))
    gone.close()  # a harness closed the stream the handler last wrote to
    now = io.StringIO()
    monkeypatch.setattr(sys, "stdout", now)
    handler.emit(logging.LogRecord("t", logging.WARNING, __file__, 2, "second", None, None))
    assert now.getvalue() == "second\n"
