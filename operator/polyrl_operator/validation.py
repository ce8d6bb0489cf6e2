"""Validate RLJob manifests with the same models that generate the CRD, naming file, line and field.

Used by ``polyrl validate`` and, through ``load_rljobs``, by ``polyrl run`` and the runtime's pods, so
every command reports a bad job file in the same words. Each problem says where it is (file, the line
of the offending field in the YAML, field path like ``spec.policies[1].rollout.replicas.min``) and what
is wrong in the user's terms. A missing field is reported at the line of the mapping that lacks it.
"""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from polyrl_operator.api import API_VERSION, GROUP, KIND, RLJob, RuleViolation
from polyrl_operator.api.common import DNS_LABEL_PATTERN, ENV_NAME_PATTERN, QUANTITY_PATTERN
from polyrl_operator.api.data import DATA_URI_PATTERN
from polyrl_operator.api.patterns import (
    CHECKPOINT_URI_PATTERN,
    ENTRYPOINT_PATTERN,
    GPU_TYPE_PATTERN,
    MODEL_URI_PATTERN,
    SECRET_NAME_PATTERN,
)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one document."""

    file: str
    line: int | None
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


@dataclass(frozen=True)
class Document:
    """One YAML document of a manifest file, with the line it starts on (1-based)."""

    file: str
    line: int
    body: Any
    index: int = 1
    """Position of the document in its file (1-based)."""
    node: yaml.Node | None = None
    """The composed YAML node the body was built from (its marks give each field's line); None for
    JSON, where every problem is reported at the document's line."""

    def line_of(self, loc: tuple[int | str, ...]) -> int:
        """The line of the field at ``loc`` (a pydantic error location: aliases and list indices),
        else of its deepest ancestor present in the document (a missing field: its parent)."""
        return field_line(self.node, loc) if self.node is not None else self.line


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as ``1e-6`` (YAML 1.1 demands a dot and would
    hand the API a string), matching how kubectl parses manifests."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def field_line(node: yaml.Node, loc: tuple[int | str, ...]) -> int:
    """The 1-based line of the node at ``loc`` below ``node``, else of its deepest ancestor there.

    A part that names no key of the current mapping is passed over: pydantic puts markers in
    locations (a union's branch, a tagged union's tag) that are not keys of the document."""
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if not 0 <= part < len(node.value):
                break
            node = node.value[part]
            line = node.start_mark.line + 1
        elif isinstance(node, yaml.MappingNode) and isinstance(part, str):
            found = next((kv for kv in reversed(node.value) if kv[0].value == part), None)
            if found is not None:
                line = found[0].start_mark.line + 1
                node = found[1]
        else:
            break
    return line


def load_documents(path: Path) -> Iterator[Document]:
    """Yield each document of a YAML (or, ending in .json, JSON) file; raises yaml.YAMLError or
    json.JSONDecodeError, with a line, on a syntax error."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        yield Document(str(path), 1, json.loads(text))
        return
    loader = _Loader(text)
    index = 0
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:  # pragma: no cover - check_node said there is one
                break
            index += 1
            body = loader.construct_document(node)
            yield Document(str(path), node.start_mark.line + 1, body, index, node)
    finally:
        loader.dispose()


_PATTERN_HINTS = {
    DNS_LABEL_PATTERN: "must be a DNS label: lower-case letters, digits and '-', starting with a letter",
    ENTRYPOINT_PATTERN: "must be an import path of the form 'package.module:Attribute'",
    MODEL_URI_PATTERN: "must be pvc://CLAIM/PATH, file:///PATH, s3://BUCKET/PREFIX or builtin://NAME "
    "(gs:// is not supported)",
    CHECKPOINT_URI_PATTERN: "must be pvc://CLAIM/PATH, file:///PATH or s3://BUCKET/PREFIX (gs:// is not supported)",
    DATA_URI_PATTERN: "must be a .jsonl, .json or .parquet file at pvc://CLAIM/PATH, file:///PATH or "
    "s3://BUCKET/KEY, or reasoning-gym://DATASET?PARAM=VALUE&...",
    SECRET_NAME_PATTERN: "must be a Secret name: lower-case letters, digits, '-' and '.'",
    GPU_TYPE_PATTERN: "must be a GPU type name (letters, digits, '-', '_', '.')",
    ENV_NAME_PATTERN: "must be a valid environment variable name",
    QUANTITY_PATTERN: "must be a Kubernetes quantity such as 500m, 4, 16Gi",
}


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in {"int", "str"} or part.startswith(("function-", "constrained-str")):
            continue  # pydantic's union-branch markers, meaningless to a user
        else:
            out += f".{part}" if out else part
    return out


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The API model class found at ``loc`` (to suggest field names for typos)."""
    current: Any = RLJob
    for part in loc:
        current = _unwrap(current)
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = next((f for name, f in current.model_fields.items() if part in (f.alias or name, name)), None)
        if field is None:
            return None
        current = field.annotation
    current = _unwrap(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(tp: Any) -> Any:
    """Strip Optional/list wrappers down to the model type inside."""
    while True:
        origin = typing.get_origin(tp)
        if origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        elif origin is list:
            tp = typing.get_args(tp)[0]
        else:
            return tp


def _explain(err: Any) -> tuple[tuple[int | str, ...], str]:
    loc: tuple[int | str, ...] = tuple(err["loc"])
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind == "value_error" and isinstance(ctx.get("error"), RuleViolation):
        violation: RuleViolation = ctx["error"]
        extra = tuple(p for p in (violation.field or "").split(".") if p)
        return loc + extra, violation.message
    if kind == "extra_forbidden":
        name = str(loc[-1])
        model = _model_at(loc[:-1])
        known = [f.alias or n for n, f in model.model_fields.items()] if model else []
        close = difflib.get_close_matches(name, known, n=1)
        hint = (
            f"; did you mean {close[0]!r}?"
            if close
            else (f"; known fields: {', '.join(known)}" if known else "")
        )
        return loc, f"unknown field {name!r}{hint}"
    if kind == "string_pattern_mismatch" and ctx.get("pattern") in _PATTERN_HINTS:
        return loc, f"{_PATTERN_HINTS[ctx['pattern']]} (got {err['input']!r})"
    if kind == "missing":
        return loc, "required field is missing"
    message = str(err["msg"])
    if kind == "value_error" and message.startswith("Value error, "):
        message = message.removeprefix("Value error, ")
    if "input" in err and kind not in {"missing"} and not isinstance(err["input"], dict | list):
        message += f" (got {err['input']!r})"
    return loc, message


def document_problems(doc: Document, exc: ValidationError) -> list[Problem]:
    """Each error of validating ``doc`` as one problem, at the line of the field it names."""
    problems = []
    for err in exc.errors():
        loc, message = _explain(err)
        problems.append(Problem(doc.file, doc.line_of(loc), _format_loc(loc), message))
    return problems


def check_document(doc: Document) -> tuple[RLJob | None, list[Problem]]:
    """The RLJob of one document and its problems: (job, []) when it is a valid RLJob, (None, [])
    when it is not an RLJob at all, (None, problems) otherwise."""
    body = doc.body
    if not isinstance(body, dict):
        problem = Problem(doc.file, doc.line, "", "document is not a mapping (expected a Kubernetes object)")
        return None, [problem]
    if body.get("kind") != KIND:
        return None, _misspelled_kind(doc)
    if body.get("apiVersion") != API_VERSION:
        message = f"must be {API_VERSION} for kind {KIND} (got {body.get('apiVersion')!r})"
        return None, [Problem(doc.file, doc.line_of(("apiVersion",)), "apiVersion", message)]
    try:
        return RLJob.model_validate(body), []
    except ValidationError as exc:
        return None, document_problems(doc, exc)


def validate_document(doc: Document) -> list[Problem]:
    """Problems with one document, or [] when it is a valid RLJob (or not an RLJob at all)."""
    return check_document(doc)[1]


def _misspelled_kind(doc: Document) -> list[Problem]:
    """A document of the polyrl.dev group (or one whose kind is RLJob in another spelling) that is not
    an RLJob: a typo that would otherwise pass as "not ours" (the API server would refuse it)."""
    kind = doc.body.get("kind")
    api_version = str(doc.body.get("apiVersion") or "")
    ours = api_version.split("/", 1)[0] == GROUP
    looks_like = isinstance(kind, str) and kind.lower().rstrip("s") in {"rljob", "rlj"}
    if not ours and not looks_like:
        return []
    hint = f"; did you mean {KIND!r}?" if isinstance(kind, str) and kind else ""
    message = f"unknown kind {kind!r} for apiVersion {api_version!r} in document {doc.index}: polyrl.dev serves only kind {KIND!r}{hint}"
    return [Problem(doc.file, doc.line_of(("kind",)), "kind", message)]


@dataclass
class FileReport:
    """What validating one file found."""

    file: str
    rljobs: int
    problems: list[Problem]


def load_rljobs(path: Path) -> tuple[list[RLJob], int, list[Problem]]:
    """The valid RLJobs of a (multi-document) YAML or JSON file, how many RLJob documents it has,
    and every problem found (unreadable file, syntax error, invalid RLJob, misspelled kind)."""
    jobs: list[RLJob] = []
    problems: list[Problem] = []
    count = 0
    try:
        for doc in load_documents(path):
            if doc.body is None:
                continue
            if isinstance(doc.body, dict) and doc.body.get("kind") == KIND:
                count += 1
            job, found = check_document(doc)
            problems.extend(found)
            if job is not None:
                jobs.append(job)
    except OSError as exc:
        problems.append(Problem(str(path), None, "", f"cannot read: {exc.strerror or exc}"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problems.append(Problem(str(path), line, "", f"not valid YAML: {getattr(exc, 'problem', exc)}"))
    except json.JSONDecodeError as exc:
        problems.append(Problem(str(path), exc.lineno, "", f"not valid JSON: {exc.msg}"))
    except UnicodeDecodeError as exc:
        problems.append(Problem(str(path), None, "", f"not UTF-8 text: {exc.reason}"))
    return jobs, count, problems


def validate_file(path: Path) -> FileReport:
    """Validate every RLJob in a (multi-document) YAML file."""
    _, count, problems = load_rljobs(path)
    return FileReport(str(path), count, problems)


def explain(exc: ValidationError) -> list[tuple[str, str]]:
    """(field path, message) for each error, in the same words ``polyrl validate`` prints."""
    out = []
    for err in exc.errors():
        loc, message = _explain(err)
        out.append((_format_loc(loc), message))
    return out
