"""Bad input, fuzzed (issue #7): hypothesis-generated mutations of the example RLJobs (wrong types,
out-of-range numbers, missing and unknown fields, huge strings, unicode, other plausible values, bad
names) are each either rejected by ``kubectl apply`` with a message naming the mutated field, or
accepted and then reconciled by the real operator process without it crashing, logging an error or
failing a reconcile (an InvalidSpec condition naming the field is a fine outcome); then deleted.

Seeded and reproducible: the same POLYRL_FUZZ_SEED gives the same cases (a failure names each case:
its id, example, mutation and path). All cases go to one ``kubectl apply -f DIR``, one file per case:
kubectl names the file in each error, so every rejection is attributed to its case.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from polyrl_testenv.bad_rljobs import EXAMPLES
from polyrl_testenv.operator_proc import SyncApi, start_operator

pytestmark = pytest.mark.e2e

SEED = int(os.environ.get("POLYRL_FUZZ_SEED", "20260107"))
MAX_EXAMPLES = 240
MIN_CASES = 200
# Only the examples' GPU types are mapped and allowed, so the operator's own checks (InvalidSpec) have
# something to reject among the documents the server accepts.
SETTINGS: dict[str, Any] = {
    "resyncSeconds": 5, "errorBackoff": 0.2, "errorBackoffMax": 2, "progressTimeout": 0.5,
    "strictGpuTypes": True, "gpuTypes": {"l40s": {}, "h100": {}, "a100-80gb": {}},
}  # fmt: skip
OPS = (
    "wrong-type", "number", "delete", "unknown-field", "add-field", "huge-string", "unicode", "plausible", "name",
)  # fmt: skip
ROLES = ("workflow", "rollout", "trainer")
UNICODE = ("ünïcödé", "名前", "مرحبا بالعالم", "שלום", "🚀🔥", "\u202eevil", "a\u0301", "Ω≈ç√", "\u3000")
NAME_TEMPLATES = ("{n}-ü", "{n}.dot", "{n}_x", "{N}", "9{n}", "{n}-", "🚀{n}", "{n}\u202e", "{n} x")
Doc = dict[str, Any]
Loc = tuple[str | int, ...]


def _walk(node: Any, loc: Loc = ()) -> Iterator[tuple[Loc, Any]]:
    yield loc, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from _walk(child, (*loc, key))


def _fmt(loc: Loc) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _examples() -> dict[str, Doc]:
    out = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            doc["metadata"] = {"name": doc["metadata"]["name"]}  # the test's namespace, not the example's
            out[doc["metadata"]["name"]] = doc
    return out


EXAMPLE_DOCS = _examples()
PLAUSIBLE = {v for d in EXAMPLE_DOCS.values() for _, v in _walk(d["spec"]) if isinstance(v, str)} | {
    "sync", "vllm", "ppo", "grpo", "other", "none", "0", "true", "-1",
}  # fmt: skip
TARGETS: dict[str, Callable[[Any], bool]] = {
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "unknown-field": lambda v: isinstance(v, dict),
    "huge-string": lambda v: isinstance(v, str),
    "unicode": lambda v: isinstance(v, str),
    "plausible": lambda v: isinstance(v, str),
}


def _additions(v: Any) -> list[tuple[str, Any, tuple[str, ...]]]:
    """Optional fields the examples leave out, for a role (where the operator checks free-form input):
    (key, value, the fields inside it an error may name instead)."""
    return [
        ("podTemplate", {"spec": {"restartPolicy": v}}, ("restartPolicy",)),
        ("podTemplate", {"spec": {"containers": [{"name": v}], "nodeSelector": {"k": v}}}, ("containers", "nodeSelector")),
        ("podTemplate", {"metadata": {"labels": {"polyrl.dev/job": v}, "annotations": {"a": v}}}, ("labels", "annotations")),
        ("env", [{"name": v, "value": v}], ()),
        ("image", v, ()),
        ("gpuType", v, ()),
    ]  # fmt: skip


@dataclass(frozen=True)
class Mutation:
    example: str
    op: str
    loc: Loc
    value: Any = None
    names: tuple[str, ...] = ()


@dataclass
class Case:
    id: str
    mutation: Mutation
    doc: Doc
    name: str | None
    outcome: str = ""
    detail: str = ""

    def __str__(self) -> str:
        m, shown = self.mutation, repr(self.mutation.value)
        shown = shown if len(shown) < 80 else f"{shown[:60]}... ({len(shown)} chars)"
        return f"{self.id} [{m.example}: {m.op} at {_fmt(m.loc)}{'' if m.op == 'delete' else ' = ' + shown}]"

    def names_the_field(self, message: str) -> bool:
        """Whether an error mentions the mutated field (the last key of its path, as the server and the
        operator print paths; or a field inside an added one, as a refused pod or Workload names it)
        or, for a rule across fields (min <= max, grpo needs groupSize >= 2), a sibling under the
        same parent object; a missing metadata is first of all a missing name."""
        keys = [p for p in self.mutation.loc if isinstance(p, str)]
        needles = ["metadata", "name"] if keys == ["metadata"] else [keys[-1], *self.mutation.names]
        if len(keys) > 2:
            needles.append(_fmt(self.mutation.loc[:-1]) + ".")
        return any(needle.lower() in message.lower() for needle in needles)


def _values(op: str, current: Any) -> st.SearchStrategy[Any]:
    if op == "wrong-type":
        others = ["a-string", 42, -1, 2.5, True, None, [1, "two"], {"k": "v"}]
        return st.sampled_from([v for v in others if type(v) is not type(current)])
    if op == "number":
        edges = st.sampled_from([0, -1, -(2**31), 2**31, 2**63, 10**30, 0.5, -0.0, 1e300, 1e-300])
        return edges | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False)
    if op == "huge-string":  # 10-100 KB of UTF-8 (client-side apply's annotation must stay under 256 KB)
        chars = st.sampled_from(["x", "é", "名", "🚀", "\u202e"])
        return st.builds(lambda n, c: c * (n // len(c.encode())), st.integers(10_000, 100_000), chars)
    if op == "unicode":
        return st.sampled_from(UNICODE) | st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
    if op == "plausible":  # looks right: an enum's other member, a value from elsewhere in the examples
        return st.sampled_from([v for v in sorted(PLAUSIBLE) if v != current])
    if op == "unknown-field":
        letters = st.characters(categories=["L", "N", "So"]) | st.sampled_from("-_")
        key = st.text(letters, min_size=1, max_size=24).filter(lambda k: k not in current)
        return st.tuples(key, st.sampled_from([1, "x", {"a": [1]}, [], None]))
    return st.sampled_from(NAME_TEMPLATES) | st.integers(40, 300).map(lambda k: "{n}" + "a" * k)


@st.composite
def mutations(draw: st.DrawFn) -> Mutation:
    # The structure (example, kind of mutation, where) uniformly from a Random that hypothesis seeds;
    # the values from hypothesis's strategies, which favour edge cases.
    rnd = draw(st.randoms(use_true_random=True))
    example, op = rnd.choice(sorted(EXAMPLE_DOCS)), rnd.choice(OPS)
    if op == "name":
        return Mutation(example, op, ("metadata", "name"), draw(_values(op, None)))
    doc = EXAMPLE_DOCS[example]
    if op == "add-field":
        role = rnd.choice([loc for loc, _ in _walk(doc) if loc[-1:] and loc[-1] in ROLES])
        value = draw(_values(rnd.choice(["huge-string", "unicode", "plausible", "wrong-type"]), ""))
        key, subtree, names = rnd.choice(_additions(value))
        return Mutation(example, op, (*role, key), subtree, names)
    nodes = [(loc, v) for loc, v in _walk(doc) if loc[:1] == ("spec",) or loc == ("metadata",)]
    preferred = [(loc, v) for loc, v in nodes if TARGETS.get(op, lambda _: True)(v)]
    loc, current = rnd.choice(preferred if preferred and rnd.random() < 0.8 else nodes)
    if op == "delete":
        return Mutation(example, op, loc)
    if op == "unknown-field" and not isinstance(current, dict):
        op = "wrong-type"
    value = draw(_values(op, current))
    if op == "unknown-field":
        return Mutation(example, op, (*loc, value[0]), value[1])
    return Mutation(example, op, loc, value)


def generate_mutations() -> list[Mutation]:
    found: list[Mutation] = []

    @seed(SEED)
    @settings(
        max_examples=MAX_EXAMPLES, database=None, deadline=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(mutations())
    def collect(mutation: Mutation) -> None:
        found.append(mutation)

    collect()
    return found


def materialize(index: int, mutation: Mutation) -> Case:
    """The case's document: its example, renamed uniquely (fz<index>-...), with the mutation applied."""
    base = f"fz{index:03d}-{mutation.example}"[:20].rstrip("-")
    doc = copy.deepcopy(EXAMPLE_DOCS[mutation.example])
    doc["metadata"]["name"] = base
    *parents, last = mutation.loc
    node: Any = doc
    for part in parents:
        node = node[part]
    value = mutation.value
    if isinstance(value, str) and mutation.loc == ("metadata", "name"):  # keep names unique
        value = (
            value.replace("{n}", base).replace("{N}", base.upper()) if "{n" in value else f"{base}-{value}"
        )
    if mutation.op == "delete":
        del node[last]
    else:
        node[last] = value
    name = doc["metadata"].get("name") if isinstance(doc.get("metadata"), dict) else None
    return Case(f"case-{index:03d}", mutation, doc, name if isinstance(name, str) else None)


def test_generation_is_seeded_and_reproducible() -> None:
    first, second = generate_mutations(), generate_mutations()
    assert first == second
    assert len(first) >= MIN_CASES, f"hypothesis produced only {len(first)} distinct cases"
    assert set(OPS) <= {m.op for m in first}, "every kind of mutation occurs"


def apply_all(cp: Any, namespace: str, cases: list[Case], directory: Path) -> None:
    """One ``kubectl apply`` of one file per case; each case's outcome from what kubectl says of it."""
    directory.mkdir()
    for case in cases:
        (directory / f"{case.id}.json").write_text(json.dumps(case.doc))
    result = cp.kubectl("apply", "-n", namespace, "-f", str(directory), timeout=600)
    # kubectl names the file in every error; an error's text runs to the end of its line or to the
    # next file named on the same line (client-side errors come as one "[a, b, ...]" line).
    stderr = result.stderr
    mentions = list(re.finditer(r'"[^"\n]*?(case-\d{3})\.json"', stderr))
    errors: dict[str, str] = {}
    for here, after in zip(mentions, [*mentions[1:], None], strict=True):
        line_end = stderr.find("\n", here.end())
        stop = min(line_end if line_end >= 0 else len(stderr), after.start() if after else len(stderr))
        errors[here[1]] = errors.get(here[1], "") + stderr[here.end() : stop]
    created = set(re.findall(r"^rljob\.polyrl\.dev/(\S+) created$", result.stdout, re.MULTILINE))
    for case in cases:
        accepted, rejected = case.name in created, case.id in errors
        case.outcome = (
            "accepted" if accepted and not rejected else "rejected" if rejected and not accepted else "?"
        )
        case.detail = errors.get(case.id, "")
    unclear = [str(c) for c in cases if c.outcome == "?"]
    assert not unclear, f"kubectl said nothing (or both) about:\n{unclear}\n{result.stdout}\n{stderr}"


def log_problems(log: Path) -> list[str]:
    """Unhandled exceptions, errors and failed reconciles in the operator's log (JSON lines)."""
    problems = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:  # not from the logger: a crash's traceback on stderr, a warning
            entry = {"level": "error" if re.search(r"Traceback|Error|Exception", line) else "info"}
        bad_level = str(entry.get("level")).lower() in {"error", "critical", "exception"}
        failed = str(entry.get("event", "")).startswith("reconcile failed") and entry.get("level") != "info"
        if bad_level or failed or {"exception", "exc_info"} & set(entry) or "Traceback" in line:
            problems.append(line[:2000])
    return problems


def wait_for(
    what: str, missing: Callable[[], list[str]], proc: subprocess.Popen[bytes], log: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while (left := missing()) and time.monotonic() < deadline:
        assert proc.poll() is None, f"operator exited with {proc.returncode}:\n{log.read_text()[-5000:]}"
        time.sleep(1)
    assert not left, f"{what}: still waiting for {len(left)}, e.g. {left[:5]}\n{log.read_text()[-5000:]}"


def test_fuzzed_rljobs_are_rejected_naming_the_field_or_reconciled(
    cluster: Any, namespace: str, tmp_path: Path
) -> None:
    # ``cluster`` (tests/e2e/conftest.py): the RLJob CRD and Kueue's; the debate example names a queue.
    cases = [materialize(i, m) for i, m in enumerate(generate_mutations())]
    started = time.monotonic()
    apply_all(cluster, namespace, cases, tmp_path / "cases")
    applied = time.monotonic()
    rejected = [c for c in cases if c.outcome == "rejected"]
    accepted = {c.name: c for c in cases if c.outcome == "accepted" and c.name}
    print(f"\nfuzz seed={SEED}: {len(cases)} cases, {len(rejected)} rejected, {len(accepted)} accepted")
    assert len(cases) >= MIN_CASES and rejected and accepted
    unnamed = [f"{c}: {c.detail[:600]}" for c in rejected if not c.names_the_field(c.detail)]
    assert not unnamed, f"seed {SEED}: rejected without naming the field:\n" + "\n".join(unnamed)

    api = SyncApi(cluster.server)
    rljobs = f"/apis/polyrl.dev/v1alpha1/namespaces/{namespace}/rljobs"
    log = tmp_path / "operator-fuzz.log"
    proc = start_operator(cluster.kubeconfig, namespace, SETTINGS, tmp_path, "fuzz")
    try:
        jobs: dict[str, Doc] = {}

        def unreconciled() -> list[str]:  # no status yet, or one written for an older generation
            jobs.update({j["metadata"]["name"]: j for j in api.list(rljobs)})
            statuses = {name: (jobs[name].get("status") or {}, jobs[name]["metadata"]) for name in accepted}
            return [
                str(accepted[name])
                for name, (status, meta) in statuses.items()
                if status.get("observedGeneration") != meta["generation"] or not status.get("conditions")
            ]

        wait_for("a status from the operator", unreconciled, proc, log, timeout=300)
        reconciled = time.monotonic()
        invalid, unnamed = 0, []
        for name, case in accepted.items():
            failed = next(c for c in jobs[name]["status"]["conditions"] if c["type"] == "Failed")
            if failed["status"] == "True" and failed["reason"] == "InvalidSpec":
                invalid += 1
                if not case.names_the_field(failed["message"]):
                    unnamed.append(f"{case}: {failed['message'][:600]}")
        print(f"InvalidSpec: {invalid} of {len(accepted)} accepted")
        assert not unnamed, f"seed {SEED}: InvalidSpec without naming the field:\n" + "\n".join(unnamed)

        # Deleted while the operator runs: its finalizer goes once it has removed every child.
        deleted = cluster.kubectl("delete", "rljobs", "--all", "-n", namespace, "--wait=false")
        assert deleted.returncode == 0, deleted.stderr
        wait_for("deletion", lambda: [j["metadata"]["name"] for j in api.list(rljobs)], proc, log, 300)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    done = time.monotonic()
    print(
        f"apply {applied - started:.0f}s, reconcile {reconciled - applied:.0f}s, delete {done - reconciled:.0f}s"
    )
    problems = log_problems(log)
    shown = "\n".join(problems[:20])
    assert not problems, f"seed {SEED}: {len(problems)} problem(s) in the operator log:\n{shown}"
