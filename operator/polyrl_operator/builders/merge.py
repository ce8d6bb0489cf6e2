"""A small strategic merge for pod template overrides (the subset of Kubernetes' rules that PodSpecs need).

Kubernetes merges lists of containers, volumes, env, volumeMounts and ports by their key (name,
mountPath, containerPort) instead of replacing them; a user override of ``containers: [{name: main,
volumeMounts: [...]}]`` must add mounts to the generated container, not replace the container.
Tolerations are appended (deduplicated) so a role's podTemplate adds to the GPU type's tolerations
rather than silently dropping them. ``null`` deletes a key, as in a merge patch.
"""

from __future__ import annotations

import copy
from typing import Any

MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "envFrom": "prefix",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "resourceClaims": "name",
}
APPEND_KEYS = frozenset({"tolerations"})


def _merge_list(key: str, base: list[Any], patch: list[Any]) -> list[Any]:
    field = MERGE_KEYS[key]
    out = [copy.deepcopy(item) for item in base]
    for item in patch:
        if not isinstance(item, dict) or field not in item:
            out.append(copy.deepcopy(item))
            continue
        for i, existing in enumerate(out):
            if isinstance(existing, dict) and existing.get(field) == item[field]:
                out[i] = strategic_merge(existing, item)
                break
        else:
            out.append(copy.deepcopy(item))
    return out


def strategic_merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A new dict: ``patch`` merged over ``base`` (neither is modified)."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        current = out.get(key)
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(current, dict):
            out[key] = strategic_merge(current, value)
        elif isinstance(value, list) and isinstance(current, list) and key in MERGE_KEYS:
            out[key] = _merge_list(key, current, value)
        elif isinstance(value, list) and isinstance(current, list) and key in APPEND_KEYS:
            out[key] = current + [copy.deepcopy(v) for v in value if v not in current]
        else:
            out[key] = copy.deepcopy(value)
    return out
