"""The train data feed: which row of `spec.data.train` each episode group plays, in what order, and
where the job stands in the data (part of every checkpoint).

Order: epoch e plays the rows in a permutation drawn from (seed, e) when `shuffle`, else in file
order; `epochs` epochs (unset: as many as `totalSteps` needs). A row goes to one group (every member
plays it) when the group is dispatched, and is settled when the group's results come back, whatever
they are (failed episodes are counted drops, not replayed: a bad row must not loop). A group that
never ran (its worker call failed) gives its row back, to be played first.

Resume without repeats or gaps: the checkpoint keeps (epoch, offset in that epoch's order) and the
rows handed out but not settled, minus those whose group already has samples in the checkpoint's
buffer snapshot (they will be trained from it: `buffered_groups`). The resumed feed plays those pending rows first,
then goes on from (epoch, offset).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import structlog

from polyrl_operator.api.spec import RLJobSpec
from polyrl_runtime.data import DataError, load_rows
from polyrl_runtime.data.row import RowRef
from polyrl_runtime.experience.state import BufferSnapshot

log = structlog.get_logger(__name__)


def buffered_groups(snapshot: BufferSnapshot | None) -> frozenset[str]:
    """The episode groups with samples in a buffer snapshot (episode ids are `<group>-<index>`)."""
    if snapshot is None:
        return frozenset()
    return frozenset(
        s.episode_id.rpartition("-")[0] for samples in snapshot.samples.values() for s in samples
    )


class DataFeed:
    def __init__(
        self, source: str, rows: Sequence[Mapping[str, Any]], *, seed: int, shuffle: bool, epochs: int | None
    ) -> None:
        self.source, self.rows, self.seed, self.shuffle, self.epochs = source, rows, seed, shuffle, epochs
        self.epoch, self.offset = 0, 0
        self._order = self._epoch_order(0)
        self._returned: deque[int] = deque()  # rows to play before (epoch, offset): given back, resumed
        self.in_flight: dict[str, int] = {}  # group id -> row index, in dispatch order

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    @property
    def exhausted(self) -> bool:
        """No row is left to hand out (every epoch played); groups may still be in flight."""
        return not self._returned and self.epochs is not None and self.epoch >= self.epochs

    @property
    def finished(self) -> bool:
        """Exhausted and every group settled: no more experience can come from the data."""
        return self.exhausted and not self.in_flight

    def take(self, group_id: str) -> RowRef | None:
        """The row `group_id` plays, or None when the data is exhausted."""
        if self._returned:
            index = self._returned.popleft()
        elif self.exhausted:
            return None
        else:
            index = self._order[self.offset]
            self.offset += 1
            if self.offset == len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
        self.in_flight[group_id] = index
        return RowRef(self.source, index, self.rows[index])

    def settle(self, group_id: str) -> None:
        """The group played its row (whatever its episodes' outcome)."""
        self.in_flight.pop(group_id, None)

    def give_back(self, group_id: str) -> None:
        """The group never ran: its row is played next."""
        index = self.in_flight.pop(group_id, None)
        if index is not None:
            self._returned.appendleft(index)

    # -- checkpoints -----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The position in the data. Taken just before the checkpoint's buffer snapshot is requested:
        a group dispatched later cannot have samples in that snapshot (it must first get tickets from
        the same buffer, then play its episodes)."""
        return {
            "source": self.source,
            "rows": len(self.rows),
            "epoch": self.epoch,
            "offset": self.offset,
            "returned": list(self._returned),
            "in_flight": [[g, i] for g, i in self.in_flight.items()],
        }

    def restore(self, state: Mapping[str, Any], buffered: Iterable[str] = ()) -> None:
        """Continue from a checkpoint's position; the rows of groups in flight then are played first,
        except those of `buffered` groups (samples in the checkpoint's buffer snapshot). Other data
        (another source or row count) starts from its beginning: the old position means nothing."""
        if state.get("source") != self.source or int(state.get("rows", -1)) != len(self.rows):
            log.warning("data.position_reset", source=self.source, checkpoint_source=state.get("source"))
            return
        have = set(buffered)
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._epoch_order(self.epoch)
        pending = [int(i) for g, i in state.get("in_flight", []) if g not in have]
        self._returned = deque([*(int(i) for i in state.get("returned", [])), *pending])
        self.in_flight = {}

    def end_message(self, steps: Mapping[str, int]) -> str:
        at = ", ".join(f"{n} at step {s}" for n, s in steps.items())
        return f"train data exhausted: {self.epochs} epoch(s) of {self.source} played ({at})"


def open_train_feed(spec: RLJobSpec) -> DataFeed | None:
    """The feed of `spec.data.train` (None for a job without data). A file that cannot be read is a
    DataError naming the field and the URI: the job fails before any training."""
    if spec.data is None:
        return None
    uri = spec.data.train
    try:
        rows = load_rows(uri)
    except DataError as e:
        raise DataError(f"spec.data.train: {e}") from e
    log.info("data.loaded", source=uri, rows=len(rows), epochs=spec.data.epochs, shuffle=spec.data.shuffle)
    return DataFeed(uri, rows, seed=spec.training.seed, shuffle=spec.data.shuffle, epochs=spec.data.epochs)
