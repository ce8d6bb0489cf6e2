"""The gpu tier's verdict from pytest's JUnit report: counts, each failure, each skip and its reason,
the measurements tests record (`record_property`), and the test files that could not be collected
because a stack this machine lacks (Ray, DeepSpeed, vLLM) is imported at module level.

    python hack/gpu/summary.py JUNIT_XML SUMMARY_TXT PYTEST_STATUS

Writes the summary to SUMMARY_TXT and prints it. Exit status 0 only when pytest's status is 0 or its
only errors are such collection errors, no test failed or errored, and at least one test passed.
"""

from __future__ import annotations

import ast
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

# Stacks the GPU machine does not have: a test file that imports one at collection is "not run".
ABSENT_STACKS = ("ray", "deepspeed", "vllm")
MISSING = re.compile(r"ModuleNotFoundError: No module named '([A-Za-z0-9_.]+)'")


@dataclass
class Report:
    passed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    not_run: list[tuple[str, str]] = field(default_factory=list)  # (file, the stack it needs)
    properties: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)


def _name(case: ET.Element) -> str:
    cls, name = case.get("classname", ""), case.get("name", "")
    return f"{cls}::{name}" if cls else name


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _skip_text(text: str) -> str:
    """The reason in a collection skip's text, which pytest writes as ('path', line, 'Skipped: why')."""
    try:
        where = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()
    if isinstance(where, tuple) and len(where) == 3:
        return str(where[2]).removeprefix("Skipped: ")
    return text.strip()


def parse(junit: Path) -> Report:
    report = Report()
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = _name(case)
        props = [(p.get("name", ""), p.get("value", "")) for p in case.iter("property")]
        if props:
            report.properties.append((name, props))
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        skip = case.find("skipped")
        if problem is not None:
            text = (problem.text or "") + " " + (problem.get("message") or "")
            missing = MISSING.search(text)
            collection = problem.get("message", "").startswith("collection failure")
            if collection and missing and missing.group(1).split(".")[0] in ABSENT_STACKS:
                report.not_run.append((name, missing.group(1).split(".")[0]))
            else:
                report.failed.append((name, problem.get("message") or _first_line(problem.text or "")))
        elif skip is not None:
            # A module-level skip's message is "collection skipped"; its text holds the reason.
            reason = skip.get("message", "")
            if reason == "collection skipped" or not reason:
                reason = _skip_text(skip.text or reason)
            report.skipped.append((name, reason))
        else:
            report.passed.append(name)
    return report


def render(report: Report) -> str:
    out = [
        f"gpu tier: {len(report.passed)} passed, {len(report.failed)} failed, "
        f"{len(report.skipped)} skipped, {len(report.not_run)} test files not run"
    ]
    for title, rows in (
        ("FAILED", report.failed),
        ("SKIPPED", report.skipped),
        ("NOT RUN (this machine lacks the stack)", report.not_run),
    ):
        if rows:
            out.append(f"!!! {title}:")
            out.extend(f"  {name}: {why}" for name, why in rows)
    if report.passed:
        out.append("passed:")
        out.extend(f"  {name}" for name in report.passed)
    if report.properties:
        out.append("measurements:")
        for name, props in report.properties:
            out.append(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in props))
    return "\n".join(out) + "\n"


def verdict(report: Report, pytest_status: int) -> int:
    # pytest exits 1 for the collection errors counted as "not run" too: those alone do not fail.
    pytest_ok = pytest_status == 0 or (pytest_status == 1 and not report.failed)
    return 0 if pytest_ok and not report.failed and report.passed else 1


def main(argv: list[str]) -> int:
    junit, summary, status = Path(argv[1]), Path(argv[2]), int(argv[3])
    if not junit.is_file():
        text = f"gpu tier: FAILED, no JUnit report at {junit} (pytest exited {status})\n"
        summary.write_text(text)
        print(text, end="")
        return 1
    report = parse(junit)
    code = verdict(report, status)
    text = render(report) + f"pytest exit status {status}; verdict: {'PASS' if code == 0 else 'FAIL'}\n"
    summary.write_text(text)
    print(text, end="")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
