"""The `cudaipc` weight transport on a GPU: an engine in another process (spawned, as a colocated
engine's actor is) maps the trainer's tensors through CUDA IPC and copies them into its own, bit for
bit; a mismatched manifest or a version the trainer no longer holds leaves its tensors as they were.
An engine in the trainer's own process reads the trainer's tensors directly. Figures (test
properties, listed by hack/gpu/summary.py): bytes, GB/s and the engine's pause for about 1 GiB of
bf16 weights, cross-process.

The CPU side of the transport (what it refuses, the guard protocol) is tests/runtime/weights/
test_cudaipc.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from polyrl_runtime.weights import TensorTarget, WeightSyncError
from polyrl_runtime.weights.cudaipc import CudaIpcReceiver, CudaIpcSender
from polyrl_testenv.cudaipc_engine import EngineProcess, Outcome, Spec, digest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProcess]:
    process = EngineProcess()
    try:
        yield process
    finally:
        process.close()


class Trainer:
    """A trainer's weights as engines meet them: bf16 and fp32, odd shapes, two tensors that are views
    of one flat buffer (as DeepSpeed's are), one published transposed (not contiguous), a scalar and
    an empty one. `step` rewrites them in place, as an optimizer step does."""

    def __init__(self) -> None:
        self._g = torch.Generator().manual_seed(0)
        self.flat = torch.empty(4099, dtype=torch.bfloat16, device=GPU)
        self.wide = torch.empty(37, 129, device=GPU)
        self.embed = torch.empty(1000, 257, dtype=torch.bfloat16, device=GPU)
        self.norm = torch.empty(257, device=GPU)
        self.scale = torch.empty((), device=GPU)
        self.empty = torch.empty(0, 4, dtype=torch.bfloat16, device=GPU)
        self.step()

    def step(self) -> None:
        for t in (self.flat, self.wide, self.embed, self.norm, self.scale):
            t.copy_(torch.randn(t.shape, generator=self._g).to(t.dtype))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "flat.a": self.flat[:300].view(20, 15),
            "flat.b": self.flat[300:1001],  # starts 600 bytes into the shared buffer
            "wide.t": self.wide.t(),
            "embed": self.embed,
            "norm": self.norm,
            "scale": self.scale,
            "empty": self.empty,
        }

    def spec(self) -> Spec:
        return [(name, tuple(t.shape), t.dtype) for name, t in self.tensors().items()]

    def digests(self) -> dict[str, str]:
        return {name: digest(t) for name, t in self.tensors().items()}


def _ok(outcome: Outcome) -> Outcome:
    assert not outcome.error, outcome.error
    return outcome


def test_an_engine_process_receives_versions_bit_exact_or_nothing(engine: EngineProcess) -> None:
    trainer = Trainer()
    sender = CudaIpcSender("alice", 1 << 12)  # small buckets: tensors span and share them
    try:
        assert _ok(engine.target(trainer.spec())).version == -1
        for version in range(2):
            if version:
                sender.release_source()  # before the trainer's step, as TrainerWeights does
                trainer.step()
            got = _ok(engine.receive(sender.publish(version, trainer.tensors())))
            assert got.applied and got.version == version
            assert got.digests == trainer.digests()
        held = got

        # A manifest the engine's tensors do not match: rejected before anything moves.
        shapes_differ = {**trainer.tensors(), "norm": torch.zeros(258, device=GPU)}
        got = engine.receive(sender.publish(2, shapes_differ))
        assert got.error.startswith("WeightMismatchError") and "'norm'" in got.error
        assert (got.version, got.updates, got.digests) == (1, held.updates, held.digests)

        # A version the trainer's tensors no longer hold (its step began): refused before the pause.
        sender.release_source()
        trainer.step()
        stale = sender.publish(3, trainer.tensors())
        sender.release_source()
        got = engine.receive(stale)
        assert got.error.startswith("WeightSyncError") and "version 3 is no longer served" in got.error
        assert (got.version, got.updates, got.digests) == (1, held.updates, held.digests)

        got = _ok(engine.receive(sender.publish(4, trainer.tensors())))
        assert got.applied and got.version == 4 and got.digests == trainer.digests()
    finally:
        sender.close()


def test_an_engine_in_the_trainers_process_reads_its_tensors() -> None:
    # CUDA will not open an IPC handle in the process that made it: the receiver reads the sender's
    # tensors (the torch engine beside its trainer in one process).
    trainer = Trainer()
    sender = CudaIpcSender("alice", 1 << 12)
    receiver = CudaIpcReceiver()
    target = TensorTarget({n: torch.zeros(s, dtype=d, device=GPU) for n, s, d in trainer.spec()})
    try:
        for version in range(2):
            if version:
                sender.release_source()
                trainer.step()
            manifest = sender.publish(version, trainer.tensors())
            report = receiver.receive(manifest, target)
            assert report.applied and target.version == version
            got = {name: digest(t) for name, t in target.named_tensors().items()}
            assert got == trainer.digests()
        sender.release_source()
        late = TensorTarget({n: torch.zeros(s, dtype=d, device=GPU) for n, s, d in trainer.spec()})
        with pytest.raises(WeightSyncError, match="version 1 is no longer served"):
            receiver.receive(manifest, late)
        assert late.version == -1 and late.updates == 0
    finally:
        sender.close()
        receiver.close()


def test_throughput_of_a_gib_of_bf16(
    engine: EngineProcess, record_property: Callable[[str, object], None]
) -> None:
    g = torch.Generator(device=GPU).manual_seed(1)
    tensors = {
        f"layers.{i}.weight": torch.randn(4096, 2048, generator=g, device=GPU, dtype=torch.bfloat16)
        for i in range(64)
    }
    sender = CudaIpcSender("bench", 256 << 20)
    try:
        _ok(engine.target([(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]))
        _ok(engine.receive(sender.publish(0, tensors)))  # warm: the engine's first mappings
        sender.release_source()
        for t in tensors.values():
            t.add_(1)
        got = _ok(engine.receive(sender.publish(1, tensors)))
    finally:
        sender.close()
    assert got.applied and got.digests == {name: digest(t) for name, t in tensors.items()}
    assert got.nbytes == 64 * 4096 * 2048 * 2
    gbps = got.nbytes / got.wall_s / 1e9
    record_property("cudaipc_bytes", got.nbytes)
    record_property("cudaipc_gbps", round(gbps, 1))
    record_property("cudaipc_wall_s", round(got.wall_s, 4))
    record_property("cudaipc_pause_s", round(got.pause_s, 4))
    assert gbps > 5  # a bound far below device-to-device speed: the figure is the point
