"""Views of built manifests for the builders' table tests.

Each row of a table names the parts of a manifest it is about by a path into a view
(``("env", "POLYRL_JOB")``, ``("spec", "nodeSelector")``, ``("claims", "ckpt")``) and the value it
expects there; the test compares exactly those parts, so a row says what it checks and nothing else,
and a failure shows every differing part at once. ``MISSING`` stands for a part that is absent.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from polyrl_operator.api import RLJob
from polyrl_operator.pod_contract import ENV_PVC_MOUNTS

ViewPath = tuple[str | int, ...]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Final = _Missing()
"""The value of a part the manifest does not have."""


def pod_view(pod: Mapping[str, Any]) -> dict[str, Any]:
    """A pod manifest with its one container's parts keyed by name: ``env`` (name -> value, or the
    ``valueFrom`` of a reference), ``env_entries`` (name -> every entry of that name), ``ports``
    (name -> containerPort), ``volumes`` (name -> volume), ``volume_names`` and ``mount_names`` (in
    order), ``claims`` (claim -> its mount's path and readOnly) and ``pvc_mounts`` (the parsed
    ``POLYRL_PVC_MOUNTS``, {} when absent)."""
    spec = pod["spec"]
    [container] = spec["containers"]
    entries = container.get("env") or []
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    mounts = container.get("volumeMounts") or []
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in entries}
    claims = {
        volumes[m["name"]]["persistentVolumeClaim"]["claimName"]: {
            "path": m["mountPath"],
            "readOnly": m.get("readOnly", False),
        }
        for m in mounts
        if "persistentVolumeClaim" in volumes.get(m["name"], {})
    }
    return {
        "metadata": pod["metadata"],
        "name": pod["metadata"]["name"],
        "labels": pod["metadata"].get("labels") or {},
        "spec": spec,
        "container": container,
        "env": env,
        "env_entries": {name: [e for e in entries if e["name"] == name] for name in env},
        "envFrom": container.get("envFrom", MISSING),
        "ports": {p["name"]: p["containerPort"] for p in container.get("ports") or []},
        "volumes": volumes,
        "volume_names": list(volumes),
        "mount_names": [m["name"] for m in mounts],
        "claims": claims,
        "pvc_mounts": json.loads(env.get(ENV_PVC_MOUNTS) or "{}"),
    }


def at(view: Any, path: ViewPath) -> Any:
    """The part of ``view`` at ``path`` (keys of mappings, indexes of lists), or ``MISSING``."""
    node = view
    for key in path:
        in_mapping = isinstance(node, Mapping) and key in node
        in_list = isinstance(node, list) and isinstance(key, int) and -len(node) <= key < len(node)
        if not (in_mapping or in_list):
            return MISSING
        node = node[key]
    return node


def parts(view: Any, expected: Mapping[ViewPath, Any]) -> dict[ViewPath, Any]:
    """The parts of ``view`` that ``expected`` names, to compare with ``dict(expected)``."""
    return {path: at(view, path) for path in expected}


def with_set(doc: Mapping[str, Any], changes: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """A deep copy of ``doc`` with each dotted path (list indexes as numbers) set to its value;
    mappings on the way are created when missing."""
    out: dict[str, Any] = copy.deepcopy(dict(doc))
    for dotted, value in changes:
        *parents, last = dotted.split(".")
        node: Any = out
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        if isinstance(node, list):
            node[int(last)] = copy.deepcopy(value)
        else:
            node[last] = copy.deepcopy(value)
    return out


def renamed_job(
    body: Mapping[str, Any], name: str, namespace: str, changes: Sequence[tuple[str, Any]] = ()
) -> RLJob:
    """``body`` as the job ``namespace/name``, each dotted path of its spec set (``with_set``)."""
    return RLJob.model_validate(
        {
            "apiVersion": body["apiVersion"],
            "kind": body["kind"],
            "metadata": {"name": name, "namespace": namespace},
            "spec": with_set(body["spec"], changes),
        }
    )
