"""`engine: vllm` serving several policies as LoRA adapters on one base (vLLM's multi-LoRA serving).

The engine starts vLLM with LoRA on (`polyrl_operator.api.lora_serving.vllm_lora_args`). Each version
of a policy's adapter arrives through the job's objectstore or shm transport into host tensors (checked
against the adapter's layout first: the first bad tensor is named), is written as a peft adapter
directory (`adapter_config.json` and `adapter_model.safetensors`) in a memory-backed directory
(`/dev/shm` where there is one) and added to vLLM under a LoRA id of its own (`AsyncLLM.add_lora`).

- New requests of that policy run with the new id; requests already running finish with the version
  they started with. So every token of a request has the version its request started with. (An
  adapter replaced in place under a running request would change version mid-sequence, and vLLM's
  weight-version spans are engine-wide, so nothing would record where.)
- A version's id is removed (`AsyncLLM.remove_lora`) and its directory deleted once a newer version
  serves and no request uses it.
- vLLM's prefix cache keys blocks by the adapter's name and path, so a new version never reuses the
  cached prefix of an old one, and the other adapters' cached blocks stay.
- Updating one policy pauses no request, its own included.
- A frozen policy of the shared base (`base_policies`) has no adapter and takes no LoRA slot: its
  requests carry no `LoRARequest`, so vLLM serves them with the base model as loaded, which no update
  changes (the trained policies' versions are adapters). A version naming it is refused.

A version that fails (a manifest that does not match the layout, vLLM refusing the adapter) raises
`WeightSyncError` naming the policy and the version; the previous version keeps serving.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from polyrl_operator.api import Lora
from polyrl_runtime.engines.adapters import UnknownAdapterError
from polyrl_runtime.models.lora_layout import AdapterLayout, adapter_layout
from polyrl_runtime.weights.api import (
    SyncReport,
    TensorTarget,
    VersionError,
    WeightManifest,
    WeightMismatchError,
    WeightReceiver,
    WeightSyncError,
    make_report,
)
from polyrl_runtime.weights.registry import make_receiver

log = structlog.get_logger(__name__)

# peft's prefix on the names in an adapter file (vLLM strips it when it parses them).
PEFT_FILE_PREFIX = "base_model.model."


ROOT_PREFIX = "polyrl-lora-"


def adapter_root(parent: Path | None = None) -> Path:
    """A private directory for this process's adapter versions, in memory where the host has /dev/shm,
    removed as the process exits. Directories that processes no longer alive left behind (an engine
    killed outright runs no exit handler) are removed first."""
    shm = Path("/dev/shm")
    parent = parent if parent is not None else shm if shm.is_dir() else Path(tempfile.gettempdir())
    for old in parent.glob(f"{ROOT_PREFIX}*-*"):
        pid = old.name.removeprefix(ROOT_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    root = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-", dir=parent))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def meta_layouts(
    model_dir: str, trust_remote_code: bool, loras: Mapping[str, Lora]
) -> dict[str, AdapterLayout]:
    """Each policy's adapter layout on the base model, from its config (built on the meta device: no
    weights are loaded; vLLM holds those)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    auto: Any = transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model: torch.nn.Module = auto.from_config(config, trust_remote_code=trust_remote_code)
    return {policy: adapter_layout(model, policy, lora) for policy, lora in loras.items()}


def staging_target(manifest: WeightManifest, layout: AdapterLayout) -> TensorTarget:
    """Host tensors for one version of `layout`'s adapter, in the dtype the trainer sent (vLLM casts
    to its LoRA dtype as it loads); raises `WeightMismatchError` at the first tensor whose name or
    shape differs from the layout, before anything is received."""
    shapes = layout.shapes()
    sent = {s.name: s for s in manifest.layout.specs}
    policy, version = manifest.policy, manifest.version
    for name, spec in sent.items():
        if name not in shapes:
            raise WeightMismatchError(name, "the adapter has no tensor of that name", policy, version)
        if tuple(spec.shape) != tuple(shapes[name]):
            raise WeightMismatchError(
                name, f"shape {spec.shape} != the adapter's {tuple(shapes[name])}", policy, version
            )
    for name in shapes:
        if name not in sent:
            raise WeightMismatchError(
                name, "the update does not contain this adapter tensor", policy, version
            )
    return TensorTarget({n: torch.empty(s.shape, dtype=s.dtype) for n, s in sent.items()})


def write_adapter(path: Path, tensors: Mapping[str, torch.Tensor], layout: AdapterLayout, lora: Lora) -> None:
    """One adapter version as the peft directory vLLM loads (`PEFTHelper.from_local_dir`)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    modules = sorted({m.rsplit(".", 1)[-1] for m in layout.layers})
    config = {
        "peft_type": "LORA",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": modules,
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(
        {PEFT_FILE_PREFIX + n: t.contiguous() for n, t in tensors.items()},
        str(path / "adapter_model.safetensors"),
    )


def receive_version(
    receiver: WeightReceiver, manifest: WeightManifest, layout: AdapterLayout, lora: Lora, path: Path
) -> None:
    """Receive one version of a policy's adapter and write it at `path` (blocking: run it off the event
    loop). Raises `WeightSyncError` naming the policy, the version and, for a mismatch, the tensor."""
    where = f"policy {manifest.policy} adapter version {manifest.version}"
    try:
        target = staging_target(manifest, layout)
        receiver.receive(manifest, target)
        write_adapter(path, target.named_tensors(), layout, lora)
    except WeightMismatchError:  # it names the policy, the version and the tensor
        shutil.rmtree(path, ignore_errors=True)
        raise
    except WeightSyncError as e:
        shutil.rmtree(path, ignore_errors=True)
        raise WeightSyncError(f"{where}: {e}") from e
    except Exception as e:
        shutil.rmtree(path, ignore_errors=True)
        raise WeightSyncError(f"{where}: {type(e).__name__}: {e}") from e


@dataclass
class AdapterVersion:
    """One version of a policy's adapter loaded in vLLM under `lora_id`."""

    policy: str
    version: int
    lora_id: int
    path: Path
    running: int = 0  # requests generating with it


@dataclass
class AdapterVersions:
    """Which version of each policy's adapter new requests get, and which older ones requests still use.

    `serving[policy]` is None until the policy's first version: its requests run on the base alone, which
    is what a fresh adapter (B = 0) gives."""

    root: Path
    serving: dict[str, AdapterVersion | None] = field(default_factory=dict)
    retiring: list[AdapterVersion] = field(default_factory=list)
    next_id: int = 1

    def version(self, policy: str) -> int:
        current = self.serving[policy]
        return -1 if current is None else current.version

    def versions(self) -> dict[str, int]:
        return {p: self.version(p) for p in self.serving}

    def new_path(self, policy: str, version: int) -> tuple[int, Path]:
        """A fresh LoRA id and directory for a version about to be received."""
        lora_id, self.next_id = self.next_id, self.next_id + 1
        return lora_id, self.root / f"{policy}-v{version}-id{lora_id}"

    def acquire(self, policy: str) -> AdapterVersion | None:
        """The version a new request of `policy` runs with (counted until `release`)."""
        current = self.serving[policy]
        if current is not None:
            current.running += 1
        return current

    def release(self, used: AdapterVersion | None) -> list[AdapterVersion]:
        """A request finished with `used`; returns versions now free to remove."""
        if used is not None:
            used.running -= 1
        return self._idle()

    def commit(self, policy: str, version: int, lora_id: int, path: Path) -> list[AdapterVersion]:
        """`version` serves `policy` from now on; returns versions now free to remove."""
        old = self.serving[policy]
        self.serving[policy] = AdapterVersion(policy, version, lora_id, path)
        if old is not None:
            self.retiring.append(old)
        return self._idle()

    def _idle(self) -> list[AdapterVersion]:
        idle = [v for v in self.retiring if v.running == 0]
        self.retiring = [v for v in self.retiring if v.running > 0]
        return idle


class VllmAdapters:
    """The adapters of one vLLM engine (`llm`, vLLM's `AsyncLLM`): which version each request gets, and
    each version received, written and added to vLLM (`receive`)."""

    def __init__(
        self,
        engine: str,
        llm: Any,
        lora_cls: Any,
        *,
        model_dir: str,
        trust_remote_code: bool,
        loras: Mapping[str, Lora],
        transport: str,
        transport_kwargs: Mapping[str, Any] | None,
        base_policies: Sequence[str] = (),
    ) -> None:
        self.engine, self._llm, self._lora_cls = engine, llm, lora_cls
        self.loras = dict(loras)
        self.base_policies = frozenset(base_policies)
        self.layouts = meta_layouts(model_dir, trust_remote_code, self.loras)
        self.versions = AdapterVersions(adapter_root(), serving=dict.fromkeys(self.loras))
        self._receiver = make_receiver(transport, **(transport_kwargs or {}))

    def acquire(self, policy: str) -> AdapterVersion | None:
        """The version a new request of `policy` runs with; `release` it when the request ends. None
        for a policy served the base alone (and for an adapter before its first version)."""
        if policy in self.base_policies:
            return None
        if policy not in self.loras:
            raise UnknownAdapterError(self.engine, policy, list(self.loras))
        return self.versions.acquire(policy)

    def request(self, adapter: AdapterVersion | None) -> Any:
        """vLLM's `LoRARequest` for `adapter` (None: the base alone, what an adapter serves before its
        first version)."""
        if adapter is None:
            return None
        return self._lora_cls(
            lora_name=adapter.policy, lora_int_id=adapter.lora_id, lora_path=str(adapter.path)
        )

    async def release(self, adapter: AdapterVersion | None) -> None:
        await self._remove(self.versions.release(adapter))

    async def receive(self, manifest: WeightManifest) -> SyncReport:
        """One version of one policy's adapter: received and written off the event loop, then added to
        vLLM under a new id. No request waits for it."""
        start = time.perf_counter()
        policy, version = manifest.policy, manifest.version
        if policy not in self.loras:
            raise UnknownAdapterError(self.engine, policy, list(self.loras))
        served = self.versions.version(policy)
        if version < served:
            raise VersionError(
                f"{policy}: update to version {version} is older than {self.engine}'s {served}"
            )
        if version == served:
            return make_report(manifest, start, 0.0, applied=False)
        lora_id, path = self.versions.new_path(policy, version)
        layout, lora = self.layouts[policy], self.loras[policy]
        await asyncio.to_thread(receive_version, self._receiver, manifest, layout, lora, path)
        adapter = AdapterVersion(policy, version, lora_id, path)
        try:
            loaded = await self._llm.add_lora(lora_request=self.request(adapter))
        except Exception as e:
            shutil.rmtree(path, ignore_errors=True)
            raise WeightSyncError(
                f"policy {policy} adapter version {version}: vLLM did not load it: {type(e).__name__}: {e}"
            ) from e
        if loaded is False:
            shutil.rmtree(path, ignore_errors=True)
            raise WeightSyncError(f"policy {policy} adapter version {version}: vLLM did not load it")
        await self._remove(self.versions.commit(policy, version, lora_id, path))
        log.info("vllm.adapter_applied", engine=self.engine, policy=policy, version=version, lora_id=lora_id)
        return make_report(manifest, start, 0.0, applied=True)

    async def _remove(self, idle: list[AdapterVersion]) -> None:
        """Drop versions that a newer one replaced and no request uses any more."""
        for old in idle:
            try:
                await self._llm.remove_lora(lora_id=old.lora_id)
            finally:
                shutil.rmtree(old.path, ignore_errors=True)
