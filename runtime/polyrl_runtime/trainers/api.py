"""What the driver calls on a policy's trainer ranks (Ray actors), whatever the backend."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from polyrl_runtime.weights.api import WeightManifest


@dataclass
class StepResult:
    """One rank's part of one training step (epochs x miniBatches optimizer steps: by default one, or
    one per micro-batch under ppo)."""

    rank: int
    lease_id: int | None
    samples: int
    tokens: int
    loss: float
    clip_frac: float = 0.0
    is_weight_mean: float = 1.0
    is_truncated_frac: float = 0.0
    is_masked_frac: float = 0.0  # trained tokens a mask isCorrection rejected
    # algorithm.distillation: the mean over trained tokens of log student - log teacher
    distill_kl: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0  # mean per-token entropy (computed only when algorithm.entropyCoef > 0)
    # algorithm.critic: this rank's share of the mean value loss of the critic's optimizer steps, and
    # the fraction of its trained tokens whose clipped value term was the larger.
    value_loss: float = 0.0
    value_clip_frac: float = 0.0
    staleness_mean: float = 0.0
    staleness_max: int = 0
    signal_mean: float = 0.0
    # The norm of the last optimizer step's gradient: NaN or inf when that step was skipped.
    grad_norm: float = 0.0
    # Optimizer steps of this training step skipped for a non-finite loss or gradient (every rank
    # counts the same: they decide together, trainers/nonfinite.py).
    skipped_nonfinite: int = 0
    lr: float = 0.0  # the learning rate of every optimizer step of this training step
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OffloadReport:
    """What one rank's `offload` or `restore` did: the seconds it took and the bytes it moved
    between its device and host memory (on a CPU rank, between the original storages and their host
    copies)."""

    rank: int
    direction: Literal["offload", "restore"]
    seconds: float
    moved_bytes: int


def node_local_ranks(nodes: Sequence[str]) -> list[int]:
    """Each rank's index among the ranks on its node, in rank order (`nodes[i]`: rank i's node).
    Ray places ranks by their pods' trainer units, not in `rank_layout`'s order, so a rank's
    node-local index is known only once every rank is placed."""
    seen: Counter[str] = Counter()
    out: list[int] = []
    for node in nodes:
        out.append(seen[node])
        seen[node] += 1
    return out


def protocol_methods(protocol: type) -> list[str]:
    """The methods a Protocol declares (what the coordinator calls on an actor of that role)."""
    return sorted(n for n, v in vars(protocol).items() if not n.startswith("_") and callable(v))


# Calls a trainer rank runs at once: a weight sync's wait or abort may arrive while a step or a
# publish runs (its own actor's `max_concurrency`, a `ColocatedRank`'s trainer threads).
RANK_CONCURRENCY = 2


class TrainerRank(Protocol):
    """One rank of a policy's trainer, as the driver calls it through `trainers.client.TrainerRankClient`
    (a trainer class is started as an `ActorHandle[TrainerRank]`, which checks that it implements this)."""

    def address(self) -> tuple[str, int]:
        """Where rank 0 takes the process group's rendezvous (its host and a free port)."""
        ...

    def node_id(self) -> str:
        """The Ray node (pod) this rank runs on: the ranks' node-local indices come from these."""
        ...

    def setup(self, master_addr: str, master_port: int, local_rank: int) -> None:
        """Join the process group, then build the model and its optimizer (every rank at once).
        `local_rank`: this rank's index among its policy's ranks on its node (its GPU where it sees
        all of the pod's: `trainers.build.cuda_device_index`)."""
        ...

    def train_step(
        self, step: int, share: int, n_micro: int, global_std: float | None, version: int | None = None
    ) -> StepResult:
        """Pull `share` samples from the buffer under a lease and take training step `step`, which
        publishes weight `version` (None: `step`)."""
        ...

    def gather_for_peers(self) -> None:
        """ZeRO-3, ranks > 0: take part in the gathers rank 0 makes to publish its weights."""
        ...

    def save(self, directory: str, tag: str) -> None: ...

    def load(self, directory: str, tag: str) -> None: ...

    def export(self, directory: str) -> None:
        """Write the policy as a Hugging Face model directory (every rank at once; rank 0 writes)."""
        ...

    def offload(self) -> OffloadReport:
        """Move the rank's parameters, gradients, optimizer state and reference model to host memory
        and free them on its device (a device pool's other roles use it meanwhile). Until `restore`,
        every call that needs them fails with `TrainerOffloadedError`; offloading twice is an error."""
        ...

    def restore(self) -> OffloadReport:
        """Bring back exactly what `offload` moved: the next step computes what it would have without
        the round trip."""
        ...

    # Rank 0's end of the weight sync (weights/sides.py `TrainerWeights`).
    def init_sender(
        self, transport: str, bucket_bytes: int, transport_kwargs: Mapping[str, object]
    ) -> None: ...

    def publish_weights(self, version: int) -> WeightManifest: ...

    def resend_weights(self) -> WeightManifest | None: ...

    def set_weight_receivers(self, n: int) -> None: ...

    def wait_weights(self) -> None: ...

    def abort_weights(self) -> None: ...
