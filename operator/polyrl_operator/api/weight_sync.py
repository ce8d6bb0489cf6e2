"""How each trainer ships new weights to its policy's rollout engines (`spec.weightSync`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from polyrl_operator.api.base import ApiModel, Rule
from polyrl_operator.api.patterns import WEIGHT_SYNC_URI_PATTERN

# `auto` and the transports the runtime registers (polyrl_runtime/weights/registry.py takes its list
# from here).
TransportName = Literal["auto", "objectstore", "shm", "collective", "cudaipc", "storage"]


class WeightSync(ApiModel):
    """How each trainer ships new weights to its policy's rollout engines."""

    __rules__ = (
        Rule(
            cel="!has(self.transport) || self.transport != 'storage' || has(self.uri)",
            message="transport storage writes each version under uri: set uri (s3://BUCKET/PREFIX or "
            "file:///PATH)",
            check=lambda w: w.transport != "storage" or w.uri is not None,
            field=".uri",
        ),
        Rule(
            cel="!has(self.uri) || (has(self.transport) && self.transport == 'storage')",
            message="uri is where transport storage writes versions; the other transports have no use "
            "for it: set transport storage or remove uri",
            check=lambda w: w.uri is None or w.transport == "storage",
            field=".uri",
        ),
    )

    transport: TransportName = Field(
        "auto",
        description="auto picks the best available; objectstore (Ray, works everywhere), shm (same host), "
        "collective (gloo on CPU, NCCL on GPU), cudaipc (GPU trainer and its rollout on one pool: engines "
        "copy the trainer's GPU memory through CUDA IPC, no network; auto picks it there), storage "
        "(versions written under uri, an object store or a shared file system: for engines in another "
        "cluster or a remote pool; a whole version every fullEvery versions and the bit-exact deltas "
        "in between).",
    )
    bucket_mb: int = Field(256, ge=1, le=16384, alias="bucketMB", description="Flattened bucket size in MiB.")
    deltas: int = Field(
        0,
        ge=0,
        le=64,
        description="Beside each version, also publish the bit-exact deltas from the version before "
        "(changed elements and a checksum per tensor, the whole tensor where that is smaller), and "
        "list those of the last N versions in each update: an engine that holds one of those versions "
        "fetches the deltas instead of the whole version, checks every tensor, and fetches the whole "
        "version if any check fails. The trainer keeps a host copy of its last version. 0: off. Needs "
        "transport objectstore, or collective (torch engines): each version is broadcast as the deltas "
        "from the one before, and an engine that cannot apply them gets the whole version (storage "
        "writes deltas by fullEvery).",
    )
    uri: str | None = Field(
        None,
        max_length=1024,
        pattern=WEIGHT_SYNC_URI_PATTERN,
        description="Transport storage: where versions are written, under <uri>/<policy>/ "
        "(s3://BUCKET/PREFIX, credentials from spec.storage.credentialsSecret, or file:///PATH on a "
        "file system every trainer and engine shares). The trainer prunes what no engine can need.",
    )
    full_every: int = Field(
        8,
        ge=1,
        le=1000,
        description="Transport storage: write a whole version every N versions and, in between, only "
        "the bit-exact deltas from the version before. An engine one version behind fetches one delta; "
        "a joining one, the newest whole version and the deltas since. 1: every version whole.",
    )
    inflight: Literal["keep", "wait", "abort"] = Field(
        "keep",
        description="What a weight update does to generations in progress (engine vllm): keep pauses "
        "them between two decoding steps and continues them on the new weights (partial rollouts; each "
        "token records the version that sampled it), wait lets them finish on the old weights first, "
        "abort stops them and issues them again on the new weights.",
    )
