"""A workflow worker actor's client: one method per remote method the driver calls, each returning the
call's `ObjectRef` (see polyrl_runtime/actors.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import ray

from polyrl_runtime.actors import ActorClient, call
from polyrl_runtime.data.row import RowRef
from polyrl_runtime.engines.client import EngineClient
from polyrl_runtime.workflows.crossplay import CrossPlayGame, CrossPlayResult
from polyrl_runtime.workflows.opponents import OpponentTable
from polyrl_runtime.workflows.runner import EpisodeGroup, GroupReport, WorkerStats, WorkflowWorker


class WorkflowWorkerClient(ActorClient[WorkflowWorker]):
    """Calls to one `WorkflowWorker` actor (its methods document what each does)."""

    def run_groups(self, groups: Sequence[EpisodeGroup]) -> ray.ObjectRef[list[GroupReport | str]]:
        return call(self.handle, WorkflowWorker.run_groups, groups)

    def evaluate(
        self, eval_id: str, seed: int, row: RowRef, k: int, greedy: bool
    ) -> ray.ObjectRef[list[dict[str, float] | str]]:
        return call(self.handle, WorkflowWorker.evaluate, eval_id, seed, row, k, greedy)

    def cross_play(
        self, play_id: str, seed: int, rows: Sequence[RowRef | None], greedy: bool, game: CrossPlayGame
    ) -> ray.ObjectRef[list[CrossPlayResult | str]]:
        return call(self.handle, WorkflowWorker.cross_play, play_id, seed, rows, greedy, game)

    def set_routes(self, routes: Mapping[str, Mapping[str, EngineClient]], epoch: int) -> ray.ObjectRef[None]:
        return call(self.handle, WorkflowWorker.set_routes, routes, epoch)

    def set_opponents(self, tables: Mapping[str, OpponentTable]) -> ray.ObjectRef[None]:
        return call(self.handle, WorkflowWorker.set_opponents, tables)

    def stats(self) -> ray.ObjectRef[WorkerStats]:
        return call(self.handle, WorkflowWorker.stats)
