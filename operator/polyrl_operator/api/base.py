"""Base class and cross-field rules shared by every RLJob API model.

A cross-field rule is written once, next to the model it constrains, in two forms that must agree:
a CEL expression that the Kubernetes API server evaluates (it lands in the generated CRD as
``x-kubernetes-validations``) and a Python predicate that ``polyrl validate`` and the runtime evaluate.
Tests apply every bad example to the Kubernetes CRD server (the genuine ``apiextensions-apiserver``,
which evaluates the CEL rules) and to ``polyrl validate`` and check both reject it, so the two forms cannot drift apart unnoticed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel


@dataclass(frozen=True)
class Rule:
    """A cross-field rule on one model, enforced by the API server (CEL) and by pydantic (check)."""

    cel: str
    """CEL expression; ``self`` is the object at this schema node."""
    message: str
    """What is wrong, phrased for a user; identical on both sides."""
    check: Callable[[Any], bool]
    """Python twin of ``cel``: returns True when the model instance is valid."""
    field: str | None = None
    """Sub-field the message is about, in CEL ``fieldPath`` form (``.min``), or None for the node."""

    def to_crd(self) -> dict[str, str]:
        out = {"rule": self.cel, "message": self.message}
        if self.field and self.field.startswith(".metadata"):
            # The API server only accepts fieldPaths into the schema, and metadata has none: name the
            # field in the message instead.
            out["message"] = f"{self.field.lstrip('.')}: {self.message}"
        elif self.field:
            out["fieldPath"] = self.field
        return out


class RuleViolation(ValueError):
    """A broken cross-field rule; carries the sub-field so error reports can name the full path."""

    def __init__(self, field: str | None, message: str) -> None:
        self.field = field.lstrip(".") if field else None
        self.message = message
        super().__init__(f"{self.field}: {message}" if self.field else message)


def _add_k8s_rules(schema: dict[str, Any], cls: type) -> None:
    rules: tuple[Rule, ...] = getattr(cls, "__rules__", ())
    if rules:
        schema["x-kubernetes-validations"] = [r.to_crd() for r in rules]


class ApiModel(BaseModel):
    """Base for every API model: camelCase on the wire, unknown fields rejected, no type coercion.

    ``strict`` matches the API server's behaviour: ``gpus: "1"`` or ``gpus: 1.5`` is an error, not
    silently converted.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        strict=True,
        validate_default=False,
        use_attribute_docstrings=True,
        json_schema_extra=_add_k8s_rules,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> ApiModel:
        for rule in self.__rules__:
            if not rule.check(self):
                raise RuleViolation(rule.field, rule.message)
        return self

    def to_k8s(self) -> dict[str, Any]:
        """The wire form: camelCase keys, unset optional fields omitted."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
