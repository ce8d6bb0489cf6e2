"""What a workflow raises when its episode failed because of what a policy did, not because of the
workflow or the machinery: output it cannot use (a reply with no move it can read, a tool call it
cannot parse after the workflow's own retries), a loop it had to stop.

    raise PolicyFailure("the solver's reply has no answer tag")

Such an episode, like one that ran past `workflow.episodeTimeoutSeconds`, is trained on, not
dropped: each agent that took a turn gets `workflow.failureReward` (default: the lowest reward of
that agent among its group's finished episodes), so a policy that learns to hang or to emit
malformed output is penalised instead of never being seen. The failure is counted by its reason
(`policy_failure`, `timeout`). Any other exception is the workflow's (`workflow_error`): the episode
is dropped and played again.
"""

from __future__ import annotations


class PolicyFailure(Exception):
    """An episode failed because of a policy's behaviour; the message says what it did."""
