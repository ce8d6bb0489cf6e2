"""What an engine keeps of aborted requests (`Engine.abort`): the counts it reports, and the ids of
aborts that arrived before their request.

An abort is sent after its request, but calls to an async actor may start out of order, and a request
may still wait before the engine registers it (a tokenizer load, a weight sync); so an abort for an id
the engine does not hold is remembered, and the request, when it arrives, is refused at once. Ids of
requests that had already finished are remembered the same way (the engine cannot tell them apart),
which is why the memory is bounded: the last `REMEMBERED` of them.
"""

from __future__ import annotations

from collections import OrderedDict

from polyrl_runtime.engines.api import RequestAbortedError, SamplingParams

REMEMBERED = 4096


class Aborts:
    """One engine's aborted requests: `aborted` and `freed_tokens` go into its `EngineStats`."""

    def __init__(self, engine: str, remembered: int = REMEMBERED) -> None:
        if remembered < 1:
            raise ValueError(f"engine {engine}: remembered must be >= 1, got {remembered}")
        self.engine = engine
        self.aborted = 0
        self.freed_tokens = 0
        self._early: OrderedDict[str, None] = OrderedDict()
        self._remembered = remembered

    def unmatched(self, request_id: str) -> None:
        """An abort for `request_id`, which the engine does not hold: refuse it if it comes."""
        self._early[request_id] = None
        self._early.move_to_end(request_id)
        while len(self._early) > self._remembered:
            self._early.popitem(last=False)

    def arrived_aborted(self, params: SamplingParams) -> RequestAbortedError | None:
        """The error to refuse an arriving request with when its abort came first (counted, with
        nothing generated), else None."""
        if params.request_id not in self._early:
            return None
        del self._early[params.request_id]
        return self.stopped(params, 0)

    def stopped(self, params: SamplingParams, generated: int) -> RequestAbortedError:
        """Count a request stopped after `generated` tokens; the error its `generate` raises."""
        self.aborted += 1
        self.freed_tokens += max(0, params.max_new_tokens - generated)
        return RequestAbortedError(self.engine, params.request_id, generated, params.max_new_tokens)
