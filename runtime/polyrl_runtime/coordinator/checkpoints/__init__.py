"""Checkpoints: the store (store.py: `step-N/` directories, `state.json` last, pruning, the root a
job's `checkpoint.uri` names) and the driver's `Checkpointer` (checkpointer.py: periodic, requested
and final checkpoints, Hugging Face exports).

Two modules because the store is read before the driver's modules load (`polyrl run` checks the
checkpoint to resume from before Ray starts, without torch); the checkpointer needs the driver's
state and the trainers' export, which import torch."""
