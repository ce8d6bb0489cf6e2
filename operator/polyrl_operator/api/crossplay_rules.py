"""The rules of `spec.evaluation.crossPlay` against the job's policies (attached to `RLJobSpec` with
the other cross-part rules, spec_rules.py): each a CEL rule the API server enforces and the same
check in Python."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polyrl_operator.api.base import Rule
from polyrl_operator.api.crossplay import CrossPlay, CrossPlayPair
from polyrl_operator.api.policy import Policy

RLJobSpec = Any  # the spec imports these rules: its type is read, never imported, here

_HAS = "!has(self.evaluation) || !has(self.evaluation.crossPlay) || "
_PAIRS = "self.evaluation.crossPlay.pairs"
_FROZEN = "(has(p.frozen) && p.frozen)"
_MEMBER = "(p.name == x.row || p.name == x.column)"


def _cross_play(s: RLJobSpec) -> CrossPlay | None:
    return s.evaluation.cross_play if s.evaluation is not None else None


def _every_pair(check: Callable[[RLJobSpec, CrossPlayPair], bool]) -> Callable[[RLJobSpec], bool]:
    def rule(s: RLJobSpec) -> bool:
        cp = _cross_play(s)
        return cp is None or all(check(s, x) for x in cp.pairs)

    return rule


def _members(s: RLJobSpec, x: CrossPlayPair) -> list[Policy]:
    return [p for p in s.policies if p.name in (x.row, x.column)]


def _known(s: RLJobSpec, x: CrossPlayPair) -> bool:
    names = {p.name for p in s.policies}
    return x.row in names and x.column in names


def _anchor_ok(s: RLJobSpec) -> bool:
    cp = _cross_play(s)
    if cp is None or cp.anchor is None:
        return True
    frozen = any(p.name == cp.anchor and p.frozen for p in s.policies)
    return frozen and any(cp.anchor in (x.row, x.column) for x in cp.pairs)


CROSSPLAY_RULES: tuple[Rule, ...] = (
    Rule(
        cel=_HAS + f"{_PAIRS}.all(x, self.policies.exists(p, p.name == x.row) && "
        "self.policies.exists(p, p.name == x.column))",
        message="each pair's row and column must name a policy of spec.policies",
        check=_every_pair(_known),
        field=".evaluation.crossPlay.pairs",
    ),
    Rule(
        cel=_HAS
        + f"{_PAIRS}.all(x, x.row != x.column || self.policies.exists(p, p.name == x.row && has(p.league)))",
        message="a policy against itself needs its league (spec.policies[].league): without "
        "snapshots it has one version to play",
        check=_every_pair(
            lambda s, x: x.row != x.column or all(p.league is not None for p in _members(s, x))
        ),
        field=".evaluation.crossPlay.pairs",
    ),
    Rule(
        cel=_HAS + f"{_PAIRS}.all(x, self.policies.exists(p, {_MEMBER} && (has(p.league) || {_FROZEN})))",
        message="in each pair one policy at least must have a league (its past versions) or be frozen "
        "(a fixed reference): otherwise each pass plays only the two current versions, and no two "
        "passes share a version to rate them by",
        check=_every_pair(lambda s, x: any(p.league is not None or p.frozen for p in _members(s, x))),
        field=".evaluation.crossPlay.pairs",
    ),
    Rule(
        cel=_HAS + f"{_PAIRS}.all(x, self.policies.exists(p, {_MEMBER} && !{_FROZEN}))",
        message="in each pair one policy at least must be trained: two frozen policies have one "
        "version each, and no training step to play them at",
        check=_every_pair(lambda s, x: any(not p.frozen for p in _members(s, x))),
        field=".evaluation.crossPlay.pairs",
    ),
    Rule(
        cel=_HAS + "!has(self.evaluation.crossPlay.anchor) || (self.policies.exists(p, "
        f"p.name == self.evaluation.crossPlay.anchor && {_FROZEN}) && {_PAIRS}.exists(x, "
        "x.row == self.evaluation.crossPlay.anchor || x.column == self.evaluation.crossPlay.anchor))",
        message="must name a frozen policy (frozen: true) that is in one of the pairs: the anchor's "
        "one version is the ratings' fixed point",
        check=_anchor_ok,
        field=".evaluation.crossPlay.anchor",
    ),
)
