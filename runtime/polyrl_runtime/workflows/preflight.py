"""Start-up checks of the code a job names: everything the spec imports is imported once before any
Ray process starts (`polyrl run`, the coordinator pod) and again as the driver's first step, so a
typo in an import path fails the job at once, naming the field, instead of failing every episode.

What a job imports, and where it is named:

- `spec.workflow.entrypoint`: the workflow class. It is imported, then created with
  `spec.workflow.args` (less `policies`), so the checks of its own constructor run too
  (`PromptCompletion` loads its reward function there; unknown args are refused there).
- `spec.workflow.args`: every string in it, at any depth, of the form `module:attr` (Python names
  around one colon, no spaces, the form of `spec.workflow.entrypoint`) names code the workflow
  will import: a reward function (`ctx.reward("pkg.rewards:score")`), a tool, a helper class. Each
  is imported and its attribute looked up; a problem names its field (`spec.workflow.args.tools[1]`).

Data rows and evaluation name no code of their own: they are played by the same workflow, with the
reward functions its args name. `check_entry_points` raises one `PreflightError` listing every
problem; `entry_point_problems` returns them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from polyrl_operator.api import RLJobSpec
from polyrl_operator.api.patterns import ENTRYPOINT_PATTERN
from polyrl_runtime.rewards.load import ImportPathError, import_object
from polyrl_runtime.workflows.api import WorkflowImportError, create_workflow, import_workflow

_IMPORT_PATH = re.compile(ENTRYPOINT_PATTERN)
ARGS_FIELD = "spec.workflow.args"
ENTRYPOINT_FIELD = "spec.workflow.entrypoint"


@dataclass(frozen=True)
class EntryPointProblem:
    """One import path of the spec that does not work: the field naming it, the path, and why."""

    field: str
    path: str
    error: str

    def __str__(self) -> str:
        return f"{self.field}: {self.path!r}: {self.error}"


class PreflightError(ValueError):
    """The job names code that does not import; the message lists every problem, one a line."""

    def __init__(self, problems: list[EntryPointProblem]) -> None:
        self.problems = tuple(problems)
        lines = "".join(f"\n  {p}" for p in self.problems)
        super().__init__(f"the job's code does not import ({len(self.problems)} problem(s)):{lines}")


def import_paths(value: Any, field: str = ARGS_FIELD) -> Iterator[tuple[str, str]]:
    """(field, path) for every `module:attr` string in `value` (mappings and lists, at any depth),
    in document order."""
    if isinstance(value, str):
        if _IMPORT_PATH.match(value):
            yield field, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from import_paths(v, f"{field}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from import_paths(v, f"{field}[{i}]")


def entry_point_problems(spec: RLJobSpec) -> list[EntryPointProblem]:
    """Every import path of `spec` that does not import (empty: the job's code is all there)."""
    entrypoint, args = spec.workflow.entrypoint, spec.workflow.args
    problems: list[EntryPointProblem] = []
    cls: Any = None
    try:
        cls = import_workflow(entrypoint)
    except WorkflowImportError as e:
        problems.append(EntryPointProblem(ENTRYPOINT_FIELD, entrypoint, e.reason))
    for field, path in import_paths(args):
        try:
            import_object(path)
        except ImportPathError as e:
            problems.append(EntryPointProblem(field, path, str(e)))
    if problems:  # a constructor given an arg that does not import fails for the same reason
        return problems
    try:
        create_workflow(entrypoint, cls, args)
    except WorkflowImportError as e:
        field = ARGS_FIELD if e.field == "args" else ENTRYPOINT_FIELD
        problems.append(EntryPointProblem(field, entrypoint, e.reason))
    return problems


def check_entry_points(spec: RLJobSpec) -> None:
    """Raise a PreflightError listing every problem `entry_point_problems` finds."""
    problems = entry_point_problems(spec)
    if problems:
        raise PreflightError(problems)
