"""The job's ConfigMap (the runtime's configuration) and Secret (the Ray auth token)."""

from __future__ import annotations

import json
from typing import Any

from polyrl_operator import naming
from polyrl_operator.api import RLJob
from polyrl_operator.builders.common import JobRef, Manifest, metadata, stamp_hash
from polyrl_operator.pod_contract import CONFIG_FILE


def runtime_config(job: RLJob, ref: JobRef) -> dict[str, Any]:
    """The RLJob as the runtime parses it (``RLJob.model_validate_json``): the same models, the
    wire form with the server's defaults filled in, and no status (status is the operator's)."""
    return {
        "apiVersion": job.api_version,
        "kind": job.kind,
        "metadata": {"name": ref.name, "namespace": ref.namespace},
        "spec": job.spec.to_k8s(),
    }


def build_config_map(job: RLJob, ref: JobRef) -> Manifest:
    body = json.dumps(runtime_config(job, ref), sort_keys=True, indent=1)
    manifest: Manifest = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(ref, naming.config_map(ref.name), naming.labels(ref.name)),
        "data": {CONFIG_FILE: body},
    }
    return stamp_hash(manifest)


def build_secret(ref: JobRef, token: str | None) -> Manifest:
    """The Ray auth token Secret. ``token`` is None in plans and renders: the token is drawn at
    creation (apply) and never rewritten, so it stays stable across reconciles and restarts."""
    manifest: Manifest = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata(ref, naming.secret(ref.name), naming.labels(ref.name)),
    }
    stamp_hash(manifest)
    if token is not None:
        manifest["stringData"] = {naming.TOKEN_KEY: token}
    return manifest
