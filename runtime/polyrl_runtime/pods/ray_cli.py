"""`ray start` for a pod's Ray node, without the command groups of Ray's CLI that a pod never runs.

Ray's CLI (`ray.scripts.scripts`) registers `ray serve`, `ray job` and `ray list|get|summary|logs`
by importing Ray Serve, the job CLI and the state API, each inside a `try` that leaves its group
out when the import fails. Those imports are about 0.9 s of the 1.3 s of CPU the CLI takes to start
(Ray 2.60, 2 cores), paid by every pod's node before it starts its raylet. A pod runs only
`ray start`, whose code is the CLI's own here: `python -m polyrl_runtime.pods.ray_cli start ...`
takes the arguments of `ray start`.
"""

from __future__ import annotations

from typing import Any

from polyrl_runtime.imports import skipped_imports

# The optional command groups' modules (ray.scripts.scripts imports each in a try/except).
UNUSED_COMMAND_GROUPS = ("ray.serve.scripts", "ray.dashboard.modules.job.cli", "ray.util.state.state_cli")


def load_cli() -> Any:
    """Ray's click group, without the groups in `UNUSED_COMMAND_GROUPS`."""
    with skipped_imports(UNUSED_COMMAND_GROUPS):
        from ray.scripts.scripts import cli
    return cli


def main() -> None:
    load_cli()(prog_name="ray")


if __name__ == "__main__":
    main()
