"""The vLLM engine serving several policies as LoRA adapters on one base (`engines/vllm_lora.py`), on CPU
against a stand-in for vLLM's `AsyncLLM`; the names and keywords it calls are checked against the pinned
vLLM releases by test_vllm_contract.py.

What the adapter decides is checked here: vLLM starts with LoRA on and room for the adapters; each
version arrives through the shm transport, is written as the peft directory vLLM loads (peft itself
loads it back, tensor for tensor) and added under an id of its own; a request runs with its policy's
current id, and its tokens carry the version it started with; an update pauses nothing, and a replaced
version is removed only once its last request ends; a bad version names the policy, the version and the
first bad tensor and leaves the previous version serving."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from peft import PeftModel

from polyrl_operator.api import Lora
from polyrl_runtime.engines import vllm_api, vllm_lora
from polyrl_runtime.engines.adapters import UnknownAdapterError
from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.engines.vllm_engine import VllmEngine
from polyrl_runtime.models.lora_layout import adapter_layout
from polyrl_runtime.weights import make_sender
from polyrl_runtime.weights.api import WeightSyncError
from polyrl_testenv.vllm_outputs import two_tokens

LORAS = {
    "solver": Lora(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]),
    "verifier": Lora(rank=8, alpha=12, target_modules=["all-linear"]),
}


@dataclass
class _Request:
    """vLLM's `LoRARequest`, as the adapter builds it."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class FakeLLM:
    """`AsyncLLM` as far as an engine of adapters uses it; `hold` keeps requests generating."""

    engine_args: dict[str, Any]
    loaded: dict[int, str] = field(default_factory=dict)  # LoRA id -> path
    requests: list[Any] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    fail_load: bool = False
    hold: asyncio.Event | None = None

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> FakeLLM:
        return cls(dict(engine_args))

    async def generate(
        self, prompt: Any, sampling: Any, request_id: str, lora_request: Any = None
    ) -> AsyncIterator[Any]:
        self.requests.append(lora_request)
        if lora_request is not None:
            assert lora_request.lora_int_id in self.loaded  # vLLM would load it from its path otherwise
        if self.hold is not None:
            await self.hold.wait()
        spans = [type("Span", (), {"version": "9", "start": 0, "end": 2})()]  # engine-wide: not used
        yield two_tokens(weight_versions=spans)

    async def add_lora(self, lora_request: Any) -> bool:
        if self.fail_load:
            raise ValueError("LoRA rank 8 is greater than max_lora_rank 4.")
        files = sorted(p.name for p in Path(lora_request.lora_path).iterdir())
        assert files == ["adapter_config.json", "adapter_model.safetensors"]
        self.loaded[lora_request.lora_int_id] = lora_request.lora_path
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return self.loaded.pop(lora_id, None) is not None

    def shutdown(self) -> None:
        pass


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    classes = {"AsyncLLM": FakeLLM, "AsyncEngineArgs": dict, "SamplingParams": dict, "LoRARequest": _Request}
    monkeypatch.setattr(vllm_api, "load", lambda attr: classes[attr])
    yield


def _engine(model_dir: Path) -> VllmEngine:
    return VllmEngine("e0", "solver", f"file://{model_dir}", transport="shm", sleep_mode=True, adapters=LORAS)


def _llm(eng: VllmEngine) -> FakeLLM:
    llm = eng._llm
    assert isinstance(llm, FakeLLM)
    return llm


def _versions(model_dir: Path, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """One version of each policy's adapter: every tensor of its layout, drawn at random."""
    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for policy, lora in LORAS.items():
        shapes = adapter_layout(model, policy, lora).shapes()
        out[policy] = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    return out


def _params(policy: str) -> SamplingParams:
    return SamplingParams(max_new_tokens=2, policy=policy)


def test_vllm_starts_with_lora_and_room_for_every_adapter(fake_vllm: None, tiny_qwen2_dir: Path) -> None:
    args = _llm(_engine(tiny_qwen2_dir)).engine_args
    # two versions of each adapter side by side (an old one finishing its requests), rank 8 -> 8
    assert {k: args[k] for k in ("enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank")} == {
        "enable_lora": True,
        "max_loras": 4,
        "max_cpu_loras": 4,
        "max_lora_rank": 8,
    }
    assert (
        vllm_api.engine_args("/m", gpus=1, dtype="auto", seed=0, trust_remote_code=False, lora_ranks=[4, 33])[
            "max_lora_rank"
        ]
        == 64
    )  # rounded up to a rank vLLM serves
    with pytest.raises(ValueError, match="versions arrive through objectstore or shm"):
        VllmEngine("e0", "solver", f"file://{tiny_qwen2_dir}", transport="collective", adapters=LORAS)


def test_the_written_adapter_is_the_peft_directory_of_the_version(
    tmp_path: Path, tiny_qwen2_dir: Path
) -> None:
    tensors = _versions(tiny_qwen2_dir, seed=1)["verifier"]
    layout = vllm_lora.meta_layouts(str(tiny_qwen2_dir), False, LORAS)["verifier"]
    vllm_lora.write_adapter(tmp_path / "v1", tensors, layout, LORAS["verifier"])
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp_path / "v1"))
    assert model.peft_config["default"].r == 8 and model.peft_config["default"].lora_alpha == 12
    loaded = {
        n.removeprefix("base_model.model.").replace(".default.", "."): p
        for n, p in model.named_parameters()
        if ".lora_" in n
    }
    assert sorted(loaded) == sorted(tensors)
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_each_request_runs_with_its_policys_version_and_an_update_pauses_nothing(
    fake_vllm: None, tiny_qwen2_dir: Path
) -> None:
    eng = _engine(tiny_qwen2_dir)
    llm = _llm(eng)
    first, second = _versions(tiny_qwen2_dir, 1), _versions(tiny_qwen2_dir, 2)

    async def go() -> None:
        # before its first version an adapter serves the base alone (a fresh adapter's B is 0)
        gen = await eng.generate([1, 2], _params("solver"))
        assert llm.requests[-1] is None and gen.versions.tolist() == [-1, -1]
        sender = make_sender("shm", "solver", 1 << 20)
        report = await eng.receive_weights(sender.publish(1, first["solver"]))
        assert report.applied and report.nbytes == sum(t.nbytes for t in first["solver"].values())
        [(id1, path1)] = llm.loaded.items()
        gen = await eng.generate([1, 2], _params("solver"))
        assert llm.requests[-1] == _Request("solver", id1, path1)
        assert gen.versions.tolist() == [1, 1]  # the adapter's version, not vLLM's engine-wide label
        assert (await eng.generate([1, 2], _params("verifier"))).versions.tolist() == [-1, -1]
        assert eng.stats().adapters == {"solver": 1, "verifier": -1} and eng.weight_version() == -1

        # a solver request is running when version 2 arrives: nothing pauses, the running request
        # keeps version 1 (still loaded) and new requests get version 2
        llm.hold = asyncio.Event()
        running = asyncio.create_task(eng.generate([1, 2], _params("solver")))
        verifier = asyncio.create_task(eng.generate([3], _params("verifier")))
        await asyncio.sleep(0.05)
        v2 = sender.publish(2, second["solver"])
        assert (await eng.receive_weights(v2)).applied
        assert not eng.stats().paused and id1 in llm.loaded and llm.removed == []
        id2 = max(llm.loaded)
        newer = asyncio.create_task(eng.generate([1, 2], _params("solver")))
        await asyncio.sleep(0.05)
        assert llm.requests[-1].lora_int_id == id2
        llm.hold.set()
        assert (await running).versions.tolist() == [1, 1]
        assert (await newer).versions.tolist() == [2, 2]
        assert (await verifier).versions.tolist() == [-1, -1]
        # version 1 went once its last request ended: out of vLLM and off the disk
        assert llm.removed == [id1] and not Path(path1).exists() and set(llm.loaded) == {id2}
        assert (await eng.receive_weights(v2)).applied is False  # a resend
        sender.close()

    asyncio.run(go())


def test_a_bad_version_names_policy_version_and_tensor_and_the_previous_one_serves(
    fake_vllm: None, tiny_qwen2_dir: Path
) -> None:
    eng = _engine(tiny_qwen2_dir)
    llm = _llm(eng)
    good = _versions(tiny_qwen2_dir, 1)["verifier"]

    async def go() -> None:
        sender = make_sender("shm", "verifier", 1 << 20)
        await eng.receive_weights(sender.publish(1, good))
        bad = dict(good)
        name = sorted(bad)[3]
        bad[name] = torch.zeros(bad[name].shape[0], bad[name].shape[1] + 1)
        with pytest.raises(
            WeightSyncError,
            match=rf"policy verifier version 2: weight update rejected at tensor '{name}': shape",
        ):
            await eng.receive_weights(sender.publish(2, bad))
        missing = {n: t for n, t in good.items() if n != name}
        with pytest.raises(
            WeightSyncError, match=rf"policy verifier version 3: .*'{name}': the update does not contain"
        ):
            await eng.receive_weights(sender.publish(3, missing))
        llm.fail_load = True
        with pytest.raises(WeightSyncError, match="policy verifier adapter version 4: vLLM did not load it"):
            await eng.receive_weights(sender.publish(4, good))
        assert eng.stats().adapters["verifier"] == 1 and len(llm.loaded) == 1
        assert (await eng.generate([1], _params("verifier"))).versions.tolist() == [1, 1]
        with pytest.raises(UnknownAdapterError, match="holds none for policy 'critic'"):
            await eng.generate([1], _params("critic"))
        critic = make_sender("shm", "critic", 1 << 20)
        with pytest.raises(UnknownAdapterError):
            await eng.receive_weights(critic.publish(1, good))
        with pytest.raises(ValueError, match="sleeps at level 1 only"):
            await eng.sleep(2)
        sender.close()
        critic.close()

    asyncio.run(go())


def test_a_replaced_version_is_removed_once_no_request_uses_it(tmp_path: Path) -> None:
    versions = vllm_lora.AdapterVersions(tmp_path, serving={"a": None, "b": None})
    assert versions.acquire("a") is None and versions.release(None) == []
    assert versions.commit("a", 1, 1, tmp_path / "1") == []
    one = versions.acquire("a")
    two = versions.acquire("a")
    assert one is two and one is not None and one.running == 2
    assert versions.commit("a", 2, 2, tmp_path / "2") == []  # two requests still run on version 1
    assert versions.release(one) == []
    assert [v.version for v in versions.release(two)] == [1]
    assert versions.versions() == {"a": 2, "b": -1}


def test_adapter_directories_of_processes_that_are_gone_are_swept(tmp_path: Path) -> None:
    gone = tmp_path / f"{vllm_lora.ROOT_PREFIX}{2**22 + 7}-x"  # above any pid_max default: no process
    alive = tmp_path / f"{vllm_lora.ROOT_PREFIX}1-x"  # init
    for d in (gone, alive):
        (d / "solver-v1-id1").mkdir(parents=True)
    root = vllm_lora.adapter_root(tmp_path)
    assert (
        not gone.exists()
        and alive.exists()
        and root.name.startswith(f"{vllm_lora.ROOT_PREFIX}{os.getpid()}-")
    )


def test_a_frozen_policy_of_the_base_runs_without_a_lora_request_and_takes_no_slot(
    fake_vllm: None, tiny_qwen2_dir: Path
) -> None:
    """`base_policies`: vLLM gets room for the adapters only; a frozen policy's requests carry no
    `LoRARequest` (vLLM serves them the base as loaded) before and after the adapters' versions, at
    the base's version; it has no adapter in the stats and a version naming it is refused."""
    eng = VllmEngine(
        "e0",
        "solver",
        f"file://{tiny_qwen2_dir}",
        transport="shm",
        sleep_mode=True,
        adapters=LORAS,
        base_policies=("judge",),
    )
    llm = _llm(eng)
    assert (llm.engine_args["max_loras"], llm.engine_args["max_cpu_loras"]) == (4, 4)  # two adapters' room
    versions = _versions(tiny_qwen2_dir, 1)

    async def go() -> None:
        assert (await eng.generate([1, 2], _params("judge"))).versions.tolist() == [-1, -1]
        assert llm.requests[-1] is None
        sender = make_sender("shm", "solver", 1 << 20)
        assert (await eng.receive_weights(sender.publish(1, versions["solver"]))).applied
        assert (await eng.generate([1, 2], _params("solver"))).versions.tolist() == [1, 1]
        assert llm.requests[-1] is not None
        assert (await eng.generate([1, 2], _params("judge"))).versions.tolist() == [-1, -1]
        assert llm.requests[-1] is None  # the base, whatever the adapters' versions
        assert eng.stats().adapters == {"solver": 1, "verifier": -1}
        judge = make_sender("shm", "judge", 1 << 20)
        with pytest.raises(UnknownAdapterError, match="it holds none for policy 'judge'"):
            await eng.receive_weights(judge.publish(1, versions["solver"]))
        with pytest.raises(UnknownAdapterError, match="policy 'critic'"):
            await eng.generate([1, 2], _params("critic"))
        sender.close()
        judge.close()

    asyncio.run(go())
    with pytest.raises(ValueError, match="served the base alone need a shared base's adapters"):
        VllmEngine("e1", "judge", f"file://{tiny_qwen2_dir}", transport="shm", base_policies=("judge",))
