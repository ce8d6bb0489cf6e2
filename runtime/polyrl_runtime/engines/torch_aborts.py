"""Aborts in the torch engine (`Engine.abort`), a mixin of `TorchEngine`.

`abort` fails the requests' futures at once, so their `generate` calls raise `RequestAbortedError`,
and counts them at once with the tokens they did not generate (`engines/aborts.py`); a `generate` call
cancelled by its caller leaves its future cancelled and is counted when dropped. Either way the serving
loop takes the request out of the queue or the running batch before its next step (`_drop_abandoned`):
it gets no further token and its cache row is freed.
"""

from __future__ import annotations

import asyncio

from polyrl_runtime.engines.aborts import Aborts
from polyrl_runtime.engines.full_snapshots import FullSnapshots
from polyrl_runtime.engines.torch_request import TorchRequest


class TorchEngineAborts:
    """`abort` over the engine's state, which `TorchEngine.__init__` sets."""

    name: str
    _aborts: Aborts
    _by_id: dict[str, TorchRequest]  # request id -> its request, while `generate` waits for it
    _pending: list[TorchRequest]
    _active: list[TorchRequest]
    _held: list[TorchRequest]
    full_snapshots: FullSnapshots | None  # a past version's requests run on its serving copies

    def _ensure_loop(self) -> asyncio.Event:
        raise NotImplementedError  # the engine's serving loop

    def _retire(self, r: TorchRequest) -> None:
        raise NotImplementedError  # the engine's: frees the request's cache row

    async def abort(self, request_ids: list[str]) -> None:
        """`Engine.abort`: the requests' `generate` calls raise at once; the serving loop drops them
        (and counts them) before its next step."""
        for rid in request_ids:
            r = self._by_id.get(rid)
            if r is None:
                full = self.full_snapshots
                if full is not None and await full.abort(rid):
                    continue
                if rid:
                    self._aborts.unmatched(rid)
            elif not r.future.done():  # counted now, so the engine's stats show it once this returns
                r.future.set_exception(self._aborts.stopped(r.params, len(r.tokens)))
                r.counted = True
        self._ensure_loop().set()

    def _drop_abandoned(self) -> None:
        """Take the requests whose caller aborted or cancelled them (their future is done before they
        finished) out of the queues and the batch, freeing their cache rows; count each with the
        tokens it did not generate. Runs between steps only: a step in a thread uses the batch."""
        for queue in (self._pending, self._held):
            if any(r.future.done() for r in queue):
                for r in queue:
                    if r.future.done() and not r.counted:
                        self._aborts.stopped(r.params, len(r.tokens))
                queue[:] = [r for r in queue if not r.future.done()]
        for r in [r for r in self._active if r.future.done()]:
            if not r.counted:
                self._aborts.stopped(r.params, len(r.tokens))
            self._retire(r)
