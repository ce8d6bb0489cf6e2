"""reasoning-gym datasets as prompt data: `reasoning-gym://DATASET?size=N&seed=S&PARAM=VALUE`.

reasoning-gym (the `tasks` extra) generates procedural reasoning tasks, each with its own scorer. A
URI names one of its datasets and that dataset's own config parameters; the rows are generated when
the job starts, the same for the same URI (`seed` defaults to 0, never to a random one, so a job and
its resumption see the same rows, and the data position in a checkpoint holds). Values are read as
JSON where they parse (`max_terms=3`, `allow_parentheses=false`, `operators=["+","-"]`) and as text
otherwise (`operators=+-`... is the string "+-").

Each row is the dataset's entry (`question`, `answer`, `metadata`) plus `prompt` (the question), so
the generic `PromptCompletion` workflow plays it as it is; the built-in reward `reasoning_gym`
(rewards/builtins.py) scores a completion with the dataset's own `score_answer` on that entry.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

SCHEME = "reasoning-gym://"
TASKS_EXTRA = "tasks"
DEFAULT_SEED = 0


def is_reasoning_gym(uri: str) -> bool:
    return uri.startswith(SCHEME)


@dataclass(frozen=True)
class GymSource:
    """A parsed `reasoning-gym://` URI: the dataset's name and its config parameters (size and seed
    among them)."""

    dataset: str
    params: dict[str, Any]


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse(uri: str, error: type[Exception] = ValueError) -> GymSource:
    """The dataset and parameters `uri` names (syntax only: names are checked by `rows`)."""
    parts = urlsplit(uri)
    name = parts.netloc
    if not name or parts.path not in ("", "/"):
        raise error(
            f"{uri}: expected reasoning-gym://DATASET?PARAM=VALUE&... (DATASET: a reasoning-gym name)"
        )
    params: dict[str, Any] = {}
    # `+` stays a plus (operators=["+","-"]), unlike in form encoding; %XX escapes are decoded.
    for pair in filter(None, parts.query.split("&")):
        key, eq, text = (unquote(p) for p in pair.partition("="))
        if not key or not eq:
            raise error(f"{uri}: {pair!r} is not PARAM=VALUE")
        if key in params:
            raise error(f"{uri}: parameter {key!r} is given twice")
        params[key] = _value(text)
    params.setdefault("seed", DEFAULT_SEED)
    return GymSource(name, params)


def _module(uri: str, error: type[Exception]) -> Any:
    try:
        with warnings.catch_warnings():  # some of its dependencies warn on import (SyntaxWarning)
            warnings.simplefilter("ignore")
            return importlib.import_module("reasoning_gym")
    except ImportError as e:
        raise error(
            f"{uri}: reasoning-gym data needs the reasoning-gym package: "
            f"pip install 'polyrl-runtime[{TASKS_EXTRA}]'"
        ) from e


def dataset(uri: str, error: type[Exception] = ValueError) -> Any:
    """The reasoning-gym dataset `uri` names; `error` names the URI and the dataset or parameter at
    fault (an unknown dataset with the closest names, an unknown parameter with the known ones, a
    value its config refuses)."""
    src = parse(uri, error)
    rg = _module(uri, error)
    registry: dict[str, Any] = rg.factory.DATASETS
    if src.dataset not in registry:
        close = difflib.get_close_matches(src.dataset, list(registry), n=5, cutoff=0.5)
        hint = f"the closest names: {', '.join(close)}" if close else f"{len(registry)} datasets exist"
        raise error(f"{uri}: reasoning-gym has no dataset {src.dataset!r} ({hint})")
    _, config_cls = registry[src.dataset]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    for key in src.params:
        if key not in fields:
            raise error(
                f"{uri}: parameter {key!r} is not a parameter of reasoning-gym's {src.dataset} "
                f"(its parameters: {', '.join(sorted(fields))})"
            )
    try:
        return rg.create_dataset(src.dataset, **src.params)
    except (AssertionError, ValueError, TypeError) as e:
        raise error(f"{uri}: reasoning-gym's {src.dataset} refuses these parameters: {e}") from e


def rows(uri: str, error: type[Exception] = ValueError) -> list[dict[str, Any]]:
    """Every entry of the dataset `uri` names, as prompt rows (see the module doc)."""
    ds = dataset(uri, error)
    out = [{**entry, "prompt": entry["question"]} for entry in ds]
    if not out:
        raise error(f"{uri}: the dataset has no rows (size=0?)")
    return out
