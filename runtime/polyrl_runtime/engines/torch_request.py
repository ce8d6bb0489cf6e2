"""A request in the torch engine: its prompt, parameters, the reply so far and its cache row's state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from polyrl_runtime.engines.api import Generation, SamplingParams


@dataclass(eq=False)  # compared by identity: the running batch finds and removes its own requests
class TorchRequest:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future[Generation]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    # The update counts of the weights its cache row was computed with (base, its adapter): the row is
    # current while they are unchanged.
    cached_weights: tuple[int, int] | None = None
    stop_str: str = ""
    # Counted among the engine's aborted requests (by `abort`, at once): not counted again when dropped.
    counted: bool = False
    _bias: torch.Tensor | None = None

    def bias(self, vocab: int) -> torch.Tensor:
        """[vocab]: 0 for the allowed ids (all when unconstrained), -inf elsewhere; built once."""
        if self._bias is None:
            ids = torch.tensor(self.params.allowed_ids, dtype=torch.long)
            self._bias = torch.zeros(vocab) if not ids.numel() else torch.full((vocab,), float("-inf"))
            self._bias[ids] = 0.0
        return self._bias

    def last_token(self) -> int:
        return self.tokens[-1] if self.tokens else self.prompt[-1]
