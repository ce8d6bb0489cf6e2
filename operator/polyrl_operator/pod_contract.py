"""The pod contract: the names and numbers shared by the pods the operator builds and the runtime
processes that run in them. docs/runtime-contract.md is its prose; this module is its one spelling.

What belongs here is everything that crosses that boundary: the environment variables the operator
sets on a pod's container (and the one the e2e tier's test kubelet adds, standing in for a node),
the ports the runtime listens on, the paths of the files mounted into the pod, and the annotations
the operator writes on a pod as requests to the runtime. The operator's builders write these names
only through this module and the runtime reads them only through it (tests/operator/test_pod_contract.py
checks both sides), so renaming one cannot leave the other side behind.

What stays out: settings that only the runtime reads and the operator never sets
(``POLYRL_LOG_FORMAT``, ``POLYRL_LOG_LEVEL``, ``POLYRL_JOIN_TIMEOUT_S``, ``POLYRL_START_TIMEOUT_S``,
``POLYRL_LOCK_TIMEOUT_S``, ``POLYRL_LINGER_S``, ``POLYRL_CACHE``, ``POLYRL_CPU_SET``, ...). They are
named where they are read; a role's ``env`` may set them like any other variable.

Plain constants with no imports beyond ``typing``: a pod's process writes its first log line (which
names the pod from this environment) before it imports pydantic, so this module sits outside the
``api`` package, whose ``__init__`` loads the models.
"""

from __future__ import annotations

from typing import Final

# The environment every job pod gets from the operator (builders/pods.py).
ENV_JOB: Final[str] = "POLYRL_JOB"
ENV_NAMESPACE: Final[str] = "POLYRL_NAMESPACE"
ENV_ROLE: Final[str] = "POLYRL_ROLE"
ENV_POLICY: Final[str] = "POLYRL_POLICY"
"""The policy name; empty for the roles that belong to the whole job and on pool pods."""
ENV_POOL: Final[str] = "POLYRL_POOL"
"""The device pool's name on a pool pod (role ``pool``, which hosts the roles placed on that pool);
absent on every other pod."""
ENV_INDEX: Final[str] = "POLYRL_INDEX"
"""The replica index (a trainer's rank among its policy's trainer pods)."""
ENV_ATTEMPT: Final[str] = "POLYRL_ATTEMPT"
"""The restart attempt (``status.restarts`` when the pod was created)."""
ENV_POD_NAME: Final[str] = "POLYRL_POD_NAME"
ENV_SERVICE: Final[str] = "POLYRL_SERVICE"
"""FQDN of the role's Service."""
ENV_COORDINATOR_ADDRESS: Final[str] = "POLYRL_COORDINATOR_ADDRESS"
"""``<host>:<PORT_RAY_GCS>`` of the coordinator's Ray head, the address every worker joins."""
ENV_CONFIG: Final[str] = "POLYRL_CONFIG"
"""Path of the RLJob the runtime parses (``CONFIG_PATH``)."""
ENV_PODINFO_DIR: Final[str] = "POLYRL_PODINFO_DIR"
ENV_HTTP_PORT: Final[str] = "POLYRL_HTTP_PORT"
ENV_PVC_MOUNTS: Final[str] = "POLYRL_PVC_MOUNTS"
"""JSON ``{claim: mount path}`` of the claims mounted in the pod; absent when none."""
ENV_CREDENTIALS_SECRET: Final[str] = "POLYRL_CREDENTIALS_SECRET"
"""Name of ``spec.storage.credentialsSecret`` (whose keys arrive as envFrom), for error messages."""
ENV_RAY_AUTH_MODE: Final[str] = "RAY_AUTH_MODE"
ENV_RAY_AUTH_TOKEN: Final[str] = "RAY_AUTH_TOKEN"
"""Ray's own token auth; the token comes from the job's Secret (never printed)."""
RAY_AUTH_MODE_TOKEN: Final[str] = "token"

SCRATCH_DIR: Final[str] = "/tmp"
"""The pod's writable scratch volume (the root filesystem is read-only)."""
SCRATCH_ENV: Final[tuple[tuple[str, str], ...]] = (
    ("TMPDIR", SCRATCH_DIR),
    ("XDG_CACHE_HOME", f"{SCRATCH_DIR}/.cache"),  # Hugging Face, vLLM, pip
    ("TRITON_CACHE_DIR", f"{SCRATCH_DIR}/.triton"),
    ("TORCH_EXTENSIONS_DIR", f"{SCRATCH_DIR}/torch_extensions"),  # torch's JIT-built extensions
)
"""Where the runtime's libraries write scratch and caches: the writable scratch volume."""

POD_ENV: Final[frozenset[str]] = frozenset(
    {
        ENV_JOB,
        ENV_NAMESPACE,
        ENV_ROLE,
        ENV_POLICY,
        ENV_POOL,
        ENV_INDEX,
        ENV_ATTEMPT,
        ENV_POD_NAME,
        ENV_SERVICE,
        ENV_COORDINATOR_ADDRESS,
        ENV_CONFIG,
        ENV_PODINFO_DIR,
        ENV_HTTP_PORT,
        ENV_PVC_MOUNTS,
        ENV_CREDENTIALS_SECRET,
        ENV_RAY_AUTH_MODE,
        ENV_RAY_AUTH_TOKEN,
        *(name for name, _ in SCRATCH_ENV),
    }
)
"""Every variable the operator may set on a job pod (before the role's own ``env``)."""

# The environment the e2e tier's test kubelet adds (tests/support/polyrl_testenv/kubelet.py).
ENV_NETMAP: Final[str] = "POLYRL_NETMAP"
"""Path of the JSON map of the ports and addresses of pods run as local processes; real pods never
have it (polyrl_runtime.netmap)."""

# Ports: every pod serves HTTP (/healthz; the coordinator also /progress); the coordinator runs the
# Ray head; trainer ranks of one policy rendezvous at rank 0.
PORT_HTTP: Final[int] = 8000
PORT_RAY_GCS: Final[int] = 6379
PORT_RAY_CLIENT: Final[int] = 10001
PORT_RAY_DASHBOARD: Final[int] = 8265
PORT_RENDEZVOUS: Final[int] = 29500

# Files mounted into every pod.
CONFIG_DIR: Final[str] = "/etc/polyrl/config"
CONFIG_FILE: Final[str] = "rljob.json"
"""The RLJob's file in ``CONFIG_DIR`` (and its key in the job's ConfigMap)."""
CONFIG_PATH: Final[str] = f"{CONFIG_DIR}/{CONFIG_FILE}"
PODINFO_DIR: Final[str] = "/etc/polyrl/podinfo"
"""The downward-API volume: the pod's ``labels`` and ``annotations`` files."""
PODINFO_LABELS: Final[str] = "labels"
PODINFO_ANNOTATIONS: Final[str] = "annotations"
PVC_ROOT: Final[str] = "/mnt/polyrl/pvc"
"""Claims named by ``pvc://CLAIM/PATH`` URIs are mounted at ``PVC_ROOT/CLAIM``."""

# Annotations the operator sets on a pod as requests to the runtime (read from PODINFO_DIR).
ANNOTATION_DRAIN: Final[str] = "polyrl.dev/drain"
"""``"true"`` on a rollout or workflow pod: stop sending it work, finish what is in flight, report it
drained in /progress."""
ANNOTATION_CHECKPOINT_REQUEST: Final[str] = "polyrl.dev/checkpoint-request"
"""A request id on the coordinator pod: checkpoint now, then echo the id in
``checkpoint.lastRequestId`` of /progress."""
