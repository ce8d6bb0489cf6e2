"""Run as a script (test_pool_placement.py): the fleet of a job's first policy on a Ray cluster of two
nodes on this machine, standing in for pods 0 and 1 of pool `shared`, each offering exactly what
`polyrl-runtime worker --role pool` offers there (`node_resources`). Prints, as JSON, the two nodes and
the node each engine and trainer rank was placed on."""

from __future__ import annotations

import json
import sys
from typing import Any

import ray
from ray.cluster_utils import Cluster

from polyrl_runtime.config import load_job, node_resources
from polyrl_runtime.coordinator.fleet import Fleet


def _node(_actor: Any) -> str:
    return str(ray.get_runtime_context().get_node_id())


def main(job_file: str) -> None:
    job = load_job(job_file)
    head = {"num_cpus": 1, "resources": node_resources(job, "pool", None, "shared", 0)}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    second = cluster.add_node(num_cpus=1, resources=node_resources(job, "pool", None, "shared", 1))
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    fleet = Fleet(job, "objectstore")
    try:
        policy = job.spec.policies[0]
        engines = [fleet.new_engine(policy).actor for _ in range(2)]
        ranks = fleet.new_trainers(policy, None)
        placed = {
            "pods": [cluster.head_node.node_id, second.node_id],
            "engines": ray.get([e.handle.__ray_call__.remote(_node) for e in engines], timeout=300),
            "ranks": ray.get([r.node_id() for r in ranks], timeout=300),
        }
        sys.stdout.write(json.dumps(placed) + "\n")
    finally:
        fleet.close()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
