"""The built-in kinds the shim serves, the schemaless CRDs that store them, and the mapping
between their public and internal form.

Core (``v1``) kinds become CRDs of the hidden group ``core.shim.polyrl.dev`` (public form:
``/api/v1``, ``apiVersion: v1``). The few built-in kinds of other groups that installs use
(``apps`` Deployments, ``rbac.authorization.k8s.io`` Roles and bindings, ``networking.k8s.io``
NetworkPolicies) become CRDs of ``<group>.shim.polyrl.dev`` (public form: ``/apis/<group>/v1``,
``apiVersion: <group>/v1``): a CRD cannot live in ``apps`` (no dot) and the ``*.k8s.io`` groups
are reserved, so they are mapped exactly like core kinds. Each schema accepts any content
(``x-kubernetes-preserve-unknown-fields``), so objects round-trip unchanged. The few fields declared
explicitly are the ones field selectors need (CRDs can only select on declared scalar fields, via
``selectableFields``), e.g. ``spec.nodeName`` for a kubelet's pod watch.

These kinds are *stored and served*, not *acted on*: no controller runs Deployments, and no
authorizer enforces Roles (the shim is unauthenticated, the CRD server sees one admin). Tests that
check RBAC compare what a client sent against the rules instead (see ``request_log``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SHIM_SUFFIX = ".shim.polyrl.dev"
INTERNAL_GROUP = f"core{SHIM_SUFFIX}"
INTERNAL_GV = f"{INTERNAL_GROUP}/v1"


def internal_group(group: str) -> str:
    """The hidden CRD group that stores a built-in group ("" is core)."""
    return f"{group or 'core'}{SHIM_SUFFIX}"


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
    group: str = ""  # public API group; "" is core (/api/v1)

    @property
    def internal_group(self) -> str:
        return internal_group(self.group)

    @property
    def public_api_version(self) -> str:
        return f"{self.group}/v1" if self.group else "v1"

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

GROUP_KINDS: tuple[CoreKind, ...] = (
    CoreKind(
        "Deployment", "deployments", ("deploy",), status=True, categories=("all",), group="apps",
        columns=(("Replicas", ".spec.replicas"),),
    ),
    CoreKind("Role", "roles", group="rbac.authorization.k8s.io"),
    CoreKind("RoleBinding", "rolebindings", group="rbac.authorization.k8s.io"),
    CoreKind("ClusterRole", "clusterroles", namespaced=False, group="rbac.authorization.k8s.io"),
    CoreKind("ClusterRoleBinding", "clusterrolebindings", namespaced=False, group="rbac.authorization.k8s.io"),
    CoreKind("NetworkPolicy", "networkpolicies", ("netpol",), group="networking.k8s.io"),
    CoreKind("Lease", "leases", group="coordination.k8s.io"),  # the operator's leader election
    CoreKind("PriorityClass", "priorityclasses", ("pc",), namespaced=False, group="scheduling.k8s.io"),
)  # fmt: skip
"""Built-in kinds of named groups (served at /apis/<group>/v1)."""
BUILTIN_KINDS = CORE_KINDS + GROUP_KINDS
GROUPS: dict[str, tuple[CoreKind, ...]] = {}
for _kind in GROUP_KINDS:
    GROUPS[_kind.group] = (*GROUPS.get(_kind.group, ()), _kind)


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
        "metadata": {"name": f"{kind.internal_plural}.{kind.internal_group}"},
        "spec": {
            "group": kind.internal_group,
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
    (SHIM_SUFFIX, ""),  # deployments.apps.shim.polyrl.dev -> deployments.apps
)
KIND_OF = {kind.plural: kind.kind for kind in CORE_KINDS}
BUILTIN_OF_PLURAL = {kind.plural: kind for kind in BUILTIN_KINDS}
PUBLIC_GV = {f"{internal_group(g)}/v1": f"{g}/v1" for g in GROUPS}
"""Internal apiVersion -> public apiVersion, for the named groups."""
INTERNAL_GV_OF = {(kind.public_api_version, kind.kind): f"{kind.internal_group}/v1" for kind in GROUP_KINDS}


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
    elif obj.get("apiVersion") in PUBLIC_GV:
        obj["apiVersion"] = PUBLIC_GV[obj["apiVersion"]]
    if obj.get("kind") in ("APIResourceList", "APIGroup"):
        _public_discovery(obj)
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
            elif isinstance(details.get("group"), str) and details["group"].endswith(SHIM_SUFFIX):
                details["group"] = details["group"].removesuffix(SHIM_SUFFIX)
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


def _public_discovery(doc: dict[str, Any]) -> None:
    """An internal group's APIGroup or APIResourceList document, as its public group's."""
    gv = doc.get("groupVersion")
    if isinstance(gv, str) and gv in PUBLIC_GV:
        doc["groupVersion"] = PUBLIC_GV[gv]
    name = doc.get("name")
    if isinstance(name, str) and name.endswith(SHIM_SUFFIX) and name != INTERNAL_GROUP:
        doc["name"] = name.removesuffix(SHIM_SUFFIX)
    for entry in [*(doc.get("versions") or []), doc.get("preferredVersion") or {}]:
        if isinstance(entry, dict) and entry.get("groupVersion") in PUBLIC_GV:
            entry["groupVersion"] = PUBLIC_GV[entry["groupVersion"]]


def publish_gvk(node: Any) -> None:
    """In an OpenAPI document, turn x-kubernetes-group-version-kind of an internal group into the
    public one (core: "")."""
    if isinstance(node, list):
        for item in node:
            publish_gvk(item)
    elif isinstance(node, dict):
        group = node.get("group")
        if isinstance(group, str) and group.endswith(SHIM_SUFFIX) and "kind" in node and "version" in node:
            node["group"] = "" if group == INTERNAL_GROUP else group.removesuffix(SHIM_SUFFIX)
        for value in node.values():
            publish_gvk(value)


def to_internal(obj: Any) -> Any:
    """Rewrite a request body for a built-in kind from its public apiVersion to the internal group
    (Status untouched)."""
    if not isinstance(obj, dict):
        return obj
    if obj.get("apiVersion") == "v1" and obj.get("kind") in CORE_KIND_NAMES:
        obj["apiVersion"] = INTERNAL_GV
    elif (obj.get("apiVersion"), obj.get("kind")) in INTERNAL_GV_OF:
        obj["apiVersion"] = INTERNAL_GV_OF[(obj["apiVersion"], obj["kind"])]
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


def map_group_path(raw_path: str) -> CorePath | None:
    """Map ``/apis/<group>/v1/...`` of a built-in named group into its internal group (None for
    any other path). ``/apis/<group>`` and ``/apis/<group>/v1`` (discovery) map too."""
    parts = [p for p in raw_path.split("/") if p]
    if len(parts) < 2 or parts[0] != "apis" or parts[1] not in GROUPS:
        return None
    group, rest = parts[1], parts[2:]
    version = rest[:1]
    rest = rest[1:]
    watch = bool(rest) and rest[0] == "watch"
    if watch:
        rest = rest[1:]
    tail = rest[2:] if rest and rest[0] == "namespaces" and len(rest) > 2 else rest
    tail = [*tail, "", "", ""]
    internal = "/".join(["", "apis", internal_group(group), *version, *rest])
    return CorePath(internal, tail[0], tail[1], tail[2], watch)
