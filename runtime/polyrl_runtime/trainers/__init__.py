"""Trainer backends (DeepSpeed) behind `trainers.api`."""
