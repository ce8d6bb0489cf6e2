"""What each runtime process imports as it starts: the start-up of `polyrl run` on 2 cores is mostly
imports, so the modules that cost seconds load only in the processes that use them.

Each check runs in a fresh interpreter: this suite's own process has imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from polyrl_runtime.imports import skipped_imports
from polyrl_runtime.netmap import free_port

HEAVY = ("torch", "transformers", "deepspeed", "sympy", "math_verify")


def imported_after(code: str, watch: tuple[str, ...]) -> dict[str, bool]:
    """Which of `watch` a fresh interpreter has imported after running `code`."""
    probe = (
        textwrap.dedent(code)
        + f"\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {watch!r}}}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, bool] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    "code",
    [
        # the local driver before Ray starts: CLI, job file, start-up checks of the job's code
        "import polyrl_runtime.cli, polyrl_runtime.local.run, polyrl_runtime.workflows.preflight",
        # a workflow worker: the runner, the built-in workflows and rewards, tokenizers by URI
        "import polyrl_runtime.workflows.runner, polyrl_runtime.workflows.guessing, polyrl_runtime.rewards",
        "from polyrl_runtime.models import load_tokenizer, model_dir, ModelLoadError",
    ],
    ids=["local-driver", "workflow-worker", "models-package"],
)
def test_light_processes_do_not_import_torch_or_sympy(code: str) -> None:
    assert imported_after(code, HEAVY) == dict.fromkeys(HEAVY, False)


def test_an_engine_imports_transformers_only_for_a_hugging_face_model(tiny_qwen2_dir: object) -> None:
    code = f"""
    import asyncio, sys
    from polyrl_runtime.engines.api import SamplingParams
    from polyrl_runtime.engines.torch_engine import TorchEngine

    def serve(uri):
        engine = TorchEngine("e0", "p", uri)
        asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2)))
        return "transformers" in sys.modules

    assert not serve("builtin://tiny")
    assert serve("file://{tiny_qwen2_dir}")
    """
    assert imported_after(code, ("transformers",)) == {"transformers": True}


def test_the_math_reward_imports_math_verify_in_its_own_process_only() -> None:
    """math-verify (and sympy) load in the reward's child process (rewards/isolated.py), never in
    the workflow worker that calls it."""
    code = """
    from polyrl_runtime.rewards.builtins import math_answer
    assert math_answer("the answer is $\\\\frac{1}{2}$", {"answer": "0.5"}) == 1.0
    """
    assert imported_after(code, ("math_verify", "sympy")) == {"math_verify": False, "sympy": False}


def test_deepspeed_is_imported_without_mlflow_which_stays_importable() -> None:
    code = """
    import importlib.util
    from polyrl_runtime.trainers.deepspeed_import import import_deepspeed
    import_deepspeed()
    assert "deepspeed" in __import__("sys").modules
    assert "mlflow" not in __import__("sys").modules
    if importlib.util.find_spec("mlflow") is not None:
        import mlflow  # the rest of the process imports it as usual
    """
    assert imported_after(code, ("deepspeed",)) == {"deepspeed": True}


def test_deepspeeds_muon_optimizer_is_imported_without_compiling_it() -> None:
    """DeepSpeed imports its Muon module to build ZeRO engines and reduce gradients; decorated with
    torch.compile, it would import TorchInductor (about 2 s of CPU per trainer rank). It is imported
    once, uncompiled, and torch.compile is itself again afterwards."""
    code = """
    import torch
    compile_ = torch.compile
    from polyrl_runtime.trainers.deepspeed_import import import_deepspeed
    import_deepspeed()
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from deepspeed.runtime.zero.muon import original_muon
    assert torch.compile is compile_
    assert not hasattr(original_muon.muon_update, "_torchdynamo_orig_callable")  # a plain function
    """
    watch = ("deepspeed.runtime.zero.muon.muon_optimizer", "torch._inductor")
    assert imported_after(code, watch) == {watch[0]: True, watch[1]: False}


def test_deepspeed_joins_a_gloo_group_without_building_its_cpu_comm_op(tmp_path: Path) -> None:
    """The shared-memory comm op serves only DeepSpeed's inference all-reduce: `init_distributed`
    neither compiles it (about 80 s of CPU in a fresh environment) nor loads it, and gloo's
    collectives work as before."""
    code = f"""
    import os
    os.environ.update(TORCH_EXTENSIONS_DIR={str(tmp_path / "ext")!r}, MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str({free_port()}), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch
    from polyrl_runtime.trainers.deepspeed_import import import_deepspeed
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    assert deepspeed.comm.get_world_size() == 1
    t = torch.ones(3)
    deepspeed.comm.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]
    from deepspeed.comm.torch import build_shm_op
    assert build_shm_op() is None
    assert not os.path.exists(os.path.join({str(tmp_path / "ext")!r}, "deepspeed_shm_comm"))
    # Left to interpreter exit, gloo's threads can end in "terminate called without an active
    # exception" (SIGABRT) after every check above has passed.
    torch.distributed.destroy_process_group()
    """
    assert imported_after(code, ("deepspeed",)) == {"deepspeed": True}


def test_skipped_imports_raise_import_error_and_are_restored() -> None:
    name = "json.tool"  # a real module this process has not imported
    sys.modules.pop(name, None)
    with skipped_imports((name,)), pytest.raises(ImportError):
        __import__(name)
    assert name not in sys.modules
    assert __import__(name) is not None  # importable again


def test_skipped_imports_leave_an_imported_module_alone() -> None:
    with skipped_imports(("json",)):
        import json as again
    assert again is json
    assert sys.modules["json"] is json


def test_a_pods_ray_start_has_the_start_command_without_serve_jobs_or_state() -> None:
    code = """
    from polyrl_runtime.pods.ray_cli import load_cli
    commands = set(load_cli().commands)
    assert "start" in commands and "stop" in commands, commands
    assert not commands & {"serve", "job", "list", "logs"}, commands
    """
    assert imported_after(code, ("ray.serve", "ray.util.state")) == {
        "ray.serve": False,
        "ray.util.state": False,
    }
