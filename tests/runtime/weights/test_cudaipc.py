"""The `cudaipc` transport's parts that need no GPU: what it refuses, and the guard that says which
version the trainer's tensors still hold. Its data path (CUDA IPC between processes, in-process reads,
throughput) is the gpu tier's: tests/runtime/gpu/test_cudaipc_cuda.py."""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time

import pytest
import torch

from polyrl_runtime.weights import (
    TensorTarget,
    WeightManifest,
    WeightMismatchError,
    WeightSyncError,
    make_receiver,
    make_sender,
)
from polyrl_runtime.weights.buckets import layout_for
from polyrl_runtime.weights.cudaipc import CudaIpcHandle, CudaIpcReceiver, CudaIpcSender
from polyrl_runtime.weights.serve_guard import ServeGuard


def _sender(timeout_s: float = 600.0) -> CudaIpcSender:
    sender = make_sender("cudaipc", "alice", 1 << 20, timeout_s=timeout_s)
    assert isinstance(sender, CudaIpcSender)
    return sender


def _foreign(manifest: WeightManifest, **changes: object) -> WeightManifest:
    """The manifest as an engine in another process (or on another host) sees it."""
    handle = dataclasses.replace(manifest.handle, process="elsewhere", **changes)
    return dataclasses.replace(manifest, handle=handle)


def test_publish_refuses_host_tensors_naming_policy_and_tensor() -> None:
    sender = _sender()
    try:
        with pytest.raises(WeightSyncError, match=r"alice: tensor 'w' is on cpu: cudaipc needs CUDA tensors"):
            sender.publish(0, {"w": torch.ones(3)})
        assert sender.latest is None
        with pytest.raises(WeightSyncError, match="nothing published yet"):
            sender.resend()
    finally:
        sender.close()


def test_a_version_is_served_until_release_source() -> None:
    # A version without bytes runs the whole protocol on any machine (no storage to map).
    sender = _sender()
    receiver = make_receiver("cudaipc")
    try:
        manifest = pickle.loads(pickle.dumps(sender.publish(0, {})))  # as it crosses Ray
        report = receiver.receive(manifest, TensorTarget({}))
        assert report.applied and report.transport == "cudaipc" and report.control_messages == 1
        assert sender.resend() is sender.latest
        # A late joiner in another process, before the trainer changes its tensors: served.
        assert receiver.receive(_foreign(manifest), TensorTarget({})).applied
        sender.release_source()
        assert sender.resend() is None  # only the next publish can bring new engines
        for late in (manifest, _foreign(manifest)):
            target = TensorTarget({})
            with pytest.raises(WeightSyncError, match="version 0 is no longer served"):
                receiver.receive(late, target)
            assert target.version == -1 and target.updates == 0  # its pause never began
        nxt = sender.publish(1, {})
        assert receiver.receive(nxt, TensorTarget({})).applied
    finally:
        sender.close()
        receiver.close()


def test_release_source_waits_for_an_engine_still_reading() -> None:
    sender = _sender()
    try:
        manifest = sender.publish(3, {})
        engine = ServeGuard(manifest.handle.guard, create=False)  # what a receiver holds while it copies
        assert engine.acquire(exclusive=False, timeout_s=1.0)
        releasing = threading.Thread(target=sender.release_source)
        releasing.start()
        time.sleep(0.2)
        assert releasing.is_alive() and engine.served() == 3  # not cleared under the reader
        engine.release()
        releasing.join(timeout=10)
        assert not releasing.is_alive() and engine.served() == -1
        engine.close()
    finally:
        sender.close()


def test_a_stalled_engine_does_not_stop_the_trainer() -> None:
    sender = _sender(timeout_s=0.05)
    try:
        manifest = sender.publish(0, {})
        engine = ServeGuard(manifest.handle.guard, create=False)
        assert engine.acquire(exclusive=False, timeout_s=1.0)
        sender.release_source()  # gives up waiting; the engine finds the word changed after its copy
        assert engine.served() == -1
        engine.release()
        engine.close()
    finally:
        sender.close()


def test_after_close_the_guard_is_gone() -> None:
    sender = _sender()
    manifest = sender.publish(0, {})
    sender.close()
    receiver = CudaIpcReceiver()
    with pytest.raises(WeightSyncError, match=r"cudaipc guard .* is gone: the trainer closed its sender"):
        receiver.receive(_foreign(manifest), TensorTarget({}))


def _manifest(tensors: dict[str, torch.Tensor], uuid: str) -> WeightManifest:
    layout = layout_for(tensors, 1024)
    fake_storage = (torch.Tensor, torch.Size([8]), (1,), 0, None, torch.uint8, 0, b"h" * 64, 8, 0, False)
    handle = CudaIpcHandle(uuid, "elsewhere", "s", "/nonexistent/guard", (fake_storage,), ((0, 0),))
    return WeightManifest("alice", 1, "cudaipc", layout, handle=handle)


def test_an_engine_off_the_trainers_gpu_host_keeps_its_weights() -> None:
    target = TensorTarget({"w": torch.zeros(2)})
    with pytest.raises(WeightSyncError) as info:
        CudaIpcReceiver().receive(_manifest({"w": torch.ones(2)}, "GPU-5e1f"), target)
    message = str(info.value)
    assert message.startswith("alice: cudaipc needs the engine on the trainer's GPU host")
    assert "no visible device has UUID GPU-5e1f" in message
    assert target.version == -1 and target.updates == 0 and not target.named_tensors()["w"].any()


def test_a_mismatched_manifest_is_rejected_before_anything_is_mapped() -> None:
    target = TensorTarget({"w": torch.zeros(2)})
    with pytest.raises(WeightMismatchError, match="'w'"):
        CudaIpcReceiver().receive(_manifest({"w": torch.ones(3)}, "GPU-5e1f"), target)
    assert target.version == -1 and target.updates == 0
