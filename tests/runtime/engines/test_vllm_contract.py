"""The vLLM contract, checked on CPU: every vLLM name the adapter uses exists in the pinned release.

Each pinned source release (`vllm_api.VLLM_RELEASES`, pure Python, checked against its sha256) is
downloaded once into `$POLYRL_CACHE/vllm` (default ~/.cache/polyrl) and read with `ast`; vLLM itself
is never imported. Two halves: the table (`vllm_api.VLLM_NAMES`) against vLLM's source, and the
adapter's own code against the table, so that a call on a vLLM object cannot bypass the table.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import tarfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from polyrl_operator.api.lora_serving import LORA_ENGINE_ARGS
from polyrl_runtime.engines import vllm_api, vllm_engine, vllm_lora, vllm_weight_rpc, vllm_worker
from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.engines.vllm_api import RECEIVERS, VLLM_NAMES, VllmName

ADAPTER_MODULES = (vllm_engine, vllm_lora, vllm_weight_rpc, vllm_worker, vllm_api)


def _fetch(version: str, dest: Path) -> None:
    url, sha256 = vllm_api.VLLM_RELEASES[version]
    archive = dest.parent / f"vllm-{version}.tar.gz"
    if not archive.exists():
        tmp = archive.with_suffix(".part")
        with urllib.request.urlopen(url, timeout=120) as r, tmp.open("wb") as f:
            shutil.copyfileobj(r, f)
        tmp.rename(archive)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != sha256:
        archive.unlink()
        raise RuntimeError(f"{archive}: sha256 {digest} != pinned {sha256}")
    staging = dest.with_suffix(".part")
    shutil.rmtree(staging, ignore_errors=True)
    top = f"vllm-{version}/"
    with tarfile.open(archive) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.isfile() and m.name.startswith(f"{top}vllm/") and m.name.endswith(".py")
        ]
        for m in members:
            m.name = m.name.removeprefix(top)
        tar.extractall(staging, members=members, filter="data")
    staging.rename(dest)


@pytest.fixture(scope="session", params=sorted(vllm_api.VLLM_RELEASES))
def vllm_src(request: pytest.FixtureRequest) -> Path:
    """The Python source of one pinned vLLM release (each test runs once per release)."""
    version = str(request.param)
    cache = Path(os.environ.get("POLYRL_CACHE", Path.home() / ".cache" / "polyrl")) / "vllm"
    dest = cache / f"vllm-{version}-src"
    if not dest.exists():
        cache.mkdir(parents=True, exist_ok=True)
        try:
            _fetch(version, dest)
        except Exception as e:  # no network: say so loudly, never pass
            pytest.skip(f"VLLM CONTRACT NOT CHECKED for {version}: cannot fetch its source release: {e}")
    return dest


class Source:
    """vLLM's modules as ASTs, with just enough name resolution for the contract."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: dict[str, ast.Module | None] = {}

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            base = self.root.joinpath(*module.split("."))
            path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)
            self._trees[module] = ast.parse(path.read_text()) if path else None
        return self._trees[module]

    def top(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """The definition of `name` in `module`, following `from ... import` re-exports."""
        tree = self.tree(module)
        if tree is None or depth > 8:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return module, node
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                return module, node
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == name
            ):
                return module, node
        for imp in ast.walk(tree):
            if isinstance(imp, ast.ImportFrom):
                for alias in imp.names:
                    if (alias.asname or alias.name) == name:
                        return self.top(self.absolute(module, imp), alias.name, depth + 1)
        return None

    def absolute(self, module: str, node: ast.ImportFrom) -> str:
        """The module a (possibly relative) `from ... import` in `module` names."""
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        is_package = self.root.joinpath(*parts, "__init__.py").exists()  # level 1 is the package itself
        base = parts[: len(parts) - node.level + (1 if is_package else 0)]
        return ".".join([*base, *([node.module] if node.module else [])])

    def classes(self, module: str, cls: ast.ClassDef) -> Iterator[tuple[str, ast.ClassDef]]:
        """`cls` and its bases that are vLLM classes, in method-resolution order (depth first)."""
        yield module, cls
        for base in cls.bases:
            name = base.id if isinstance(base, ast.Name) else None
            found = self.top(module, name) if name else None
            if found and isinstance(found[1], ast.ClassDef):
                yield from self.classes(found[0], found[1])

    def member(self, module: str, cls: ast.ClassDef, attr: str) -> ast.AST | None:
        for _, c in self.classes(module, cls):
            for node in c.body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == attr:
                    return node
                if (
                    isinstance(node, ast.AnnAssign)
                    and isinstance(node.target, ast.Name)
                    and node.target.id == attr
                ):
                    return node
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == attr for t in node.targets
                ):
                    return node
            for fn in c.body:  # instance attributes: self.attr = ... in any method
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for sub in ast.walk(fn):
                    target = sub.target if isinstance(sub, ast.AnnAssign) else None
                    targets = sub.targets if isinstance(sub, ast.Assign) else [target] if target else []
                    for t in targets:
                        if isinstance(t, ast.Attribute) and t.attr == attr and _last(t.value) == "self":
                            return sub
        return None

    def params(self, module: str, node: ast.AST) -> set[str] | None:
        """Keyword names a callable accepts (None: any, through **kwargs)."""
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if node.args.kwarg is not None:
                return None
            a = node.args
            return {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)} - {"self", "cls"}
        if isinstance(node, ast.ClassDef):
            names: set[str] = set()
            for _, c in self.classes(module, node):
                for item in c.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        init = self.params(module, item)
                        if init is None:
                            return None
                        names |= init
            return names
        return set()


def problems(src: Source, name: VllmName) -> list[str]:
    """What is wrong with one table entry against vLLM's source ([] when it holds)."""
    where = f"{name.module}.{name.attr}"
    head, _, rest = name.attr.partition(".")
    found = src.top(name.module, head)
    if found is None:
        return [f"{where}: {head} not found in {name.module}"]
    module, node = found
    if rest:
        if not isinstance(node, ast.ClassDef):
            return [f"{where}: {head} is not a class"]
        member = src.member(module, node, rest)
        if member is None:
            return [f"{where}: {head} has no attribute {rest}"]
        node = member
    out = []
    accepted = src.params(module, node)
    if accepted is not None:
        out += [f"{where}: no keyword argument {p!r}" for p in name.params if p not in accepted]
    # string and integer literals (`Literal[1, 8, 16]`: the LoRA ranks), compared as text
    strings = {
        str(n.value)
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str | int) and not isinstance(n.value, bool)
    }
    out += [f"{where}: value {v!r} not in its definition" for v in name.values if v not in strings]
    return out


def test_every_vllm_name_the_adapter_uses_exists_in_the_pinned_release(vllm_src: Path) -> None:
    src = Source(vllm_src)
    assert src.tree("vllm.v1.engine.async_llm") is not None, (
        "the pinned sdist has no vllm/v1/engine/async_llm.py"
    )
    found = [p for name in VLLM_NAMES for p in problems(src, name)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (VllmName("vllm.v1.engine.async_llm", "AsyncLLM.pause_generations"), "has no attribute"),
        (
            VllmName("vllm.v1.engine.async_llm", "AsyncLLM.pause_generation", ("modes",)),
            "no keyword argument",
        ),
        (
            VllmName("vllm.config.model", "LogprobsMode", values=("processed_logprob",)),
            "not in its definition",
        ),
        (VllmName("vllm.engine.arg_utils", "AsyncEngineArgs", ("logprob_mode",)), "no keyword argument"),
        (VllmName("vllm.v1.engine.async_llm", "AsyncLLMEngine"), "not found"),
        (VllmName("vllm.outputs", "CompletionOutput.weight_version"), "has no attribute"),
        # sleep mode: a rename of the methods or of their keywords fails the contract
        (VllmName("vllm.v1.engine.async_llm", "AsyncLLM.sleep_engine"), "has no attribute"),
        (VllmName("vllm.v1.engine.async_llm", "AsyncLLM.sleep", ("sleep_level",)), "no keyword argument"),
        (VllmName("vllm.v1.engine.async_llm", "AsyncLLM.wakeup"), "has no attribute"),
        (VllmName("vllm.engine.arg_utils", "AsyncEngineArgs", ("enable_sleep",)), "no keyword argument"),
        # LoRA serving: a rank vLLM does not list, a renamed method or keyword
        (VllmName("vllm.config.lora", "MaxLoRARanks", values=("24",)), "not in its definition"),
        (VllmName("vllm.v1.engine.async_llm", "AsyncLLM.add_adapter"), "has no attribute"),
        (VllmName("vllm.lora.request", "LoRARequest", ("lora_id",)), "no keyword argument"),
    ],
)
def test_the_check_fails_for_renamed_names(vllm_src: Path, name: VllmName, expected: str) -> None:
    found = problems(Source(vllm_src), name)
    assert found and expected in found[0], found


def test_the_worker_extension_does_not_clash_with_vllms_worker(vllm_src: Path) -> None:
    src = Source(vllm_src)
    found = src.top("vllm.v1.worker.gpu_worker", "Worker")
    assert found is not None and isinstance(found[1], ast.ClassDef)
    ours = [a for a in vars(vllm_worker.PolyrlWorkerExtension) if not a.startswith("__")]
    clashes = [a for a in ours if src.member(found[0], found[1], a) is not None]
    assert not clashes  # vLLM refuses to start with an extension attribute the worker has


# -- the adapter's code against the table --------------------------------------------------------


def _last(expr: ast.expr) -> str:
    """The last name of `a.b.c` (or of `c`); "" for anything else."""
    return expr.attr if isinstance(expr, ast.Attribute) else expr.id if isinstance(expr, ast.Name) else ""


def uses(source: str) -> list[str]:
    """Problems in adapter source: vLLM reached other than through the table."""
    table = {n.attr: n for n in VLLM_NAMES}
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            out += [f"line {node.lineno}: imports {m} directly" for m in mods if m.split(".")[0] == "vllm"]
        if isinstance(node, ast.Call):
            func = node.func
            fname = _last(func)
            loaded = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            via_table = (
                isinstance(func, ast.Attribute) and _last(func.value) == "vllm_api" and fname == "load"
            )
            if via_table and loaded not in table:
                out.append(f"line {node.lineno}: load({loaded!r}) is not in VLLM_NAMES")
            if fname == "import_module":
                out.append(f"line {node.lineno}: import_module outside vllm_api.load")
        if not isinstance(node, ast.Attribute):
            continue
        recv_name = _last(node.value)
        cls = RECEIVERS.get(recv_name)
        if cls is None or (cls.endswith("ForCausalLM") and hasattr(torch.nn.Module, node.attr)):
            continue  # a model is a torch module: its nn.Module methods are torch's, not vLLM's
        entry = table.get(f"{cls}.{node.attr}")
        if entry is None:
            out.append(
                f"line {node.lineno}: {recv_name}.{node.attr} ({cls}.{node.attr}) is not in VLLM_NAMES"
            )
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            cls = RECEIVERS.get(_last(node.func.value))
            entry = table.get(f"{cls}.{node.func.attr}") if cls else None
            if entry is not None:
                extra = [k.arg for k in node.keywords if k.arg and k.arg not in entry.params]
                out += [f"line {node.lineno}: {cls}.{node.func.attr}({k}=) not in VLLM_NAMES" for k in extra]
    return out


@pytest.mark.parametrize("module", ADAPTER_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_the_adapter_reaches_vllm_only_through_the_table(module: object) -> None:
    source = Path(str(getattr(module, "__file__", ""))).read_text()
    if module is vllm_api:  # the table's own loader is the one import_module allowed
        source = source.replace("importlib.import_module(n.module)", "None")
    assert not uses(source), "\n".join(uses(source))


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("self._llm.frobnicate()", "AsyncLLM.frobnicate"),
        ("self._llm.pause_generation(mode='keep', wait=True)", "pause_generation(wait=)"),
        ("import vllm", "imports vllm directly"),
        ("from vllm.sampling_params import SamplingParams", "imports vllm.sampling_params directly"),
        ("vllm_api.load('LLM')", "load('LLM')"),
        ("completion.cumulative_logprob", "CompletionOutput.cumulative_logprob"),
        ("tp.all_reduce(x)", "GroupCoordinator.all_reduce"),
        ("model.load_weights(weights=w, strict=True)", "load_weights(strict=)"),
        ("self.model_runner.load_model()", "GPUModelRunner.load_model"),
        ("self._llm.sleep(level=1, tags=['weights'])", "sleep(tags=)"),
    ],
)
def test_the_scan_catches_calls_outside_the_table(snippet: str, expected: str) -> None:
    found = uses(snippet)
    assert found and expected in found[0], found


def test_the_rpc_methods_the_engine_calls_are_on_the_worker_extension() -> None:
    sources = [Path(str(m.__file__)).read_text() for m in (vllm_engine, vllm_weight_rpc)]
    called = {
        node.args[0].value
        for source in sources
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and _last(node.func) == "collective_rpc"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }
    assert called == {"polyrl_receive_version", "polyrl_receive_ipc", "polyrl_device_memory"}
    assert all(callable(getattr(vllm_worker.PolyrlWorkerExtension, name)) for name in called)
    assert (
        f"{vllm_worker.__name__}.{vllm_worker.PolyrlWorkerExtension.__qualname__}"
    ) == vllm_api.WORKER_EXTENSION


def test_the_kwargs_the_adapter_builds_are_the_ones_the_table_lists() -> None:
    args = vllm_api.engine_args("/m", gpus=2, dtype="auto", seed=1, trust_remote_code=False)
    assert set(args) == set(vllm_api.ENGINE_ARG_KEYS)
    lora = vllm_api.engine_args(
        "/m", gpus=2, dtype="auto", seed=1, trust_remote_code=False, lora_ranks=[8, 16]
    )
    assert set(lora) == {*vllm_api.ENGINE_ARG_KEYS, *LORA_ENGINE_ARGS}
    assert set(vllm_api.sampling_kwargs(SamplingParams())) == set(vllm_api.SAMPLING_KEYS)
