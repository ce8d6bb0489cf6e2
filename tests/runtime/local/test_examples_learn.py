"""The solver-verifier (on pods of each role's own, on one device pool, and as two LoRA adapters on
one base) and calculator-agent examples learn under `polyrl run`, as shipped.

Each run is seeded; the check compares the mean reward of the last 10 steps with the first 10, per
policy, with margins about half the smallest rise measured over seeds 1-3 (docs/performance.md) and
several times what a policy that does not learn moves. The verifier judges right answers half the
time (the workflow's `contrast`), so answering one way always earns 0.5 and its rise is checking."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyrl_testenv.localrun import metrics_rows, run_to_end

EXAMPLES = Path(__file__).parents[3] / "manifests" / "examples"


def run_example(name: str, out: Path) -> dict[str, list[float]]:
    """Run manifests/examples/`name` to the end; each policy's per-step mean reward."""
    run_to_end(EXAMPLES / name, out, "--quiet")
    rewards: dict[str, list[float]] = {}
    for row in metrics_rows(out):
        rewards.setdefault(row["policy"], []).append(float(row["reward_mean"]))
    return rewards


def rise(rewards: list[float], window: int = 10) -> float:
    return sum(rewards[-window:]) / window - sum(rewards[:window]) / window


@pytest.mark.slow
@pytest.mark.parametrize(
    ("example", "margins", "steps"),
    [
        # seeds 1-3, 60 steps: solver 0.33-0.41 -> 0.89-0.94, verifier 0.51-0.53 -> 0.69-0.76 (rises
        # 0.16-0.25); a policy that does not learn (a solver shown a whole word problem, collapsed onto
        # one answer; a verifier at lr 1e-3, collapsed onto `n`) moved its 10-step mean by 0.00-0.05
        ("solver-verifier-cpu.yaml", {"solver": 0.3, "verifier": 0.08}, 60),
        # the same job with every engine and trainer on pool `shared`: the same margins
        ("solver-verifier-pool-cpu.yaml", {"solver": 0.3, "verifier": 0.08}, 60),
        # both policies as LoRA adapters on one base, operands up to 1: seeds 1-3, solver 0.50-0.52 ->
        # 0.83-0.85, verifier 0.49-0.52 -> 0.63-0.92 (rises 0.10-0.43)
        ("solver-verifier-lora-cpu.yaml", {"solver": 0.15, "verifier": 0.05}, 60),
        # seeds 1-3, 40 steps: reward (answer, partial credit, call) 0.10-0.14 -> 0.33-0.42
        ("calculator-agent-cpu.yaml", {"solver": 0.1}, 40),
    ],
)
def test_the_example_learns(example: str, margins: dict[str, float], steps: int, tmp_path: Path) -> None:
    rewards = run_example(example, tmp_path)
    assert {p: len(r) for p, r in rewards.items()} == dict.fromkeys(margins, steps)
    for policy, margin in margins.items():
        assert rise(rewards[policy]) >= margin, (policy, rewards[policy])
