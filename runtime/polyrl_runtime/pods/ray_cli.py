"""`ray start` for a pod's Ray node, without the command groups of Ray's CLI that a pod never runs.

Ray's CLI (`ray.scripts.scripts`) registers `ray serve`, `ray job` and `ray list|get|summary|logs`
by importing Ray Serve, the job CLI and the state API, each inside a `try` that leaves its group
out when the import fails. Without them the CLI starts on about 0.45 s of CPU instead of 1.7 s
(`start --help`, Ray 2.60, 2 cores), which every pod's node pays before it starts its raylet. A pod runs only
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
