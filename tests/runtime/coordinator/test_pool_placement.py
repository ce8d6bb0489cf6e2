"""A colocated policy (rollout and trainer on one pool) is placed by the pool pods' resources: its
trainer ranks on the pool's first pod (replicas.min 1), one engine on each of the pool's two pods, so
an engine and the trainer share pod 0. A real two-node Ray cluster, in a subprocess of its own (the
session's Ray is one node without placement resources)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from driver_harness import BASE, policy

HERE = Path(__file__).parent


@pytest.mark.ray
@pytest.mark.slow
def test_a_colocated_policys_engine_and_trainer_share_the_pools_first_pod(tmp_path: Path) -> None:
    p = policy("agent")
    p["rollout"] = {"engine": "torch", "pool": "shared"}
    p["trainer"] = {"backend": "deepspeed", "zeroStage": 1, "pool": "shared", "ranksPerPod": 2}
    doc = {**BASE, "spec": {**BASE["spec"], "policies": [p]}}
    doc["spec"]["pools"] = [{"name": "shared", "replicas": {"min": 1, "max": 2}, "gpus": 0}]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    r = subprocess.run(
        [sys.executable, str(HERE / "pool_cluster.py"), str(job)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    placed = json.loads(r.stdout.strip().splitlines()[-1])
    first, second = placed["pods"]
    assert placed["ranks"] == [first, first]  # ranksPerPod 2 on the first replicas.min pod
    assert sorted(placed["engines"]) == sorted([first, second])  # one engine per pool pod
