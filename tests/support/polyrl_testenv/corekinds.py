"""The core (``v1``) kinds the shim serves, the schemaless CRDs that store them, and the mapping
between their public (``/api/v1``, ``apiVersion: v1``) and internal form.

Each kind becomes a CRD of the hidden group ``core.shim.polyrl.dev`` whose schema accepts any
content (``x-kubernetes-preserve-unknown-fields``), so objects round-trip unchanged. The few fields
declared explicitly are the ones field selectors need (CRDs can only select on declared scalar
fields, via ``selectableFields``), e.g. ``spec.nodeName`` for a kubelet's pod watch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

INTERNAL_GROUP = "core.shim.polyrl.dev"
INTERNAL_GV = f"{INTERNAL_GROUP}/v1"


@dataclass(frozen=True)
class CoreKind:
    kind: str
    plural: str
    short_names: tuple[str, ...] = ()
    namespaced: bool = True
    status: bool = False  # a status subresource, as the real kind has
    categories: tuple[str, ...] = ()
    selectable: tuple[str, ...] = ()  # field selectors beyond metadata.name/namespace
    columns: tuple[tuple[str, str], ...] = ()  # (kubectl get column, JSON path)

    @property
    def internal_plural(self) -> str:
        # A cluster-scoped CRD cannot be called "namespaces": the server parses
        # /apis/<g>/<v>/namespaces/<name> as the namespace <name>, not as that object.
        return "shimnamespaces" if self.plural == "namespaces" else self.plural


CORE_KINDS: tuple[CoreKind, ...] = (
    CoreKind(
        "Pod", "pods", ("po",), status=True, categories=("all",),
        selectable=("spec.nodeName", "status.phase"),
        columns=(("Status", ".status.phase"), ("Node", ".spec.nodeName"), ("IP", ".status.podIP")),
    ),
    CoreKind(
        "Service", "services", ("svc",), status=True, categories=("all",),
        columns=(("Type", ".spec.type"), ("Cluster-IP", ".spec.clusterIP")),
    ),
    CoreKind("ConfigMap", "configmaps", ("cm",)),
    CoreKind("Secret", "secrets", selectable=("type",), columns=(("Type", ".type"),)),
    CoreKind(
        "Event", "events", ("ev",),
        selectable=(
            "involvedObject.kind", "involvedObject.name", "involvedObject.namespace",
            "involvedObject.uid", "reason", "type",
        ),
        columns=(("Type", ".type"), ("Reason", ".reason"), ("Message", ".message")),
    ),
    # No status subresource: the shim sets status.phase=Active on create, which must persist.
    CoreKind("Namespace", "namespaces", ("ns",), namespaced=False, columns=(("Status", ".status.phase"),)),
    CoreKind("ServiceAccount", "serviceaccounts", ("sa",)),
    CoreKind(
        "PersistentVolumeClaim", "persistentvolumeclaims", ("pvc",), status=True,
        columns=(("Status", ".status.phase"),),
    ),
    CoreKind("Node", "nodes", ("no",), namespaced=False, status=True),
)  # fmt: skip


def _schema(selectable: tuple[str, ...]) -> dict[str, Any]:
    """Anything goes, plus string properties for the selectable fields (nested as needed)."""
    root: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    for path in selectable:
        node = root
        *parents, leaf = path.split(".")
        for name in parents:
            properties = node.setdefault("properties", {})
            node = properties.setdefault(
                name, {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
            )
        node.setdefault("properties", {})[leaf] = {"type": "string"}
    return root


def crd_manifest(kind: CoreKind) -> dict[str, Any]:
    version: dict[str, Any] = {
        "name": "v1",
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": _schema(kind.selectable)},
    }
    if kind.status:
        version["subresources"] = {"status": {}}
    if kind.selectable:
        version["selectableFields"] = [{"jsonPath": f".{path}"} for path in kind.selectable]
    if kind.columns:
        columns = [{"name": n, "type": "string", "jsonPath": p} for n, p in kind.columns]
        columns.append({"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"})
        version["additionalPrinterColumns"] = columns
    names: dict[str, Any] = {
        "plural": kind.internal_plural,
        "singular": kind.kind.lower(),
        "kind": kind.kind,
        "listKind": f"{kind.kind}List",
    }
    if kind.short_names:
        names["shortNames"] = list(kind.short_names)
    if kind.categories:
        names["categories"] = list(kind.categories)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{kind.internal_plural}.{INTERNAL_GROUP}"},
        "spec": {
            "group": INTERNAL_GROUP,
            "scope": "Namespaced" if kind.namespaced else "Cluster",
            "names": names,
            "versions": [version],
        },
    }


# ---- public <-> internal ---------------------------------------------------------------------

INTERNAL_PREFIX = f"/apis/{INTERNAL_GV}"
PUBLIC_PLURAL = {kind.internal_plural: kind.plural for kind in CORE_KINDS}
CORE_KIND_NAMES = frozenset(kind.kind for kind in CORE_KINDS)
STATUS_MESSAGE_FIXES = (
    (f"shimnamespaces.{INTERNAL_GROUP}", "namespaces"),
    (INTERNAL_GV, "v1"),
    (f".{INTERNAL_GROUP}", ""),
)
KIND_OF = {kind.plural: kind.kind for kind in CORE_KINDS}


def version_priority(version: str) -> tuple[int, int, int, str]:
    """Sort key of Kubernetes version priority: v2 > v1 > v1beta2 > v1beta1 > v1alpha1 > other."""
    match = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not match:
        return (3, 0, 0, version)
    stage = {None: 0, "beta": 1, "alpha": 2}[match[2]]
    return (stage, -int(match[1]), -int(match[3] or 0), "")


def to_public(obj: Any) -> Any:
    """Rewrite an object (or list, table, watch event, Status) from the internal group to core v1."""
    if not isinstance(obj, dict):
        return obj
    if obj.get("apiVersion") == INTERNAL_GV:
        obj["apiVersion"] = "v1"
    kind = obj.get("kind")
    if kind == "Status":  # only cosmetic: name the resource as clients know it
        message = obj.get("message")
        if isinstance(message, str):
            for old, new in STATUS_MESSAGE_FIXES:
                message = message.replace(old, new)
            obj["message"] = message
        details = obj.get("details")
        if isinstance(details, dict):
            if details.get("group") == INTERNAL_GROUP:
                details["group"] = ""
            if details.get("kind") in PUBLIC_PLURAL:
                details["kind"] = PUBLIC_PLURAL[details["kind"]]
    items = obj.get("items")
    if isinstance(items, list):
        for item in items:
            to_public(item)
    if kind == "Table":
        for row in obj.get("rows") or ():
            to_public(row.get("object"))
    if "type" in obj and isinstance(obj.get("object"), dict) and len(obj) == 2:  # a watch event
        to_public(obj["object"])
    return obj


def publish_gvk(node: Any) -> None:
    """In an OpenAPI document, turn x-kubernetes-group-version-kind of the internal group into core."""
    if isinstance(node, list):
        for item in node:
            publish_gvk(item)
    elif isinstance(node, dict):
        if node.get("group") == INTERNAL_GROUP and "kind" in node and "version" in node:
            node["group"] = ""
        for value in node.values():
            publish_gvk(value)


def to_internal(obj: Any) -> Any:
    """Rewrite a request body for a core kind from ``v1`` to the internal group (Status untouched)."""
    if isinstance(obj, dict) and obj.get("apiVersion") == "v1" and obj.get("kind") in CORE_KIND_NAMES:
        obj["apiVersion"] = INTERNAL_GV
    return obj


@dataclass(frozen=True)
class CorePath:
    """A parsed ``/api/v1/...`` request path."""

    internal: str  # the same request in the internal group
    resource: str  # public plural ("pods"), "" for /api/v1 itself
    name: str  # object name, "" for collections
    subresource: str  # "status", ...
    legacy_watch: bool  # /api/v1/watch/...: the deprecated spelling of ?watch=true


def map_core_path(rest: str) -> CorePath:
    """Map ``/api/v1/<rest>`` into the internal group."""
    parts = [p for p in rest.split("/") if p]
    watch = bool(parts) and parts[0] == "watch"
    if watch:
        parts = parts[1:]
    if parts and parts[0] == "namespaces" and (len(parts) <= 2 or parts[2] in ("status", "finalize")):
        parts[0] = "shimnamespaces"  # the Namespace objects themselves (see corekinds)
        tail = ["namespaces", *parts[1:]]
    elif parts and parts[0] == "namespaces":
        tail = parts[2:]
    else:
        tail = parts
    tail += ["", "", ""]
    return CorePath("/".join([INTERNAL_PREFIX, *parts]), tail[0], tail[1], tail[2], watch)
