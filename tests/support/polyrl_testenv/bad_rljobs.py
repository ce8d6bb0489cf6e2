"""Bad RLJob documents every layer must reject, each with the field the error must name.

Shared by the unit tier (``polyrl validate``) and the control-plane tier (``kubectl apply`` against the
real API server), so both layers are held to the same list.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "manifests" / "examples"
CPU_EXAMPLE = EXAMPLES / "signal-game-cpu.yaml"

Doc = dict[str, Any]


def base_job(name: str = "bad-job") -> Doc:
    """The two-policy CPU example, renamed: every bad case is one mutation of it."""
    doc: Doc = yaml.safe_load(CPU_EXAMPLE.read_text())
    doc["metadata"] = {"name": name}
    return doc


@dataclass(frozen=True)
class BadCase:
    """One mutation of the base job and what the error must mention."""

    id: str
    mutate: Callable[[Doc], None]
    field: str
    """The field path ``polyrl validate`` prints (dots and [i])."""
    server_mentions: tuple[str, ...]
    """Substrings the API server's error must contain (it names fields its own way)."""
    server_rejects: bool = True
    """False where Kubernetes cannot express the rule; then only ``polyrl validate`` rejects it."""

    def document(self, name: str = "bad-job") -> Doc:
        doc = base_job(name)
        self.mutate(doc)
        return copy.deepcopy(doc)


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        node: Any = doc
        parts = path.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        last = parts[-1]
        if last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _dup_policy(doc: Doc) -> None:
    doc["spec"]["policies"][1]["name"] = doc["spec"]["policies"][0]["name"]


def _freeze_one_policy(doc: Doc) -> None:
    """Only the first policy (the workflow names none in the spec, so the job stays otherwise valid),
    frozen when its trainer runs out of restarts: nothing would be left to train."""
    doc["spec"]["policies"] = doc["spec"]["policies"][:1]
    doc["spec"]["failurePolicy"] = {"onPolicyFailure": "freeze"}


def _storage_for_vllm(doc: Doc) -> None:
    """Versions through storage to a policy whose engines are vLLM (which receive through
    collective or cudaipc only)."""
    doc["spec"]["weightSync"] = {"transport": "storage", "uri": "s3://weights/job"}
    doc["spec"]["policies"][1]["rollout"].update(engine="vllm", gpus=1)


def _collective_deltas_for_vllm(doc: Doc) -> None:
    """Deltas over collective to a policy whose engines are vLLM (its worker receives whole versions)."""
    doc["spec"]["weightSync"] = {"transport": "collective", "deltas": 2}
    doc["spec"]["policies"][1]["rollout"].update(engine="vllm", gpus=1)


def _lora_critic_on_zero3(doc: Doc) -> None:
    """A LoRA policy's critic (an adapter on the policy's base) with the base partitioned by ZeRO-3."""
    policy = doc["spec"]["policies"][0]
    policy["algorithm"] = {"name": "ppo", "groupSize": 1, "critic": {}, "lora": {"rank": 4}}
    policy.setdefault("trainer", {})["zeroStage"] = 3


def _league(**changes: Any) -> Callable[[Doc], None]:
    """A league on the speaker, a LoRA policy of the torch engine, with `changes` to the policy
    (a dotted key: a field below it) or to the spec (a key starting `spec.`)."""

    def mutate(doc: Doc) -> None:
        policy = doc["spec"]["policies"][0]
        policy["algorithm"]["lora"] = {"rank": 4}
        policy["league"] = {"snapshotEverySteps": 2, "keep": 2}
        for key, value in changes.items():
            node: Any = doc["spec"] if key.startswith("spec_") else policy
            parts = key.removeprefix("spec_").split("__")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            if value is None:
                node.pop(parts[-1], None)
            else:
                node[parts[-1]] = value

    return mutate


def _cross_play(pairs: list[tuple[str, str]], league: bool = True, **cfg: Any) -> Callable[[Doc], None]:
    """Cross-play of `pairs` (row, column), with a league on the speaker unless `league` is False."""

    def mutate(doc: Doc) -> None:
        if league:
            _league()(doc)
        rows = [{"row": r, "column": c} for r, c in pairs]
        doc["spec"]["evaluation"] = {"crossPlay": {"pairs": rows, **cfg}}

    return mutate


def _long_names(doc: Doc) -> None:
    doc["metadata"]["name"] = "j" * 30
    doc["spec"]["policies"][0]["name"] = "p" * 30


def _typo(doc: Doc) -> None:
    alg = doc["spec"]["policies"][0]["algorithm"]
    alg["grupSize"] = alg.pop("groupSize")


def _on_pool(doc: Doc, *roles: tuple[int, str], **pool: Any) -> Doc:
    """The base job with a CPU pool ``shared`` (``pool`` overrides its fields) hosting ``roles``
    ((policy index, role) pairs), each of them written as it must be on a pool: its replicas, gpus,
    gpuType and pod settings removed. A valid job: each pool case breaks one thing of it."""
    doc["spec"]["pools"] = [{"name": "shared", "gpus": 0, "replicas": {"min": 1, "max": 2}, **pool}]
    for i, role in roles:
        settings = doc["spec"]["policies"][i][role]
        for key in ("replicas", "gpus", "gpuType", "resources"):
            settings.pop(key, None)
        settings["pool"] = "shared"
    return doc


def _pool_undefined(doc: Doc) -> None:
    _on_pool(doc, (0, "rollout"))
    del doc["spec"]["pools"]


def _pool_unused(doc: Doc) -> None:
    _on_pool(doc, (0, "rollout"))
    doc["spec"]["pools"].append({"name": "idle", "gpus": 0})


def _pooled_role_with(role: str, key: str, value: Any) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        _on_pool(doc, (0, role))
        doc["spec"]["policies"][0][role][key] = value

    return mutate


def _vllm_on_cpu_pool(doc: Doc) -> None:
    _on_pool(doc, (0, "rollout"))
    doc["spec"]["policies"][0]["rollout"]["engine"] = "vllm"


def _ranks_per_pod_not_pool_gpus(doc: Doc) -> None:
    _on_pool(doc, (0, "trainer"), gpus=2)
    doc["spec"]["policies"][0]["trainer"]["ranksPerPod"] = 3


def _cudaipc_apart(doc: Doc) -> None:
    """GPU trainers, their rollouts on a GPU pool without them: cudaipc cannot reach the trainers."""
    _on_pool(doc, (0, "rollout"), (1, "rollout"), gpus=1)
    for policy in doc["spec"]["policies"]:
        policy["trainer"]["gpus"] = 1
    doc["spec"]["weightSync"]["transport"] = "cudaipc"


def _cudaipc_on_cpu_pool(doc: Doc) -> None:
    """Every policy colocated, on a CPU pool of one pod: no CUDA memory to share."""
    _on_pool(
        doc, (0, "rollout"), (0, "trainer"), (1, "rollout"), (1, "trainer"), replicas={"min": 1, "max": 1}
    )
    doc["spec"]["weightSync"]["transport"] = "cudaipc"


def _cudaipc_across_pods(doc: Doc) -> None:
    """Every policy colocated on a GPU pool of up to two pods: engines on the second pod are off
    the trainer's host."""
    _on_pool(doc, (0, "rollout"), (0, "trainer"), (1, "rollout"), (1, "trainer"), gpus=1)
    doc["spec"]["weightSync"]["transport"] = "cudaipc"


def _collective_across_pods(doc: Doc) -> None:
    """As `_cudaipc_across_pods`, through collective: rank 0 and pod 0's engine on one GPU."""
    _cudaipc_across_pods(doc)
    doc["spec"]["weightSync"]["transport"] = "collective"


def _rollout_on_anothers_training_pool(doc: Doc) -> None:
    """Two pools that each host a trainer, and a policy with its trainer on one and its rollout on
    the other."""
    _on_pool(doc, (0, "rollout"), (0, "trainer"))
    doc["spec"]["pools"].append({"name": "second", "gpus": 0})
    listener = doc["spec"]["policies"][1]
    for role in ("rollout", "trainer"):
        for key in ("replicas", "gpus", "gpuType", "resources"):
            listener[role].pop(key, None)
    listener["trainer"]["pool"] = "second"
    listener["rollout"]["pool"] = "shared"


def _dup_pool(doc: Doc) -> None:
    _on_pool(doc, (0, "rollout"))
    doc["spec"]["pools"].append(dict(doc["spec"]["pools"][0]))


def _long_pool_names(doc: Doc) -> None:
    _on_pool(doc, (0, "rollout"))
    doc["metadata"]["name"] = "j" * 25
    doc["spec"]["pools"][0]["name"] = doc["spec"]["policies"][0]["rollout"]["pool"] = "p" * 32


def _sharing_a_base(doc: Doc, gpus: int = 0) -> Doc:
    """Both policies' rollouts on one pool, the same model, LoRA adapters: they share a base."""
    _on_pool(doc, (0, "rollout"), (1, "rollout"), gpus=gpus)
    for policy in doc["spec"]["policies"]:
        policy["model"] = {"uri": "builtin://tiny-qwen2", "dtype": "float32"}
        policy["algorithm"]["lora"] = {"rank": 4}
    return doc


def _shared_base_engines_differ(doc: Doc) -> None:
    _sharing_a_base(doc, gpus=1)
    doc["spec"]["policies"][1]["rollout"]["engine"] = "vllm"


def _shared_base_remote_code_differs(doc: Doc) -> None:
    _sharing_a_base(doc)["spec"]["policies"][1]["model"]["trustRemoteCode"] = True


def _shared_base_over_collective(doc: Doc) -> None:
    _sharing_a_base(doc)["spec"]["weightSync"]["transport"] = "collective"


def frozen_on_a_shared_base(doc: Doc, gpus: int = 0) -> Doc:
    """A LoRA speaker and a frozen listener of its base on one pool: the listener is served the base
    by the speaker's engine."""
    listener = _sharing_a_base(doc, gpus=gpus)["spec"]["policies"][1]
    del listener["trainer"], listener["algorithm"]["lora"]
    listener["frozen"] = True
    return doc


def _frozen_member_engine_differs(doc: Doc) -> None:
    frozen_on_a_shared_base(doc, gpus=1)["spec"]["policies"][1]["rollout"]["engine"] = "vllm"


def _frozen_member_remote_code_differs(doc: Doc) -> None:
    frozen_on_a_shared_base(doc)["spec"]["policies"][1]["model"]["trustRemoteCode"] = True


def _frozen_member_over_collective(doc: Doc) -> None:
    frozen_on_a_shared_base(doc)["spec"]["weightSync"]["transport"] = "collective"


POOL_CASES: tuple[BadCase, ...] = (
    BadCase(
        "pool-undefined", _pool_undefined, "spec.policies", ("spec.policies", "spec.pools does not define")
    ),
    BadCase("pool-unused", _pool_unused, "spec.pools", ("spec.pools", "every pool must be named")),
    BadCase(
        "pooled-rollout-with-gpus",
        _pooled_role_with("rollout", "gpus", 0),
        "spec.policies[0].rollout.pool",
        ("spec.policies[0].rollout.pool", "leave them unset"),
    ),
    BadCase(
        "pooled-rollout-with-replicas",
        _pooled_role_with("rollout", "replicas", {"min": 1, "max": 2}),
        "spec.policies[0].rollout.pool",
        ("spec.policies[0].rollout.pool", "leave them unset"),
    ),
    BadCase(
        "pooled-trainer-with-replicas",
        _pooled_role_with("trainer", "replicas", 2),
        "spec.policies[0].trainer.pool",
        ("spec.policies[0].trainer.pool", "leave them unset"),
    ),
    BadCase(
        "pooled-trainer-with-gpu-type",
        _pooled_role_with("trainer", "gpuType", "h100"),
        "spec.policies[0].trainer.pool",
        ("spec.policies[0].trainer.pool", "leave them unset"),
    ),
    BadCase(
        "pooled-rollout-with-image",
        _pooled_role_with("rollout", "image", "img:1"),
        "spec.policies[0].rollout.pool",
        ("spec.policies[0].rollout.pool", "leave them unset"),
    ),
    BadCase(
        "pooled-trainer-with-env",
        _pooled_role_with("trainer", "env", [{"name": "A", "value": "1"}]),
        "spec.policies[0].trainer.pool",
        ("spec.policies[0].trainer.pool", "leave them unset"),
    ),
    BadCase(
        "pooled-trainer-with-pod-template",
        _pooled_role_with("trainer", "podTemplate", {"metadata": {"labels": {"team": "a"}}}),
        "spec.policies[0].trainer.pool",
        ("spec.policies[0].trainer.pool", "leave them unset"),
    ),
    BadCase("vllm-on-a-cpu-pool", _vllm_on_cpu_pool, "spec.pools", ("spec.pools", "vllm")),
    BadCase(
        "trainer-ranks-per-pod-not-pool-gpus",
        _ranks_per_pod_not_pool_gpus,
        "spec.policies",
        ("spec.policies", "ranksPerPod must equal the pool's gpus"),
    ),
    BadCase(
        "cudaipc-rollout-and-trainer-apart",
        _cudaipc_apart,
        "spec.weightSync.transport",
        ("spec.weightSync.transport", "cudaipc needs every trained policy's rollout and its trainer"),
    ),
    BadCase(
        "cudaipc-across-pool-pods",
        _cudaipc_across_pods,
        "spec.weightSync.transport",
        ("spec.weightSync.transport", "on one pool of one pod"),
    ),
    BadCase(
        "collective-across-gpu-pool-pods",
        _collective_across_pods,
        "spec.weightSync.transport",
        ("spec.weightSync.transport", "two NCCL ranks on one GPU"),
    ),
    BadCase(
        "cudaipc-trainer-without-gpus",
        _cudaipc_on_cpu_pool,
        "spec.weightSync.transport",
        ("spec.weightSync.transport", "a pool that runs a trainer must have gpus >= 1"),
    ),
    BadCase(
        "rollout-on-another-trainers-pool",
        _rollout_on_anothers_training_pool,
        "spec.policies",
        ("spec.policies", "only if no trainer runs there"),
    ),
    BadCase(
        "shared-base-engines-differ",
        _shared_base_engines_differ,
        "spec.policies",
        ("spec.policies", "share a base model as LoRA adapters", "must agree on rollout.engine"),
    ),
    BadCase(
        "shared-base-trust-remote-code-differs",
        _shared_base_remote_code_differs,
        "spec.policies",
        ("spec.policies", "must agree on model.trustRemoteCode"),
    ),
    BadCase(
        "shared-base-over-collective",
        _shared_base_over_collective,
        "spec.weightSync.transport",
        ("spec.weightSync.transport", "receive adapter versions through objectstore or shm"),
    ),
    BadCase(
        "frozen-member-of-a-shared-base-engine-differs",
        _frozen_member_engine_differs,
        "spec.policies",
        ("spec.policies", "frozen policies served that base", "must agree on rollout.engine"),
    ),
    BadCase(
        "frozen-member-of-a-shared-base-trust-remote-code-differs",
        _frozen_member_remote_code_differs,
        "spec.policies",
        ("spec.policies", "must agree on model.trustRemoteCode"),
    ),
    BadCase(
        "frozen-member-of-a-shared-base-over-collective",
        _frozen_member_over_collective,
        "spec.weightSync.transport",
        ("spec.weightSync.transport", "receive adapter versions through objectstore or shm"),
    ),
    BadCase("duplicate-pool-names", _dup_pool, "spec.pools", ("spec.pools[1]", "Duplicate")),
    BadCase("pool-pod-names-too-long", _long_pool_names, "spec.pools", ("spec.pools", "63 characters")),
)
"""One case per pool rule of the API (spec.pools, the roles' pool field and the transport that needs
one)."""


BAD_CASES: tuple[BadCase, ...] = (
    BadCase("unknown-field-typo", _typo, "spec.policies[0].algorithm.grupSize", ("grupSize",)),
    BadCase("unknown-top-level-field", _set("spec.trainig", {"totalSteps": 3}), "spec.trainig", ("trainig",)),
    BadCase("duplicate-policy-names", _dup_policy, "spec.policies", ("spec.policies[1]", "Duplicate")),
    BadCase(
        "replicas-min-gt-max",
        _set("spec.policies.0.rollout.replicas", {"min": 3, "max": 2}),
        "spec.policies[0].rollout.replicas.min",
        ("spec.policies[0].rollout.replicas.min", "less than or equal to max"),
    ),
    BadCase(
        "workflow-replicas-min-gt-max",
        _set("spec.workflow.replicas", {"min": 5, "max": 1}),
        "spec.workflow.replicas.min",
        ("spec.workflow.replicas.min",),
    ),
    BadCase(
        "negative-max-staleness", _set("spec.maxStaleness", -1), "spec.maxStaleness", ("spec.maxStaleness",)
    ),
    BadCase(
        "negative-max-version-skew",
        _set("spec.maxVersionSkew", -1),
        "spec.maxVersionSkew",
        ("spec.maxVersionSkew",),
    ),
    BadCase(
        "version-skew-action-without-bound",
        _set("spec.onVersionSkew", "drop"),
        "spec.onVersionSkew",
        ("spec.onVersionSkew", "needs maxVersionSkew"),
    ),
    BadCase(
        "zero-version-skew-that-waits",
        _set("spec.maxVersionSkew", 0),
        "spec.maxVersionSkew",
        ("spec.maxVersionSkew", "onVersionSkew drop"),
    ),
    BadCase(
        "unknown-version-skew-action",
        _set("spec.onVersionSkew", "pause"),
        "spec.onVersionSkew",
        ("spec.onVersionSkew", "pause"),
    ),
    BadCase(
        "freeze-with-one-policy",
        _freeze_one_policy,
        "spec.failurePolicy.onPolicyFailure",
        ("spec.failurePolicy.onPolicyFailure", "freeze needs two policies"),
    ),
    BadCase(
        "unknown-policy-failure-action",
        _set("spec.failurePolicy.onPolicyFailure", "restartAll"),
        "spec.failurePolicy.onPolicyFailure",
        ("spec.failurePolicy.onPolicyFailure", "restartAll"),
    ),
    BadCase(
        "deltas-over-a-transport-without-them",
        _set("spec.weightSync", {"transport": "shm", "deltas": 4}),
        "spec.weightSync.deltas",
        ("spec.weightSync.deltas", "need transport objectstore"),
    ),
    BadCase(
        "collective-deltas-for-vllm-engines",
        _collective_deltas_for_vllm,
        "spec.weightSync.deltas",
        ("spec.weightSync.deltas", "deltas over collective are read by torch engines"),
    ),
    BadCase(
        "storage-without-a-uri",
        _set("spec.weightSync", {"transport": "storage"}),
        "spec.weightSync.uri",
        ("spec.weightSync.uri", "transport storage writes each version under uri"),
    ),
    BadCase(
        "weight-sync-uri-without-storage",
        _set("spec.weightSync", {"transport": "objectstore", "uri": "s3://weights/job"}),
        "spec.weightSync.uri",
        ("spec.weightSync.uri", "set transport storage or remove uri"),
    ),
    BadCase(
        "storage-for-vllm-engines",
        _storage_for_vllm,
        "spec.weightSync.transport",
        ("spec.weightSync.transport", "every policy needs rollout.engine torch"),
    ),
    BadCase("unknown-mode", _set("spec.mode", "turbo"), "spec.mode", ("spec.mode", "turbo")),
    BadCase(
        "unknown-engine",
        _set("spec.policies.0.rollout.engine", "sglang"),
        "spec.policies[0].rollout.engine",
        ("spec.policies[0].rollout.engine",),
    ),
    BadCase(
        "unknown-backend",
        _set("spec.policies.1.trainer.backend", "fsdp"),
        "spec.policies[1].trainer.backend",
        ("spec.policies[1].trainer.backend",),
    ),
    BadCase(
        "top-p-under-importance-correction",
        _set("spec.policies.0.rollout.sampling", {"topP": 0.9}),
        "spec.policies[0].rollout.sampling.topP",
        ("spec.policies[0].rollout.sampling.topP", "ignore a nucleus"),
    ),
    BadCase(
        "distillation-teacher-not-frozen",
        _set("spec.policies.0.algorithm", {"distillation": {"teacher": "listener"}}),
        "spec.policies",
        ("spec.policies", "must name a frozen policy"),
    ),
    BadCase(
        "distillation-own-teacher",
        _set("spec.policies.0.algorithm", {"distillation": {"teacher": "speaker"}}),
        "spec.policies[0].algorithm.distillation.teacher",
        ("spec.policies[0].algorithm.distillation.teacher", "cannot be its own teacher"),
    ),
    BadCase(
        "dynamic-sampling-without-groups",
        _set("spec.policies.0.algorithm", {"name": "reinforce_pp", "groupSize": 1, "dynamicSampling": {}}),
        "spec.policies[0].algorithm.dynamicSampling",
        ("spec.policies[0].algorithm.dynamicSampling", "needs groups"),
    ),
    BadCase(
        "overlong-penalty-ramp-past-max-new-tokens",
        _set("spec.policies.0.algorithm", {"overlongPenalty": {"bufferTokens": 4096}}),
        "spec.policies[0].algorithm.overlongPenalty.bufferTokens",
        ("spec.policies[0].algorithm.overlongPenalty.bufferTokens", "maxLength"),
    ),
    BadCase(
        "per-group-norm-without-groups",
        _set("spec.policies.0.algorithm", {"name": "reinforce_pp", "advantageNorm": "per-group"}),
        "spec.policies[0].algorithm.advantageNorm",
        ("spec.policies[0].algorithm.advantageNorm", "per-group needs groups"),
    ),
    BadCase(
        "kl-in-reward-without-kl-coef",
        _set("spec.policies.0.algorithm", {"name": "reinforce_pp", "groupSize": 1, "klIn": "reward"}),
        "spec.policies[0].algorithm.klIn",
        ("spec.policies[0].algorithm.klIn", "reward needs klCoef > 0"),
    ),
    BadCase(
        "kl-in-reward-for-a-grouped-estimator",
        _set("spec.policies.0.algorithm", {"name": "grpo", "groupSize": 4, "klCoef": 0.1, "klIn": "reward"}),
        "spec.policies[0].algorithm.klIn",
        ("spec.policies[0].algorithm.klIn", "reward is for reinforce_pp and ppo"),
    ),
    BadCase(
        "kl-in-reward-for-reinforce-pp-baseline",
        _set(
            "spec.policies.0.algorithm",
            {"name": "reinforce_pp_baseline", "groupSize": 4, "klCoef": 0.1, "klIn": "reward"},
        ),
        "spec.policies[0].algorithm.klIn",
        (
            "spec.policies[0].algorithm.klIn",
            "group-centred signals of grpo, dr_grpo, rloo and reinforce_pp_baseline",
        ),
    ),
    BadCase(
        "group-size-one-for-a-grouped-estimator",
        _set("spec.policies.0.algorithm", {"name": "reinforce_pp_baseline", "groupSize": 1}),
        "spec.policies[0].algorithm.groupSize",
        ("spec.policies[0].algorithm.groupSize", "must be at least 2 for"),
    ),
    BadCase(
        "mini-batches-zero",
        _set("spec.policies.0.algorithm.miniBatches", 0),
        "spec.policies[0].algorithm.miniBatches",
        ("spec.policies[0].algorithm.miniBatches",),
    ),
    BadCase(
        "algorithm-epochs-zero",
        _set("spec.policies.0.algorithm.epochs", 0),
        "spec.policies[0].algorithm.epochs",
        ("spec.policies[0].algorithm.epochs",),
    ),
    BadCase(
        "critic-without-ppo",
        _set("spec.policies.0.algorithm", {"name": "reinforce_pp", "groupSize": 1, "critic": {}}),
        "spec.policies[0].algorithm.critic",
        ("spec.policies[0].algorithm.critic", "is for ppo"),
    ),
    BadCase(
        "league-keep-zero",
        _league(league__keep=0),
        "spec.policies[0].league.keep",
        ("spec.policies[0].league.keep",),
    ),
    BadCase(
        "league-resident-snapshots-with-lora",
        _league(league__residentSnapshots=2),
        "spec.policies[0].league.residentSnapshots",
        ("spec.policies[0].league.residentSnapshots", "is for a policy without LoRA"),
    ),
    BadCase(
        "league-resident-snapshots-above-keep",
        _league(algorithm__lora=None, league__keep=2, league__residentSnapshots=3),
        "spec.policies[0].league.residentSnapshots",
        ("spec.policies[0].league.residentSnapshots", "must be at most league.keep"),
    ),
    BadCase(
        "league-on-vllm",
        _league(rollout__engine="vllm", rollout__gpus=1),
        "spec.policies[0].league",
        ("spec.policies[0].league", "needs rollout.engine torch"),
    ),
    BadCase(
        "league-latest-fraction-above-one",
        _league(league__latestFraction=1.5),
        "spec.policies[0].league.latestFraction",
        ("spec.policies[0].league.latestFraction",),
    ),
    BadCase(
        "league-through-collective",
        _league(spec_weightSync__transport="collective"),
        "spec.weightSync.transport",
        ("spec.weightSync.transport", "a LoRA policy with a league receives adapter versions"),
    ),
    BadCase(
        "crossplay-unknown-policy",
        _cross_play([("speaker", "nobody")]),
        "spec.evaluation.crossPlay.pairs",
        ("spec.evaluation.crossPlay.pairs", "must name a policy of spec.policies"),
    ),
    BadCase(
        "crossplay-self-without-league",
        _cross_play([("listener", "listener")]),
        "spec.evaluation.crossPlay.pairs",
        ("spec.evaluation.crossPlay.pairs", "a policy against itself needs its league"),
    ),
    BadCase(
        "crossplay-without-reference",
        _cross_play([("speaker", "listener")], league=False),
        "spec.evaluation.crossPlay.pairs",
        ("spec.evaluation.crossPlay.pairs", "must have a league"),
    ),
    BadCase(
        "crossplay-anchor-not-frozen",
        _cross_play([("speaker", "listener")], anchor="listener"),
        "spec.evaluation.crossPlay.anchor",
        ("spec.evaluation.crossPlay.anchor", "must name a frozen policy"),
    ),
    BadCase(
        "crossplay-no-pairs",
        _cross_play([]),
        "spec.evaluation.crossPlay.pairs",
        ("spec.evaluation.crossPlay.pairs",),
    ),
    BadCase(
        "critic-model-with-lora",
        _set(
            "spec.policies.0.algorithm",
            {
                "name": "ppo",
                "groupSize": 1,
                "critic": {"model": {"uri": "builtin://tiny"}},
                "lora": {"rank": 4},
            },
        ),
        "spec.policies[0].algorithm.critic.model",
        ("spec.policies[0].algorithm.critic.model", "second adapter"),
    ),
    BadCase(
        "critic-lora-zero3",
        _lora_critic_on_zero3,
        "spec.policies[0].trainer.zeroStage",
        ("spec.policies[0].trainer.zeroStage", "ZeRO-3"),
    ),
    BadCase(
        "critic-value-clip-negative",
        _set("spec.policies.0.algorithm", {"name": "ppo", "groupSize": 1, "critic": {"valueClip": -0.1}}),
        "spec.policies[0].algorithm.critic.valueClip",
        ("spec.policies[0].algorithm.critic.valueClip",),
    ),
    BadCase(
        "unknown-algorithm",
        _set("spec.policies.0.algorithm.name", "dpo"),
        "spec.policies[0].algorithm.name",
        ("spec.policies[0].algorithm.name",),
    ),
    BadCase("empty-policies", _set("spec.policies", []), "spec.policies", ("spec.policies",)),
    BadCase(
        "policy-name-not-dns-label",
        _set("spec.policies.0.name", "Speaker_1"),
        "spec.policies[0].name",
        ("spec.policies[0].name",),
    ),
    BadCase(
        "job-name-not-dns-label", _set("metadata.name", "signal.game"), "metadata.name", ("metadata.name",)
    ),
    BadCase("pod-names-too-long", _long_names, "spec.policies", ("spec.policies", "63 characters")),
    BadCase(
        "trainer-replicas-zero",
        _set("spec.policies.0.trainer.replicas", 0),
        "spec.policies[0].trainer.replicas",
        ("spec.policies[0].trainer.replicas",),
    ),
    BadCase(
        "total-steps-zero", _set("spec.training.totalSteps", 0), "spec.training.totalSteps", ("totalSteps",)
    ),
    BadCase(
        "total-steps-negative",
        _set("spec.training.totalSteps", -5),
        "spec.training.totalSteps",
        ("totalSteps",),
    ),
    BadCase(
        "gpus-fractional",
        _set("spec.policies.0.rollout.gpus", 1.5),
        "spec.policies[0].rollout.gpus",
        ("spec.policies[0].rollout.gpus",),
    ),
    BadCase(
        "gpus-string",
        _set("spec.policies.0.trainer.gpus", "2"),
        "spec.policies[0].trainer.gpus",
        ("spec.policies[0].trainer.gpus",),
    ),
    BadCase(
        "entrypoint-not-module-attr",
        _set("spec.workflow.entrypoint", "my_workflows.signal.SignalGame"),
        "spec.workflow.entrypoint",
        ("spec.workflow.entrypoint",),
    ),
    BadCase(
        "vllm-without-gpus",
        _set("spec.policies.1.rollout.engine", "vllm"),
        "spec.policies[1].rollout.gpus",
        ("spec.policies[1].rollout.gpus", "vllm"),
    ),
    BadCase(
        "grpo-group-size-one",
        _set("spec.policies.0.algorithm.groupSize", 1),
        "spec.policies[0].algorithm.groupSize",
        ("spec.policies[0].algorithm.groupSize", "grpo"),
    ),
    BadCase(
        "rloo-group-size-one",
        _set("spec.policies.0.algorithm", {"name": "rloo", "groupSize": 1}),
        "spec.policies[0].algorithm.groupSize",
        ("spec.policies[0].algorithm.groupSize", "rloo"),
    ),
    BadCase(
        "episodes-per-step-not-whole-groups",
        _set("spec.training.episodesPerStep", 66),
        "spec.training.episodesPerStep",
        ("spec.training.episodesPerStep", "groupSize"),
    ),
    BadCase(
        "staleness-in-sync-mode",
        _set("spec.mode", "sync"),
        "spec.maxStaleness",
        ("spec.maxStaleness", "sync"),
    ),
    BadCase(
        "bad-model-uri",
        _set("spec.policies.0.model.uri", "qwen3-0.6b"),
        "spec.policies[0].model.uri",
        ("spec.policies[0].model.uri",),
    ),
    BadCase(
        "gs-model-uri",  # the runtime cannot read gs://: the API does not accept it
        _set("spec.policies.0.model.uri", "gs://models/qwen"),
        "spec.policies[0].model.uri",
        ("spec.policies[0].model.uri",),
    ),
    BadCase(
        "gs-checkpoint-uri",
        _set("spec.checkpoint.uri", "gs://ckpts/run"),
        "spec.checkpoint.uri",
        ("spec.checkpoint.uri",),
    ),
    BadCase(
        "bad-credentials-secret",
        _set("spec.storage.credentialsSecret", "S3_Creds"),
        "spec.storage.credentialsSecret",
        ("spec.storage.credentialsSecret",),
    ),
    BadCase(
        "missing-training",
        lambda d: d["spec"].pop("training"),
        "spec.training",
        ("spec.training",),
    ),
    BadCase(
        "data-not-jsonl-or-parquet",
        _set("spec.data", {"train": "file:///d/train.csv"}),
        "spec.data.train",
        ("spec.data.train",),
    ),
    BadCase(
        "data-zero-epochs",
        _set("spec.data", {"train": "file:///d/train.jsonl", "epochs": 0}),
        "spec.data.epochs",
        ("spec.data.epochs",),
    ),
    BadCase(
        "evaluation-without-eval-rows",
        _set("spec.evaluation", {"everySteps": 5}),
        "spec.evaluation",
        ("spec.evaluation", "data.eval"),
    ),
    BadCase(
        "evaluation-greedy-pass-at-k",
        lambda d: d["spec"].update(
            data={"train": "file:///d/t.jsonl", "eval": "file:///d/e.jsonl"}, evaluation={"k": 3}
        ),
        "spec.evaluation.k",
        ("spec.evaluation.k", "greedy"),
    ),
    *POOL_CASES,
)
