"""Lossless experience streaming: typed episodes -> per-policy buffers -> trainers' micro-batches."""

from polyrl_runtime.experience.batches import SampleBatch
from polyrl_runtime.experience.buffer import (
    BufferSnapshot,
    DropReason,
    ExperienceBuffer,
    Lease,
    PolicyConfig,
    PolicyStats,
    UnknownLeaseError,
    UnknownTicketError,
)
from polyrl_runtime.experience.types import Episode, Sample, Ticket, Turn

__all__ = [
    "BufferSnapshot",
    "DropReason",
    "Episode",
    "ExperienceBuffer",
    "Lease",
    "PolicyConfig",
    "PolicyStats",
    "Sample",
    "SampleBatch",
    "Ticket",
    "Turn",
    "UnknownLeaseError",
    "UnknownTicketError",
]
