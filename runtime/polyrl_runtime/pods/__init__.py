"""What the operator's pods run: the `polyrl-runtime coordinator|worker` entry points (entry.py),
the pod's Ray node (ray_node.py) and what a pod waits for while its Ray cluster forms
(cluster_waits.py)."""
