"""Versioned weight sync, trainer -> rollout engines, behind one interface with one module per transport.

sender = make_sender("shm", policy="alice", bucket_bytes=256 << 20)
manifest = sender.publish(version, model.state_dict())       # the one control message
receiver = make_receiver("shm")
report = receiver.receive(manifest, TensorTarget.from_module(engine_model))   # all or nothing
"""

from polyrl_runtime.weights.api import (
    SyncReport,
    TensorTarget,
    VersionError,
    WeightManifest,
    WeightMismatchError,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    WeightTarget,
)
from polyrl_runtime.weights.buckets import BucketLayout, TensorSpec, plan_buckets
from polyrl_runtime.weights.registry import (
    DEFAULT_TRANSPORT,
    TRANSPORTS,
    choose_transport,
    choose_transports,
    get_transport,
    make_receiver,
    make_sender,
    register_transport,
    registered,
    sender_options,
)
from polyrl_runtime.weights.versions import VersionRegistry

__all__ = [
    "DEFAULT_TRANSPORT",
    "TRANSPORTS",
    "BucketLayout",
    "SyncReport",
    "TensorSpec",
    "TensorTarget",
    "VersionError",
    "VersionRegistry",
    "WeightManifest",
    "WeightMismatchError",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "WeightTarget",
    "choose_transport",
    "choose_transports",
    "get_transport",
    "make_receiver",
    "make_sender",
    "plan_buckets",
    "register_transport",
    "registered",
    "sender_options",
]
