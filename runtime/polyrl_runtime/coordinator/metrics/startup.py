"""How long each start-up phase of a run took (`StartupPhases`), for the summary and /progress."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# The start-up phases, in the order they run, and the words the summary prints for each.
STARTUP_PHASES: dict[str, str] = {
    "ray": "ray",
    "actors": "actors",
    "model_load": "model load",
    "trainer_init": "trainer init",
    "first_weights": "first weights",
    "eval_before_training": "first eval",
}


@dataclass
class StartupPhases:
    """How long each start-up phase of a run took, in seconds. The phases follow one another (each
    ends before the next begins), so together they are the start-up's wall time, bar reading the
    job, its workflow and its data before them:

    - ray: starting the local Ray cluster (`polyrl run`; a pod's command starts the pod's Ray);
    - actors: starting every actor's process (engines, trainer ranks, workflow workers, the
      experience buffer) until the trainer ranks and the buffer have imported their code and answered;
    - model_load: the rollout engines loading their models and the workflow workers each policy's
      tokenizer, as they start (with the other actors: this is what is left once those answered);
    - trainer_init: the trainer ranks joining their process group and building their model,
      reference model and DeepSpeed engine (and loading the checkpoint, on a resume);
    - first_weights: publishing each policy's starting weights to its engines;
    - eval_before_training: the eval pass of the initial weights (`evaluation.beforeTraining`; not
      on a resume, nor for a job without evaluation).
    """

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Time `phase` (also when it fails: the summary of a failed start shows where it stopped)."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.monotonic() - start

    def describe(self) -> str:
        """The phases as the summary prints them: `ray 2.1s, actors 6.0s, ...`."""
        return ", ".join(f"{STARTUP_PHASES.get(p, p)} {s:.1f}s" for p, s in self.seconds.items())
