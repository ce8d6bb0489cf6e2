"""What every child manifest shares: the owner reference, labels and the content hash."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from polyrl_operator import naming
from polyrl_operator.api import API_VERSION, KIND

Manifest = dict[str, Any]


@dataclass(frozen=True)
class JobRef:
    """The identity of the RLJob that owns a child."""

    name: str
    namespace: str
    uid: str


def owner_reference(ref: JobRef) -> dict[str, Any]:
    """Controller ownerReference: kubectl and a real garbage collector see the RLJob as the owner.

    blockOwnerDeletion stays false: it would need update permission on rljobs/finalizers, and the
    operator's own finalizer does the cleanup anyway (the test control plane has no collector).
    """
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": ref.name,
        "uid": ref.uid,
        "controller": True,
        "blockOwnerDeletion": False,
    }


def metadata(
    ref: JobRef,
    name: str,
    labels: dict[str, str],
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ref.namespace,
        "labels": dict(labels),
        "ownerReferences": [owner_reference(ref)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def manifest_hash(manifest: Manifest) -> str:
    """A stable hash of a manifest's content, ignoring its own hash annotation and the drain marks
    (those are mutable state the operator patches in place, not part of what the object is)."""
    body = copy.deepcopy(manifest)
    annotations = body.get("metadata", {}).get("annotations", {})
    for key in (naming.ANNOTATION_HASH, *naming.MUTABLE_ANNOTATIONS):
        annotations.pop(key, None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def stamp_hash(manifest: Manifest) -> Manifest:
    """Write the manifest's hash into its annotations (in place) and return it."""
    digest = manifest_hash(manifest)
    manifest.setdefault("metadata", {}).setdefault("annotations", {})[naming.ANNOTATION_HASH] = digest
    return manifest
