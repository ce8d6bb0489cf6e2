"""benchmarks/algorithms.py's judgements: stability windows, the goal, and each variant's job."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load() -> ModuleType:
    # By path under its own name: `algorithms` alone could be another module of the test tree.
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("algorithms_benchmark", BENCHMARKS / "algorithms.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load()


def test_the_window_is_ten_steps_or_a_third_of_a_shorter_run() -> None:
    assert [bench.window(n) for n in (40, 30, 29, 20, 10, 3, 2, 1)] == [10, 10, 9, 6, 3, 1, 1, 1]


def test_a_run_is_unstable_when_its_last_window_falls_more_than_0_2_below_its_best() -> None:
    rising = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)  # windows of 2: the last is the best
    assert not bench.unstable(rising)
    collapsed = (0.2, 0.7, 0.8, 0.6, 0.4, 0.5)  # best 0.75, last 0.45
    assert bench.unstable(collapsed)
    exactly = (0.5, 0.5, 0.5, 0.5, 0.25, 0.35)  # best 0.5, last 0.3: a drop of 0.2 is not more
    assert not bench.unstable(exactly)
    assert bench.rolling((0.4, math.nan, 0.8, 0.6), 2) == pytest.approx([0.4, 0.8, 0.7])


def test_a_window_without_rewards_is_not_judged() -> None:
    means = bench.rolling((0.9, 0.9, 0.9, math.nan, math.nan, math.nan), 3)
    assert means[0] == pytest.approx(0.9) and math.isnan(means[-1])
    assert not bench.unstable((0.9, 0.9, 0.9, math.nan, math.nan, math.nan))


def test_the_goal_needs_a_candidate_as_good_and_no_row_more_than_0_05_below() -> None:
    assert bench.goal({"grpo": 0.20, "dr_grpo": 0.20, "dapo": 0.16, "ppo": 0.151}).startswith("met ")
    # DAPO is 0.06 below: too far, though Dr. GRPO is better.
    assert bench.goal({"grpo": 0.20, "dr_grpo": 0.25, "dapo": 0.14}).startswith("not met ")
    assert bench.goal({"grpo": 0.20, "dr_grpo": 0.19, "dapo": 0.18}).startswith("not met ")
    # Gains are means of multiples of 1 / eval rows: equal means that differ by rounding are equal.
    assert bench.goal({"grpo": 0.1 + 0.2, "dr_grpo": 0.3}).startswith("met ")
    assert bench.goal({"dr_grpo": 0.3, "dapo": 0.2}).startswith("not judged")
    assert bench.goal({"grpo": 0.3, "rloo": 0.2}).startswith("not judged")


def test_an_unknown_variant_is_refused_naming_the_option() -> None:
    assert bench.parse_variants("dapo, grpo,dapo") == ["dapo", "grpo"]
    with pytest.raises(ValueError, match=r"--variants: unknown \['grpo_x'\] \(known: grpo, dr_grpo"):
        bench.parse_variants("grpo,grpo_x")
    with pytest.raises(ValueError, match="--variants: unknown empty list"):
        bench.parse_variants(" , ")


def test_every_variant_is_a_valid_job_that_differs_from_grpo_only_in_its_algorithm() -> None:
    from real_model import polyrl_job  # type: ignore[import-not-found]

    h = bench.Hyper(steps=2, prompts=4, group=4, lr=1e-5, max_new_tokens=32, temperature=0.7, seed=1)
    uri, rows = "builtin://tiny-qwen2", Path("/tmp/rows.jsonl")
    jobs = {
        v: polyrl_job(h, uri, rows, ["solver"], "sync", policy=bench.variant_policy(h, uri, v))
        for v in bench.VARIANTS
    }
    policies = {v: job.spec.policies[0] for v, job in jobs.items()}
    algorithms = {v: p.algorithm for v, p in policies.items()}
    assert {v: a.name for v, a in algorithms.items()} == {
        "grpo": "grpo", "dr_grpo": "dr_grpo", "rloo": "rloo", "reinforce_pp": "reinforce_pp",
        "reinforce_pp_baseline": "reinforce_pp_baseline", "ppo": "ppo", "dapo": "grpo", "gspo": "grpo",
    }  # fmt: skip
    assert algorithms["grpo"].advantage_norm == "per-policy" and algorithms["dr_grpo"].advantage_norm is None
    dapo, gspo = algorithms["dapo"], algorithms["gspo"]
    assert dapo.clip_eps_high == 0.28 and dapo.dynamic_sampling is not None and not dapo.overlong_filter
    assert dapo.overlong_penalty is not None and dapo.overlong_penalty.buffer_tokens == 8  # 32 // 4
    assert dapo.loss_aggregation == "token-mean"
    assert (gspo.ratio_level, gspo.loss_aggregation) == ("sequence", "seq-mean-token-mean")
    assert (gspo.clip_eps, gspo.clip_eps_high) == (3e-4, 4e-4)
    # The same budget and trainer for every row: 16 samples a step, micro-batches of one group.
    assert {j.spec.training.episodes_per_step for j in jobs.values()} == {16}
    assert {p.trainer.micro_batch_size for p in policies.values()} == {4}
    base = policies["grpo"].model_dump(exclude={"algorithm"})
    assert all(p.model_dump(exclude={"algorithm"}) == base for p in policies.values())
