"""Wire formats of the buffer actor's batched calls: a put of finished episodes, a batch of tickets.

Ray serialises call arguments and results with cloudpickle, which runs a Python hook for every object
that is not a builtin scalar or container. A 32-episode put as a list of `(Ticket, Episode)` pairs cost
0.52 ms to serialise on this machine, one numpy array of the same bytes 0.015 ms. These list subclasses
behave as the lists they are, and pickle as builtin lists plus one flat array for the whole batch.
"""

from __future__ import annotations

from typing import Any

from polyrl_runtime.experience.columns import PackedEpisodes
from polyrl_runtime.experience.types import Episode, Ticket


class EpisodeBatch(list[tuple[Ticket, Episode]]):
    """Finished episodes with the tickets they were played under: what a workflow worker puts.

    It arrives as a `PackedEpisodes` (a sequence of the same pairs), which the buffer keeps in the
    columns it arrived in instead of rebuilding an object per turn."""

    def __reduce__(self) -> Any:
        return PackedEpisodes.pack(self).__reduce__()


class TicketBatch(list[Ticket]):
    """Tickets as the buffer hands them out (one call, many tickets)."""

    def __reduce__(self) -> Any:
        return _rebuild_tickets, ([t.ticket_id for t in self], [t.policies for t in self])


def _rebuild_tickets(ticket_ids: list[int], policies: list[frozenset[str]]) -> TicketBatch:
    return TicketBatch(Ticket(i, p) for i, p in zip(ticket_ids, policies, strict=True))
