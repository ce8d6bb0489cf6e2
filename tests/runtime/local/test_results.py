"""The pieces of `polyrl run`'s output that need no run: colours, result files and the summary, the
start-up phases, the series' first and last values, the reward window a checkpoint keeps."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import structlog

from polyrl_runtime.coordinator.metrics.records import RewardWindow, SeriesEnds
from polyrl_runtime.coordinator.metrics.startup import StartupPhases
from polyrl_runtime.coordinator.report import RunSummary
from polyrl_runtime.local.display import use_colour
from polyrl_runtime.local.results import FAILED_START, SUMMARY, summary_lines, write_results
from polyrl_runtime.logs import configure_logging


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(
    ("live", "tty", "environ", "colour"),
    [
        (None, True, {}, True),
        (True, True, {}, True),
        (False, True, {}, False),  # --plain
        (None, False, {}, False),  # a file or a pipe
        (None, True, {"NO_COLOR": "1"}, False),
        (None, True, {"NO_COLOR": ""}, True),  # the NO_COLOR convention: empty means unset
    ],
)
def test_colour_only_on_a_terminal_without_plain_or_no_color(
    live: bool | None, tty: bool, environ: dict[str, str], colour: bool
) -> None:
    assert use_colour(live, environ, _Stream(tty)) is colour


def test_console_logs_have_no_ansi_codes_without_colours() -> None:
    for colors, coded in ((False, False), (True, True)):
        stream = io.StringIO()
        configure_logging("console", environ={}, stream=stream, colors=colors)
        structlog.get_logger("polyrl_runtime.test").info("hello", key="value")
        assert ("\x1b[" in stream.getvalue()) is coded, stream.getvalue()
    configure_logging("json", environ={})


def _summary(state: str = "done", startup: dict[str, float] | None = None) -> RunSummary:
    return RunSummary(
        state=state,
        message="all policies finished" if state == "done" else "policy a: file:///m: no config.json",
        steps={"a": 2},
        first_reward={"a": 0.25},
        last_reward={"a": 0.75},
        wall_s=3.0,
        episodes=8,
        failed={},
        dropped={},
        checkpoint=None,
        first_success={"a": 0.2},
        last_success={"a": 0.7},
        startup=startup or {"ray": 1.25, "actors": 2.5},
    )


def _rows(out: Path, rewards: list[float]) -> None:
    lines = [
        {"policy": "a", "step": i + 1, "reward_mean": r, "success_mean": r} for i, r in enumerate(rewards)
    ]
    (out / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_the_summary_lists_only_result_files_that_exist(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")  # a run that started and stopped before its first step
    res = write_results(tmp_path, _summary(), started=True)
    assert not (tmp_path / "metrics.csv").exists() and res.plots == []
    assert json.loads((tmp_path / SUMMARY).read_text())["files"] == ["metrics.jsonl"]
    lines = summary_lines(_summary(), res)
    assert f"   metrics: {tmp_path / 'metrics.jsonl'}" in lines
    (tmp_path / "metrics.jsonl").unlink()
    res = write_results(tmp_path, _summary(), started=True)
    assert res.files == [] and not any(x.startswith("   metrics:") for x in summary_lines(_summary(), res))
    _rows(tmp_path, [0.25, 0.75])
    res = write_results(tmp_path, _summary(), started=True)
    assert [f.name for f in res.files] == ["metrics.jsonl", "metrics.csv"]
    assert [p.name for p in res.plots] == ["reward_a.png"]


def test_a_failed_start_writes_its_summary_beside_the_previous_one(tmp_path: Path) -> None:
    _rows(tmp_path, [0.25, 0.75])
    write_results(tmp_path, _summary(), started=True)
    before = (tmp_path / SUMMARY).read_bytes()
    failed = _summary("failed")
    res = write_results(tmp_path, failed, started=False)
    assert (tmp_path / SUMMARY).read_bytes() == before
    assert json.loads((tmp_path / FAILED_START).read_text())["state"] == "failed"
    lines = summary_lines(failed, res)
    assert lines[-1] == (
        f"   summary: {tmp_path / FAILED_START} (the run failed before it started; "
        f"the previous results are unchanged ({tmp_path / SUMMARY}))"
    )
    assert not any(x.startswith(("   metrics:", "   plot:")) for x in lines)


def test_the_printed_summary_gives_start_up_phases_and_the_series_first_and_last_values(
    tmp_path: Path,
) -> None:
    _rows(tmp_path, [0.25, 0.5, 0.75])
    s = _summary(
        startup={"ray": 1.25, "actors": 2.5, "model_load": 3.0, "trainer_init": 4.0, "first_weights": 0.5}
    )
    lines = summary_lines(s, write_results(tmp_path, s, started=True))
    assert (
        "   start-up: ray 1.2s, actors 2.5s, model load 3.0s, trainer init 4.0s, first weights 0.5s" in lines
    )
    [line] = [x for x in lines if x.startswith("   a:")]
    assert line.startswith("   a: 2 steps, reward 0.250 -> 0.750 (mean of the last 3 steps: 0.500)")
    assert ", success 0.20 -> 0.70 (mean of the last 3 steps: 0.50)" in line


def test_start_up_phases_are_timed_in_order_even_when_one_fails() -> None:
    phases = StartupPhases()
    with phases.timed("ray"):
        pass
    with pytest.raises(RuntimeError), phases.timed("actors"):
        raise RuntimeError("boom")
    assert list(phases.seconds) == ["ray", "actors"] and all(s >= 0 for s in phases.seconds.values())
    assert phases.describe().startswith("ray ") and ", actors " in phases.describe()


def test_series_ends_skip_steps_without_a_value() -> None:
    ends = SeriesEnds()
    for row in (
        {"policy": "a", "step": 1, "reward_mean": None, "success_mean": None},
        {"policy": "a", "step": 2, "reward_mean": 0.5, "success_mean": None},
        {"policy": "a", "step": 3, "reward_mean": 0.75, "success_mean": 1.0},
        {"policy": "a", "step": 4, "reward_mean": None, "success_mean": None},
    ):
        ends.add(row)
    assert (ends.first_of("a", "reward_mean"), ends.last_of("a", "reward_mean")) == (0.5, 0.75)
    assert (ends.first_of("a", "success_mean"), ends.last_of("a", "success_mean")) == (1.0, 1.0)
    assert ends.first_of("b", "reward_mean") is None


def test_the_reward_window_survives_a_checkpoint() -> None:
    window = RewardWindow(3)
    for r in (0.0, 1.0, 1.0, 0.5):
        window.add(r, r >= 1.0 if r != 0.5 else None)
    restored = RewardWindow(3)
    restored.restore(json.loads(json.dumps(window.state())))  # as state.json holds it
    assert restored.take() == window.take() == (2.5 / 3, 2 / 3, 4)
    assert restored.take() == (2.5 / 3, 2 / 3, 0)
