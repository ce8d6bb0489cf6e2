"""reasoning-gym datasets as prompt data: generated rows (deterministic for the seed, with the dataset's
own parameters), the errors for a bad name or parameter, the `reasoning_gym` reward, a resumed data
position, and PromptCompletion's answer extraction."""

from __future__ import annotations

import re

import pytest

from polyrl_runtime.coordinator.datafeed import DataFeed
from polyrl_runtime.data.sources import DataError, load_rows
from polyrl_runtime.rewards import score
from polyrl_runtime.workflows.prompts import EXTRACTORS, PromptCompletion

URI = "reasoning-gym://basic_arithmetic?size=20&seed=3&max_terms=2&max_digits=1"


def test_rows_are_the_datasets_entries_deterministic_for_the_seed() -> None:
    rows = load_rows(URI)
    assert len(rows) == 20
    assert rows == load_rows(URI)
    assert rows != load_rows(URI.replace("seed=3", "seed=4"))
    assert load_rows("reasoning-gym://basic_arithmetic?size=5") == load_rows(
        "reasoning-gym://basic_arithmetic?size=5&seed=0"
    )  # no seed: 0, never a random one
    for row in rows:
        assert row["prompt"] == row["question"]
        assert row["metadata"]["source_dataset"] == "basic_arithmetic"
        assert row["metadata"]["num_terms"] == 2  # the dataset's own parameter applied
    ops = load_rows('reasoning-gym://basic_arithmetic?size=10&operators=["+"]')  # a plus stays a plus
    assert all(" - " not in r["question"] and "*" not in r["question"] for r in ops)
    assert all(" + " in r["question"] for r in ops)


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        (
            "reasoning-gym://basic_arithmetc?size=3",
            r"reasoning-gym has no dataset 'basic_arithmetc' \(the closest names: basic_arithmetic",
        ),
        (
            "reasoning-gym://basic_arithmetic?size=3&max_term=2",
            r"parameter 'max_term' is not a parameter of reasoning-gym's basic_arithmetic "
            r"\(its parameters: .*max_terms",
        ),
        (
            "reasoning-gym://basic_arithmetic?min_terms=5&max_terms=2",
            r"reasoning-gym's basic_arithmetic refuses these parameters: max_terms must be >= min_terms",
        ),
        ("reasoning-gym://basic_arithmetic?size=3&size=4", r"parameter 'size' is given twice"),
        ("reasoning-gym://basic_arithmetic?size=0", r"the dataset has no rows|refuses these parameters"),
        ("reasoning-gym:///x", r"expected reasoning-gym://DATASET\?PARAM=VALUE"),
    ],
    ids=["unknown-dataset", "unknown-parameter", "refused-value", "twice", "empty", "no-name"],
)
def test_a_bad_dataset_or_parameter_is_named(uri: str, message: str) -> None:
    with pytest.raises(DataError, match=f"^{re.escape(uri)}: "):
        load_rows(uri)
    with pytest.raises(DataError, match=message):
        load_rows(uri)


def test_the_reward_is_the_datasets_own_score() -> None:
    row = load_rows(URI)[0]
    assert score("reasoning_gym", str(row["answer"]), row, episode="e") == 1.0
    assert score("reasoning_gym", "no number here", row, episode="e") == 0.0
    wrong = str(int(row["answer"]) + 1)
    assert score("reasoning_gym", wrong, row, episode="e") == 0.0


def test_a_resumed_feed_plays_the_same_generated_rows_from_its_position() -> None:
    def feed() -> DataFeed:
        return DataFeed(URI, load_rows(URI), seed=1, shuffle=True, epochs=None)

    whole = feed()
    played = [whole.take(f"g{i}") for i in range(8)]
    first = feed()
    for i in range(5):
        first.take(f"g{i}")
        first.settle(f"g{i}")
    resumed = feed()  # a new process generates the rows again
    resumed.restore(first.state())
    assert [r.fields for r in (resumed.take(f"g{i}") for i in range(5, 8)) if r] == [
        p.fields for p in played[5:] if p
    ]


@pytest.mark.parametrize(
    ("extract", "reply", "want"),
    [
        ("reply", "  7 + 5 = 12 \n", "7 + 5 = 12"),
        ("answer_tag", "so <answer>3</answer> or <answer> 12 </answer>.", "12"),
        ("answer_tag", "12", ""),
        ("last_line", "7 + 5 = 12\nThe answer is 12.\n\n", "The answer is 12."),
        ("last_line", "  \n", ""),
    ],
)
def test_prompt_completion_extracts_the_answer_as_its_argument_says(
    extract: str, reply: str, want: str
) -> None:
    assert EXTRACTORS[extract](reply) == want


def test_an_unknown_extraction_is_refused_naming_the_argument() -> None:
    with pytest.raises(
        ValueError, match=r"workflow.args.extract 'tag': expected one of reply, answer_tag, last_line"
    ):
        PromptCompletion(reward="reasoning_gym", extract="tag")
