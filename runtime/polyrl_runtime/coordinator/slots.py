"""One engine or workflow worker as the coordinator tracks it: its client, its policy (or the
policies of a shared base), its pod, load and drain state. The fleet makes slots; the supervisor,
the producer, the training loops and the reports read them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from polyrl_runtime.engines.client import EngineClient
from polyrl_runtime.workflows.client import WorkflowWorkerClient

# The client of a slot's actor. Covariant: an engine's or a worker's slot is a `Slot[Actor]`, what the
# code that handles both (health, drain, reports) takes.
C_co = TypeVar("C_co", covariant=True)


@dataclass
class Slot(Generic[C_co]):
    """One engine or workflow worker as the coordinator tracks it (`actor`: the client it is called by)."""

    name: str
    actor: C_co
    policy: str = ""
    # An engine serving several policies as LoRA adapters on one base (`RLJobSpec.shared_bases`): all
    # of them, `policy` the first; the slot is listed under each. Empty: `policy`'s alone.
    shared_by: tuple[str, ...] = ()
    pod: str = ""
    draining: bool = False
    dead: bool = False
    in_flight: int = 0
    queued: int = 0
    version: int = -1
    utilisation: float = 0.0
    started: float = field(default_factory=time.monotonic)
    _busy: float = 0.0
    _at: float = field(default_factory=time.monotonic)

    # Engines only. `fence`: the first routing epoch without this engine since its drain began.
    # `quiet`: every live worker holds routes at least that new and waits on no request to it. Its
    # own in-flight count alone is not enough: a request a worker has sent may still be on its way.
    fence: int | None = None
    quiet: bool = False
    # Requests the engine stopped because their episode timed out or was cancelled, and the tokens
    # they did not generate (EngineStats.aborted, .freed_tokens: since the engine started).
    aborted: int = 0
    freed_tokens: int = 0

    @property
    def drained(self) -> bool:
        engine_done = self.quiet or not self.policy  # workflow workers get no routes
        return self.draining and self.in_flight == 0 and engine_done

    def observe(self, busy_s: float, in_flight: int) -> None:
        now = time.monotonic()
        if now > self._at:
            self.utilisation = min(1.0, max(0.0, (busy_s - self._busy) / (now - self._at)))
        self._busy, self._at, self.in_flight = busy_s, now, in_flight


EngineSlot = Slot[EngineClient]
WorkerSlot = Slot[WorkflowWorkerClient]
