"""The weight-receive call of a vLLM engine: its worker extension (vllm_worker.py) run on every
worker through `collective_rpc`, receiving one version from the trainer's broadcasts (`collective`)
or from the trainer's GPU memory (`cudaipc`), and what the workers' answers mean."""

from __future__ import annotations

from typing import Any

from polyrl_runtime.engines.vllm_worker import address_args, layout_args
from polyrl_runtime.weights.api import WeightManifest, WeightSyncError
from polyrl_runtime.weights.cudaipc import LAYOUT_ALIGN as CUDAIPC_ALIGN
from polyrl_runtime.weights.cudaipc_handle import CudaIpcHandle, handle_args


class WeightsMixedError(WeightSyncError):
    """Part of a version reached the served model before the sync failed."""


async def receive_on_workers(llm: Any, manifest: WeightManifest, *, apply: bool, timeout_s: float) -> int:
    """Run the worker extension on every worker of `llm` (vLLM's AsyncLLM); the number of tensors
    loaded, or raise. `apply=False`: take part in a broadcast without loading it (a cudaipc version
    waits for no one: nothing to do)."""
    ipc = isinstance(manifest.handle, CudaIpcHandle)
    if ipc and not apply:
        return 0
    if ipc:
        results = await llm.collective_rpc(
            "polyrl_receive_ipc",
            timeout=timeout_s + 60.0,
            kwargs={
                "policy": manifest.policy,
                "version": manifest.version,
                "handle": handle_args(manifest.handle),
                "layout": layout_args(manifest.layout, CUDAIPC_ALIGN),
                "timeout_s": timeout_s,
            },
        )
    else:
        results = await llm.collective_rpc(
            "polyrl_receive_version",
            timeout=timeout_s + 60.0,
            kwargs={
                "address": address_args(manifest.handle),
                "layout": layout_args(manifest.layout),
                "timeout_s": timeout_s,
                "apply": apply,
            },
        )
    errors = [r for r in results if r.get("error")]
    # Mixed when any worker wrote and any failed: TP ranks that read the trainer's memory each on
    # their own (cudaipc) may part ways.
    if errors and any(r.get("written") for r in results):
        raise WeightsMixedError(f"{manifest.policy} version {manifest.version}: {errors[0]['error']}")
    if errors:
        raise WeightSyncError(f"{manifest.policy} version {manifest.version}: {errors[0]['error']}")
    return int(results[0]["tensors"])
