"""The reconcile loop, by part (an import-linter contract keeps the layers):

* ``queue``: the work queue; kicks coalesce, one run per job at a time, a kick during a run makes
  exactly one more;
* ``observe``: the gathering of one job's observations (the RLJob, its children through the
  indexes, the coordinator's report, Kueue admission and priority) into one ``Observation``;
* ``events``: the event recorder (Kubernetes Events, deduplicated);
* ``job``: one job's reconcile, observe -> plan -> write status -> apply;
* ``reconciler``: the four wired together behind ``kick``, with retries and metrics.
"""

from polyrl_operator.reconciling.reconciler import Reconciler

__all__ = ["Reconciler"]
