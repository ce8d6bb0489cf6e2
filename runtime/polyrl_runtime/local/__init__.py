"""Local mode: `polyrl run job.yaml` on one machine (local Ray, CPU, tiny models)."""
