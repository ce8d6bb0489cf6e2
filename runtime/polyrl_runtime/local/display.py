"""Live per-policy progress for `polyrl run`: a rich table on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.table import Table

from polyrl_runtime.coordinator.metrics.records import StepRecord


def use_colour(live: bool | None, environ: Mapping[str, str], stream: TextIO) -> bool:
    """Whether `polyrl run` colours its output: never under --plain (`live` False), when the output
    is not a terminal (a file, a pipe) or when NO_COLOR is set to anything but the empty string."""
    return live is not False and stream.isatty() and not environ.get("NO_COLOR")


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


class ProgressDisplay:
    def __init__(
        self,
        policies: list[str],
        total: int,
        *,
        live: bool | None = None,
        quiet: bool = False,
        colour: bool = True,
    ) -> None:
        self.policies, self.total, self.quiet = policies, total, quiet
        self.console = Console(stderr=False, no_color=not colour)
        self.live_mode = self.console.is_terminal if live is None else live
        self.latest: dict[str, StepRecord] = {}
        self._live: Live | None = None
        self._last_line = 0.0
        self._printed: dict[str, int] = {}
        self.started = time.monotonic()

    def __enter__(self) -> ProgressDisplay:
        if self.live_mode and not self.quiet:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(*exc)
            self._live = None

    def message(self, text: str) -> None:
        if self.quiet:
            return
        if self._live is not None:
            self._live.console.print(text)
        else:
            write(text)

    def record(self, rec: StepRecord) -> None:
        self.latest[rec.policy] = rec
        if self.quiet:
            return
        if self._live is not None:
            self._live.update(self._table())
            return
        every = max(1, self.total // 20)
        if rec.step % every == 0 or rec.step in (self.total, 1) or rec.eval_pass_at_k is not None:
            write(self._line(rec))

    def _line(self, r: StepRecord) -> str:
        succ = f" success {_fmt(r.success_mean, 2)}" if r.success_mean is not None else ""
        if r.eval_pass_at_k is not None:
            succ += f" eval pass@k {_fmt(r.eval_pass_at_k, 2)}"
        if r.rating is not None:
            succ += f" rating {r.rating:.0f} (v{r.rated_version})"
        return (
            f"[{r.elapsed_s:6.1f}s] {r.policy:>12} step {r.step:4d}/{self.total} reward {_fmt(r.reward_mean)}"
            f"{succ} staleness {r.staleness_mean:.2f}/{r.staleness_max} {r.samples_per_s:7.1f} samples/s"
        )

    def _table(self) -> Table:
        t = Table(title=f"polyrl run - {time.monotonic() - self.started:.0f}s", expand=False)
        rated = any(r.rating is not None for r in self.latest.values())  # a league or cross-play
        columns = ["policy", "step", "progress", "reward", "success", "staleness", "samples/s", "dropped"]
        for col in [*columns, *(["rating"] if rated else [])]:
            t.add_column(col, justify="right" if col != "policy" else "left")
        width = 24
        for p in self.policies:
            r = self.latest.get(p)
            step = r.step if r else 0
            filled = int(width * step / max(self.total, 1))
            bar = "#" * filled + "." * (width - filled)
            t.add_row(
                p,
                f"{step}/{self.total}",
                bar,
                _fmt(r.reward_mean if r else None),
                _fmt(r.success_mean if r else None, 2),
                f"{r.staleness_mean:.2f}/{r.staleness_max}" if r else "-",
                f"{r.samples_per_s:.0f}" if r else "-",
                str(sum(r.dropped_total.values())) if r else "-",
                *([f"{r.rating:.0f}" if r and r.rating is not None else "-"] if rated else []),
            )
        return t


def write(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
