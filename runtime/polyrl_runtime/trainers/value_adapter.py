"""PPO's value model for a LoRA policy (`algorithm.critic` with `algorithm.lora`): a second LoRA
adapter on the policy's own base, with the value head on its final hidden states. The base is held
once, by the policy's trainer (its DeepSpeed engine's module, or the shared base of
`spec.sharedBases`), so a critic costs an adapter, a head and their optimizer state, not a second
model.

The value adapter is named `<policy>_value`: a policy's name is a DNS label, so no policy's adapter
has that name. It takes the policy's LoRA settings (rank, alpha, dropout, target modules); its B
matrices start at 0 and the head at 0, so every first value is 0, as a full critic's.

peft computes with one adapter at a time, and only the active one requires grad. Autograd
accumulates into a parameter only if it requires grad when the backward reaches it, and gradient
checkpointing recomputes the forward under whichever adapter is active then, so the value adapter is
active from each forward of the values through its backward (`ValueAdapterEngine.active`) and the
adapter active before it (the policy's) is restored after. Outside `active()` nothing sees the value
adapter: serving and publishing merge, export and the policy's DeepSpeed checkpoint save only the
active adapter's parameters, and they run outside it.

The adapter and head train by plain torch (`FlatGradEngine`: gradients averaged over the policy's
ranks, clipped to `algorithm.maxGradNorm`, a non-finite step skipped and counted), at `critic.lr`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import structlog
import torch

from polyrl_operator.api import Policy
from polyrl_runtime.trainers.flat_engine import FlatGradEngine
from polyrl_runtime.trainers.lora import LoraError, add_lora, base_model, is_peft
from polyrl_runtime.trainers.value_head import ValueHead, head_values, hidden_size

log = structlog.get_logger(__name__)

VALUE_ADAPTER_SUFFIX = "_value"
HEAD = "value_head"  # the head's parameters' prefix in the checkpoint


def value_adapter_name(policy: str) -> str:
    return f"{policy}{VALUE_ADAPTER_SUFFIX}"


class ValueAdapterEngine(FlatGradEngine):
    """The value adapter and head of a LoRA policy on its trainer's peft `model` (see the module
    docstring). Its `module` is the head: the adapter's parameters belong to `model`, whose owner
    offloads them with the base."""

    def __init__(
        self,
        model: torch.nn.Module,
        policy: Policy,
        *,
        seed: int,
        device: torch.device,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        spec = policy.algorithm.critic
        if spec is None or policy.algorithm.lora is None:
            raise ValueError(
                f"policy {policy.name}: a value adapter needs algorithm.critic and algorithm.lora"
            )
        if not is_peft(model):
            raise LoraError(f"policy {policy.name}: a value adapter needs the policy's peft model")
        peft_model: Any = model
        name = value_adapter_name(policy.name)
        before = peft_model.active_adapter
        # Every rank initialises the adapter alike (peft draws its A matrices from torch's generator).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            add_lora(model, policy, adapter_name=name)
        peft_model.set_adapter(before)
        marker = f".{name}."
        adapter = [(n, p) for n, p in model.named_parameters() if ".lora_" in n and marker in n]
        head = ValueHead(hidden_size(base_model(model)), torch.float32).to(device)
        named = [*adapter, *((f"{HEAD}.{n}", p) for n, p in head.named_parameters())]
        super().__init__(
            policy.name,
            named,
            lr=spec.lr,
            max_grad_norm=policy.algorithm.max_grad_norm,
            micro_batch_size=policy.trainer.micro_batch_size,
            rank=rank,
            world=world,
        )
        self.adapter = name
        self.module = head  # registered: what offload and `Critic.device` see
        self._model = (model,)  # not registered: the policy's model is its owner's
        log.info(
            "critic.value_adapter",
            policy=policy.name,
            adapter=name,
            trainable=sum(p.numel() for p in self.params),
        )

    @property
    def model(self) -> torch.nn.Module:
        return self._model[0]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within this context the model computes with the value adapter, and only it trains."""
        peft_model: Any = self.model
        before = peft_model.active_adapter
        peft_model.set_adapter(self.adapter)
        try:
            yield
        finally:
            peft_model.set_adapter(before)

    def forward(
        self, ids: torch.Tensor, mask: torch.Tensor, gather_index: torch.Tensor, response_mask: torch.Tensor
    ) -> torch.Tensor:
        """[B, R] the value before each response token; call it inside `active()`."""
        head: Any = self.module
        return head_values(
            self.model, head, ids, mask, gather_index=gather_index, response_mask=response_mask
        )
