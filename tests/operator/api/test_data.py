"""`spec.data` URIs: files by URI and reasoning-gym datasets are accepted; anything else is refused by
the same pattern the CRD carries."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from polyrl_operator.api.data import Data


@pytest.mark.parametrize(
    "uri",
    [
        "file:///data/train.jsonl",
        "pvc://prompts/gsm8k/train.parquet",
        "s3://bucket/prompts/train.json",
        "reasoning-gym://basic_arithmetic",
        "reasoning-gym://basic_arithmetic?size=200&seed=1&max_terms=2",
        'reasoning-gym://basic_arithmetic?operators=["+","-"]',
    ],
)
def test_data_uris_that_are_accepted(uri: str) -> None:
    assert Data(train=uri, eval=uri).train == uri


@pytest.mark.parametrize(
    "uri",
    [
        "file:///data/train.csv",
        "reasoning-gym://",
        "reasoning-gym://Basic-Arithmetic",
        "gym://basic_arithmetic",
    ],
)
def test_data_uris_that_are_refused(uri: str) -> None:
    with pytest.raises(ValidationError, match="train"):
        Data(train=uri)
