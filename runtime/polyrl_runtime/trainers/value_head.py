"""The value head of PPO's critic (trainers/critic.py, trainers/value_adapter.py): hidden -> 1 on a
backbone's final hidden states, and the value before each response token."""

from __future__ import annotations

import torch

from polyrl_runtime.algorithms.losses import _hidden_states
from polyrl_runtime.models.tiny import TinyCausalLM


def hidden_size(backbone: torch.nn.Module) -> int:
    """The width of the backbone's final hidden states (from its config: under ZeRO-3 a parameter's
    own shape is that of an empty shard)."""
    if isinstance(backbone, TinyCausalLM):
        return backbone.cfg.d_model
    size = getattr(getattr(backbone, "config", None), "hidden_size", None)
    if not isinstance(size, int):
        raise ValueError(
            f"{type(backbone).__name__} has no config.hidden_size: cannot put a value head on it"
        )
    return size


class ValueHead(torch.nn.Module):
    """hidden -> 1, weight and bias 0. Its parameters are created as zeros (not zeroed after): a
    module built inside `deepspeed.zero.Init` is partitioned as its constructor returns."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.weight, self.bias)[..., 0]


def head_values(
    backbone: torch.nn.Module,
    head: ValueHead,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    gather_index: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """[B, R] the value before each response token (0 where not trained): the head's output at the
    hidden state that predicts the token (`TokenBatch.gather_index`), in float32."""
    hidden = _hidden_states(backbone, ids, mask)  # [B, T, H]
    index = gather_index[..., None].expand(-1, -1, hidden.shape[-1])
    values = head(hidden.gather(1, index).to(head.weight.dtype)).float()  # [B, R]
    return torch.where(response_mask > 0, values, torch.zeros_like(values))
