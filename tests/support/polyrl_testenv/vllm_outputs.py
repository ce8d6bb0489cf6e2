"""Stand-ins for vLLM's request outputs, as the vLLM engine adapter reads them (`vllm_engine.py`), for the
CPU tests that run the adapter against a stand-in `AsyncLLM`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Completion:
    """`vllm.outputs.CompletionOutput`: the fields the adapter reads."""

    token_ids: list[int]
    logprobs: list[dict[int, Any]]
    finish_reason: str = "length"
    stop_reason: Any = None
    weight_versions: Any = None


@dataclass
class Logprob:
    """`vllm.logprobs.Logprob`."""

    logprob: float


def two_tokens(weight_versions: Any = None) -> Any:
    """A `RequestOutput` of tokens 7 and 8 with logprobs -0.5 and -0.25."""
    completion = Completion(
        [7, 8], [{7: Logprob(-0.5)}, {8: Logprob(-0.25)}], weight_versions=weight_versions
    )
    return type("RequestOutput", (), {"outputs": [completion]})()
