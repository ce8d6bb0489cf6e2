"""A small strategic-merge-patch implementation for the shim's core kinds.

The CRD server rejects ``application/strategic-merge-patch+json`` for custom resources (415), but
clients treat Pods, Services, ... as built-in kinds and send exactly that: ``kubectl apply``
(client-side) and ``kubectl patch`` do by default. The shim therefore reads the object, applies the
patch here and writes the result back with a resourceVersion precondition.

Only what the Kubernetes patch format needs for the kinds the shim serves is implemented: maps
merge recursively, ``null`` deletes, lists of objects merge by their well-known merge key (the
``patchMergeKey`` tags of k8s.io/api, keyed by field name here since these kinds reuse the names
consistently), the primitive ``finalizers`` list merges as a set, every other list is replaced,
and the directives ``$patch`` (replace/delete/merge), ``$retainKeys``,
``$deleteFromPrimitiveList/<field>`` and ``$setElementOrder/<field>`` (order hint, ignored) are
honoured.
"""

from __future__ import annotations

import copy
from typing import Any

# field name -> merge key(s); the first key present in the list's items wins ("ports" is keyed by
# containerPort in containers and by port in services).
MERGE_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "ephemeralContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "volumeDevices": ("devicePath",),
    "imagePullSecrets": ("name",),
    "ownerReferences": ("uid",),
    "conditions": ("type",),
    "hostAliases": ("ip",),
    "ports": ("containerPort", "port"),
    "resourceClaims": ("name",),
    "secrets": ("name",),
    "addresses": ("type",),
}
# primitive lists with patchStrategy "merge": patched entries are added, never replaced.
MERGED_PRIMITIVE_LISTS = frozenset({"finalizers"})

_DELETE = object()  # marker: "$patch: delete" on a map


def apply_strategic_merge_patch(original: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Return ``original`` patched with ``patch`` (neither argument is modified)."""
    result = _merge_map(original, patch)
    if result is _DELETE or not isinstance(result, dict):
        raise ValueError("a strategic merge patch cannot delete the whole object")
    return result


def _merge_map(original: dict[str, Any] | None, patch: dict[str, Any]) -> Any:
    directive = patch.get("$patch")
    if directive == "delete":
        return _DELETE
    if directive == "replace":
        return _merge_map(None, {k: v for k, v in patch.items() if k != "$patch"})
    result: dict[str, Any] = copy.deepcopy(original) if original else {}
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if isinstance(result.get(field), list):
                result[field] = [item for item in result[field] if item not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            current = result.get(key)
            merged = _merge_map(current if isinstance(current, dict) else None, value)
            if merged is _DELETE:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list):
            current = result.get(key)
            result[key] = _merge_list(key, current if isinstance(current, list) else [], value)
        else:
            result[key] = value
    if isinstance(retain, list):
        for key in list(result):
            if key not in retain:
                del result[key]
    return result


def _merge_list(field: str, original: list[Any], patch: list[Any]) -> list[Any]:
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [_clean(item) for item in patch if not (isinstance(item, dict) and "$patch" in item)]
    if field in MERGED_PRIMITIVE_LISTS and not any(isinstance(item, dict) for item in patch):
        return copy.deepcopy(original) + [item for item in patch if item not in original]
    key = next(
        (k for k in MERGE_KEYS.get(field, ()) if any(isinstance(i, dict) and k in i for i in patch)),
        None,
    )
    if key is None or not all(isinstance(item, dict) for item in patch):
        return [_clean(item) for item in patch]
    result = copy.deepcopy(original)
    for item in patch:
        position = next(
            (i for i, cur in enumerate(result) if isinstance(cur, dict) and cur.get(key) == item.get(key)),
            None,
        )
        if item.get("$patch") == "delete":
            if position is not None:
                del result[position]
            continue
        if position is None:
            result.append(_clean(item))
        else:
            result[position] = _merge_map(result[position], item)
    return result


def _clean(value: Any) -> Any:
    """A new value from the patch, with any directives inside it applied (against nothing)."""
    if isinstance(value, dict):
        merged = _merge_map(None, value)
        return {} if merged is _DELETE else merged
    if isinstance(value, list):
        return [_clean(item) for item in value]
    return value
