"""Hugging Face exports of a trained policy: directories `from_pretrained` and vLLM load.

`<checkpoint root>/export/step-NNNNNN/<policy>/` holds the served weights (what weight sync
publishes, `publish.published_tensors`: the base model's parameter names, LoRA adapters merged in,
tied weights once, gathered bucket by bucket under ZeRO-3) as safetensors, sharded
at 5 GB with an index like `save_pretrained` writes, beside `config.json`, `generation_config.json`
and the tokenizer files (chat template included) of the policy's model. With LoRA the adapters are
also written to `adapter/` by peft's `save_pretrained` (`adapter_config.json` and
`adapter_model.safetensors`), for engines that serve adapters over the base model.

Every rank calls `export_policy` (under ZeRO-3 the gathers are collective); only the writer
(rank 0) keeps the gathered copies and writes. The writer
holds one full copy of the weights in host memory while writing. A directory is written under a
`.tmp` name and renamed when complete, so a reader of a local export never sees half of it (an
object-store export is staged locally and uploaded by the trainer, `storage.staged_dir`).

A plain-torch built-in model (`builtin://tiny`) is not a Hugging Face model: its export is its
parameters in `model.safetensors` plus `polyrl-model.json` naming the built-in URI, which
`from_pretrained` does not load (documented; the toys exist for tests and the quickstart).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import structlog
import torch

from polyrl_runtime import storage
from polyrl_runtime.trainers.deepspeed_import import import_deepspeed
from polyrl_runtime.trainers.lora import Gather, adapter_tensors, base_model, is_peft
from polyrl_runtime.trainers.publish import published_tensors

log = structlog.get_logger(__name__)

EXPORT_DIR = "export"
BUILTIN_MANIFEST = "polyrl-model.json"


def export_location(root: str | Path, step: int, policy: str) -> str:
    """Where a policy's export of `step` goes under the checkpoint root (a path or an object-store URI)."""
    return storage.join(root, EXPORT_DIR, f"step-{step:06d}", policy)


def export_due(step: int, total_steps: int, every: int | None) -> bool:
    """Export after this optimizer step: every `every` steps (if set) and at the last step."""
    return step >= total_steps or (every is not None and step % every == 0)


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host in a storage of its own: safetensors refuses views into a larger buffer (ZeRO
    keeps parameters as views of flat buffers), and gathered copies need no second copy."""
    t = t.detach().to("cpu")
    whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def _is_hf(model: torch.nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def export_policy(
    module: torch.nn.Module,
    directory: Path,
    *,
    source_dir: Path | None,
    source_uri: str,
    gather: Gather | None = None,
    writer: bool = True,
) -> Path | None:
    """Write the served model of `module` (a Hugging Face model, a peft model around one, or a
    built-in toy) to `directory`; returns it on the writer, None elsewhere. `source_dir` is the
    policy's model directory, whose tokenizer is exported with the weights (None for a toy)."""
    published = published_tensors(module, gather, keep=writer)
    tensors = {name: _standalone(t) for name, t in published.items()}
    adapters = adapter_tensors(module, gather) if is_peft(module) else {}
    if not writer:
        return None
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    base = base_model(module)
    if _is_hf(base):
        _write_hf(base, tensors, tmp, source_dir)
        if adapters:
            _write_adapter(module, {k: v.to("cpu") for k, v in adapters.items()}, tmp / "adapter")
    else:
        from safetensors.torch import save_file

        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / BUILTIN_MANIFEST).write_text(json.dumps({"uri": source_uri, "format": "polyrl-builtin"}))
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)
    log.info("export.written", uri=source_uri, path=str(directory), tensors=len(tensors), lora=bool(adapters))
    return directory


def _write_adapter(module: Any, state: dict[str, torch.Tensor], directory: Path) -> None:
    """The active adapter alone, as peft writes a model's only adapter (`adapter_config.json`,
    `adapter_model.safetensors` in `directory`). peft writes an adapter that is not named `default`
    (one of several policies' on a shared base, named as its policy) into a subdirectory of that
    name: it is moved up."""
    active = module.active_adapter
    module.save_pretrained(str(directory), state_dict=state, selected_adapters=[active])
    nested = directory / active
    if active != "default" and nested.is_dir():
        for item in nested.iterdir():
            item.rename(directory / item.name)
        nested.rmdir()


def _write_hf(model: Any, tensors: dict[str, torch.Tensor], directory: Path, source_dir: Path | None) -> None:
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(tensors, directory, max_shard_size="5GB", metadata={"format": "pt"})
    model.config.save_pretrained(str(directory))
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(directory))
    if source_dir is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(source_dir)).save_pretrained(str(directory))


def zero_gather(zero_stage: int) -> Gather | None:
    """How to read full parameters under a ZeRO stage: only ZeRO-3 partitions them."""
    if zero_stage != 3:
        return None
    deepspeed = import_deepspeed()

    def gather(params: list[torch.nn.Parameter]) -> Any:
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    return gather
