"""Start-up checks of the code a job names (workflows/preflight.py): a workflow entrypoint, a reward
function or a tool that does not import fails the job at start, naming the field, the import path
and the underlying error, before Ray starts: through the function, `polyrl run` and the
coordinator pod."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator.api import RLJob
from polyrl_runtime.workflows.preflight import (
    EntryPointProblem,
    PreflightError,
    check_entry_points,
    entry_point_problems,
    import_paths,
)
from polyrl_testenv.localrun import polyrl_run, run_env

# A workflow of the user's own, beside the job file: it takes tools and a reward function by import
# path, and only uses them in run_episode (where a typo would otherwise fail every episode).
GAMES = """
from polyrl_runtime.workflows.api import Workflow


class ToolGame(Workflow):
    def __init__(self, tools=(), reward="exact_match", judge=None):
        super().__init__()
        self.tools, self.reward, self.judge = list(tools), reward, judge

    async def run_episode(self, ctx):
        raise NotImplementedError
"""
BROKEN = 'raise RuntimeError("this module needs a GPU")\n'
NOT_IMPORTED = "preflight_games_unimported"


@pytest.fixture(scope="module")
def games_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("games")
    (d / "preflight_games.py").write_text(GAMES)
    (d / "preflight_broken.py").write_text(BROKEN)
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))


def job_doc(entrypoint: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "polyrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "preflight"},
        "spec": {
            "training": {"totalSteps": 1, "episodesPerStep": 4},
            "workflow": {"entrypoint": entrypoint, "args": args},
            "policies": [
                {
                    "name": "agent",
                    "model": {"uri": "builtin://tiny"},
                    "algorithm": {"name": "grpo", "groupSize": 4},
                    "rollout": {"engine": "torch", "gpus": 0},
                    "trainer": {"backend": "deepspeed", "zeroStage": 1, "gpus": 0},
                }
            ],
        },
    }


def problems(entrypoint: str, args: dict[str, Any] | None = None) -> list[EntryPointProblem]:
    return entry_point_problems(RLJob.model_validate(job_doc(entrypoint, args)).spec)


PROMPTS = "polyrl_runtime.workflows.prompts:PromptCompletion"
GAME = "preflight_games:ToolGame"
CALC = "polyrl_runtime.workflows.tools:CALCULATOR"


def test_a_job_whose_code_imports_has_no_problem(games_dir: Path) -> None:
    assert problems(PROMPTS, {"reward": "polyrl_runtime.rewards.builtins:exact_match"}) == []
    assert problems(GAME, {"tools": [CALC], "judge": {"reward": "math"}}) == []
    # text that is not of the form module:attr is not taken for code
    assert problems(GAME, {"tools": ["Question: Answer", "http://x:8080", "12:30", "a:"]}) == []


@pytest.mark.parametrize(
    ("entrypoint", "args", "expected"),
    [
        (
            "no_such_package.games:Game",
            None,
            [
                (
                    "spec.workflow.entrypoint",
                    "no_such_package.games:Game",
                    "cannot import module 'no_such_package.games': ModuleNotFoundError: "
                    "No module named 'no_such_package'",
                )
            ],
        ),
        (
            "polyrl_runtime.workflows.signal:Nope",
            None,
            [
                (
                    "spec.workflow.entrypoint",
                    "polyrl_runtime.workflows.signal:Nope",
                    "module 'polyrl_runtime.workflows.signal' has no 'Nope'",
                )
            ],
        ),
        (  # the reward function a built-in workflow will call: its field, not a constructor error
            PROMPTS,
            {"reward": "no_such_rewards:score"},
            [
                (
                    "spec.workflow.args.reward",
                    "no_such_rewards:score",
                    "cannot import module 'no_such_rewards': ModuleNotFoundError: "
                    "No module named 'no_such_rewards'",
                )
            ],
        ),
        (  # a tool in a list, and a reward function nested in the args of a custom workflow
            GAME,
            {
                "tools": [CALC, "polyrl_runtime.workflows.tools:SEARCH"],
                "judge": {"reward": "preflight_broken:f"},
            },
            [
                (
                    "spec.workflow.args.tools[1]",
                    "polyrl_runtime.workflows.tools:SEARCH",
                    "module 'polyrl_runtime.workflows.tools' has no 'SEARCH'",
                ),
                (
                    "spec.workflow.args.judge.reward",
                    "preflight_broken:f",
                    "cannot import module 'preflight_broken': RuntimeError: this module needs a GPU",
                ),
            ],
        ),
        (  # the entrypoint and the args are all checked: every problem at once
            f"{NOT_IMPORTED}:Game",
            {"tools": ["no_such_tools:search"]},
            [
                (
                    "spec.workflow.entrypoint",
                    f"{NOT_IMPORTED}:Game",
                    f"cannot import module '{NOT_IMPORTED}': ModuleNotFoundError: No module named '{NOT_IMPORTED}'",
                ),
                (
                    "spec.workflow.args.tools[0]",
                    "no_such_tools:search",
                    "cannot import module 'no_such_tools': ModuleNotFoundError: No module named 'no_such_tools'",
                ),
            ],
        ),
    ],
)
def test_each_problem_names_the_field_the_path_and_the_error(
    games_dir: Path, entrypoint: str, args: dict[str, Any] | None, expected: list[tuple[str, str, str]]
) -> None:
    assert [(p.field, p.path, p.error) for p in problems(entrypoint, args)] == expected


def test_the_workflows_own_checks_run_at_start(games_dir: Path) -> None:
    # a misspelt built-in reward: PromptCompletion's constructor refuses it
    [p] = problems(PROMPTS, {"reward": "exact_mtch"})
    assert (p.field, p.path) == ("spec.workflow.args", PROMPTS)
    assert "RewardError: reward function 'exact_mtch': neither a built-in" in p.error
    [p] = problems(GAME, {"colour": "red"})
    assert p.field == "spec.workflow.args" and "unexpected keyword argument 'colour'" in p.error
    [p] = problems("polyrl_runtime.workflows.api:Outcome", {"rewards": {}})
    assert (p.field, p.error) == ("spec.workflow.entrypoint", "has no run_episode method")


def test_one_error_lists_every_problem(games_dir: Path) -> None:
    spec = RLJob.model_validate(job_doc("no_such_package.games:Game", {"tools": ["no_such_tools:x"]})).spec
    with pytest.raises(PreflightError) as info:
        check_entry_points(spec)
    message = str(info.value)
    assert message.splitlines() == [
        "the job's code does not import (2 problem(s)):",
        *(f"  {p}" for p in info.value.problems),
    ]
    assert "  spec.workflow.entrypoint: 'no_such_package.games:Game': cannot import module" in message
    assert "  spec.workflow.args.tools[0]: 'no_such_tools:x': cannot import module" in message


def test_import_paths_walk_the_args_in_order() -> None:
    args = {"a": "m:f", "b": [{"c": "p.q:R.s"}, 3, "no colon"], "d": {"e": ["x:y"]}, "f": True}
    assert list(import_paths(args)) == [
        ("spec.workflow.args.a", "m:f"),
        ("spec.workflow.args.b[0].c", "p.q:R.s"),
        ("spec.workflow.args.d.e[0]", "x:y"),
    ]


# -- `polyrl run` and the coordinator pod: before Ray ---------------------------------------------

BAD_JOBS = {
    "reward": (PROMPTS, {"reward": "my_rewards:score"}, "spec.workflow.args.reward", "'my_rewards:score'"),
    "entrypoint": ("my_games:Game", None, "spec.workflow.entrypoint", "'my_games:Game'"),
    "tool": (GAME, {"tools": [CALC, "my_tools:search"]}, "spec.workflow.args.tools[1]", "'my_tools:search'"),
}


@pytest.mark.parametrize("what", list(BAD_JOBS))
def test_polyrl_run_fails_before_ray_naming_the_field(tmp_path: Path, what: str) -> None:
    entrypoint, args, field, path = BAD_JOBS[what]
    # the user's own workflow module is in the directory polyrl run is started from
    (tmp_path / "preflight_games.py").write_text(GAMES)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job_doc(entrypoint, args)))
    r = polyrl_run("job.yaml", "--out", "out", "--plain", cwd=tmp_path)
    # 2: refused as bad input before Ray starts (a job that fails once running exits 1 with results)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    module = path.strip("'").split(":")[0]
    assert f"error: job.yaml: the job's code does not import (1 problem(s)):\n  {field}: {path}: " in r.stderr
    assert f"cannot import module '{module}': ModuleNotFoundError: No module named '{module}'" in r.stderr
    assert not (tmp_path / "out" / "summary.json").exists() and "running preflight" not in r.stdout


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except OSError:
        return None


def test_the_coordinator_pod_reports_the_problem_without_starting_ray(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http = int(s.getsockname()[1])
    config = tmp_path / "rljob.json"
    config.write_text(json.dumps(job_doc("my_games:Game")))
    env = {**run_env(), "POLYRL_LINGER_S": "600", "POLYRL_PODINFO_DIR": str(tmp_path / "podinfo")}
    out = tmp_path / "coordinator"
    args = ["coordinator", "--config", str(config), "--out", str(out), "--http-port", str(http)]
    bin_ = str(Path(sys.executable).parent / "polyrl-runtime")
    with (tmp_path / "log").open("wb") as log:
        proc = subprocess.Popen([bin_, *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        # the operator reads /progress: the failure, not retryable (the coordinator lingers until read)
        doc: Any = None
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            doc = _get(f"http://127.0.0.1:{http}/progress")
            if isinstance(doc, dict) and doc["state"] == "failed":
                break
            time.sleep(0.2)
        assert proc.wait(timeout=120) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    text = (tmp_path / "log").read_text()
    assert isinstance(doc, dict), text[-3000:]
    assert (doc["state"], doc["retryable"]) == ("failed", False)
    assert "spec.workflow.entrypoint: 'my_games:Game': cannot import module 'my_games'" in doc["message"]
    assert "job.preflight_failed" in text
    assert json.loads(text.strip().splitlines()[-1])["state"] == "failed"
    assert not (out / "ray-head.log").exists()  # no Ray head was started
