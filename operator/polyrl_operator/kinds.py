"""The one table of the kinds of children the operator creates for an RLJob.

Every place that needs to know about child kinds (the REST paths of the client, the kopf indexes and
watches, cleanup listings, the settings that turn kinds on or off, the order ``polyrl render``
prints them in) reads this table, so adding a kind is one row here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

KUEUE_GROUP: Final = "kueue.x-k8s.io"
KUEUE_VERSION: Final = "v1beta2"
KUEUE_API_VERSION: Final = f"{KUEUE_GROUP}/{KUEUE_VERSION}"

Gate = Literal["always", "networkPolicy", "kueue"]
"""Which operator setting turns a kind on: ``networkPolicy.enabled``, ``kueue.enabled``, or none."""


@dataclass(frozen=True)
class ChildKind:
    kind: str
    api_version: str
    plural: str
    index: str
    """The kopf index id (and the keyword argument kopf passes it under)."""
    apply_order: int
    """Creation order in a rendered job: infrastructure first, the Workload before pods."""
    gate: Gate = "always"

    @property
    def group(self) -> str:
        """The API group ("" for the core group)."""
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    def selector(self) -> tuple[str, ...]:
        """The (group, version, plural) arguments of a kopf handler decorator."""
        if self.group:
            return (self.group, self.version, self.plural)
        return (self.version, self.plural)


CHILD_KINDS: Final[tuple[ChildKind, ...]] = (
    ChildKind("ServiceAccount", "v1", "serviceaccounts", "polyrl_serviceaccounts", 0),
    ChildKind(
        "NetworkPolicy",
        "networking.k8s.io/v1",
        "networkpolicies",
        "polyrl_networkpolicies",
        1,
        "networkPolicy",
    ),
    ChildKind("ConfigMap", "v1", "configmaps", "polyrl_configmaps", 2),
    ChildKind("Secret", "v1", "secrets", "polyrl_secrets", 3),
    ChildKind("Service", "v1", "services", "polyrl_services", 4),
    ChildKind("Workload", KUEUE_API_VERSION, "workloads", "polyrl_workloads", 5, "kueue"),
    ChildKind("Pod", "v1", "pods", "polyrl_pods", 6),
)
BY_KIND: Final[dict[str, ChildKind]] = {k.kind: k for k in CHILD_KINDS}
KIND_NAMES: Final[tuple[str, ...]] = tuple(k.kind for k in CHILD_KINDS)


def child_kind(kind: str) -> ChildKind:
    """The table row of ``kind``; KeyError names the kind when it is not a child kind."""
    try:
        return BY_KIND[kind]
    except KeyError:
        raise KeyError(f"{kind!r} is not a kind of child the operator creates") from None


def enabled(gates: dict[Gate, bool]) -> tuple[ChildKind, ...]:
    """The rows whose gate is open (``always`` is always open)."""
    return tuple(k for k in CHILD_KINDS if k.gate == "always" or gates.get(k.gate, False))
