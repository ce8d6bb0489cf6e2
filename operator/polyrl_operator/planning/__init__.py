"""The operator's plan: pure functions from an RLJob and what is observed to values.

Layers, bottom to top (an import-linter contract keeps them so):

* ``types``: the frozen values (Plan, PodPlan, Actions, JobMemory, StatusInputs);
* ``conditions``: metav1 conditions and the time and message helpers;
* ``lifecycle``: finished, restart, admission, deadline, TTL decisions;
* ``pods``: which pods exist, scale, drain, and the checkpoint-first stop;
* ``status``: the typed RLJobStatus of an invalid, finished or live job, and the events its changes
  mark;
* ``quota``: what a quota refusal reported by apply leaves for the next plan (memory, event, backoff);
* ``plan``: composes them into one Plan; ``render`` prints a plan's manifests.
"""

from polyrl_operator.planning.plan import plan, stored_status
from polyrl_operator.planning.render import render
from polyrl_operator.planning.status import active_status
from polyrl_operator.planning.types import Event, JobMemory, Plan, QuotaRefusal

__all__ = ["Event", "JobMemory", "Plan", "QuotaRefusal", "active_status", "plan", "render", "stored_status"]
