"""The rules of an RLJob spec across its parts (policies, pools, weight sync, data): each a CEL rule
the API server enforces and the same check in Python (`api.base.Rule`), attached to `RLJobSpec`."""

from __future__ import annotations

from polyrl_operator.api.algorithm import GROUPED_ALGORITHMS, GROUPED_ALGORITHMS_CEL, GROUPED_ALGORITHMS_TEXT
from polyrl_operator.api.base import Rule
from polyrl_operator.api.crossplay_rules import CROSSPLAY_RULES

SPEC_RULES: tuple[Rule, ...] = (
    Rule(
        cel="self.mode == 'async' || !has(self.maxStaleness) || self.maxStaleness == 0",
        message="must be 0 or unset in sync mode (sync training is strictly on-policy)",
        check=lambda s: s.mode == "async" or not s.max_staleness,
        field=".maxStaleness",
    ),
    Rule(
        cel="!has(self.onVersionSkew) || has(self.maxVersionSkew)",
        message="needs maxVersionSkew: it says what happens to an episode over that bound",
        check=lambda s: s.on_version_skew is None or s.max_version_skew is not None,
        field=".onVersionSkew",
    ),
    Rule(
        cel="!has(self.maxVersionSkew) || self.maxVersionSkew >= 1 || "
        "(has(self.onVersionSkew) && self.onVersionSkew == 'drop')",
        message="must be >= 1 with onVersionSkew wait (the default): policies take their steps one "
        "at a time, so while one trains the policy that stepped last is a version ahead; 0 needs "
        "onVersionSkew drop",
        check=lambda s: s.max_version_skew is None or s.max_version_skew >= 1 or s.on_version_skew == "drop",
        field=".maxVersionSkew",
    ),
    Rule(
        cel="size(self.policies) > 1 || ((!has(self.failurePolicy) || "
        "!has(self.failurePolicy.onPolicyFailure) || self.failurePolicy.onPolicyFailure != 'freeze') "
        "&& self.policies.all(p, !has(p.failurePolicy) || !has(p.failurePolicy.onPolicyFailure) || "
        "p.failurePolicy.onPolicyFailure != 'freeze'))",
        message="freeze needs two policies or more: a job whose only policy is frozen has nothing "
        "left to train (use failJob)",
        check=lambda s: (
            len(s.policies) > 1 or all(s.policy_failure(p.name)[1] != "freeze" for p in s.policies)
        ),
        field=".failurePolicy.onPolicyFailure",
    ),
    Rule(
        cel="self.policies.all(p, !has(p.algorithm) || !has(p.algorithm.distillation) || "
        "self.policies.exists(q, q.name == p.algorithm.distillation.teacher && has(q.frozen) && q.frozen))",
        message="a policy's algorithm.distillation.teacher must name a frozen policy of this job "
        "(frozen: true): the teacher is served, never trained",
        check=lambda s: all(
            p.algorithm.distillation is None
            or any(q.name == p.algorithm.distillation.teacher and q.frozen for q in s.policies)
            for p in s.policies
        ),
        field=".policies",
    ),
    Rule(
        cel="self.policies.exists(p, !has(p.frozen) || !p.frozen)",
        message="at least one policy must be trained: every policy is frozen",
        check=lambda s: any(not p.frozen for p in s.policies),
        field=".policies",
    ),
    Rule(
        cel="!has(self.evaluation) || has(self.evaluation.crossPlay) || (has(self.data) && has(self.data.eval))",
        message="needs eval rows: set data.eval (or evaluation.crossPlay alone, for games without rows)",
        check=lambda s: (
            s.evaluation is None
            or s.evaluation.cross_play is not None
            or (s.data is not None and s.data.eval is not None)
        ),
        field=".evaluation",
    ),
    *CROSSPLAY_RULES,
    Rule(
        cel=f"self.policies.all(p, (has(p.frozen) && p.frozen) || !(p.algorithm.name in {GROUPED_ALGORITHMS_CEL}) || "
        "self.training.episodesPerStep % p.algorithm.groupSize == 0)",
        message=f"must be a multiple of the groupSize of every policy trained with {GROUPED_ALGORITHMS_TEXT} "
        "(episodes start, and steps train, in whole groups)",
        check=lambda s: all(
            p.frozen
            or p.algorithm.name not in GROUPED_ALGORITHMS
            or s.training.episodes_per_step % p.algorithm.group_size == 0
            for p in s.policies
        ),
        field=".training.episodesPerStep",
    ),
    Rule(
        # CEL lists hold one type: the rollout and the trainer are spelled out, not listed.
        cel="self.policies.all(p, "
        "(!has(p.rollout.pool) || (has(self.pools) && self.pools.exists(q, q.name == p.rollout.pool))) && "
        "(!has(p.trainer.pool) || (has(self.pools) && self.pools.exists(q, q.name == p.trainer.pool))))",
        message="a rollout or trainer names a pool that spec.pools does not define",
        check=lambda s: all(r.pool is None or r.pool in s.pool_names for r in s.policy_roles()),
        field=".policies",
    ),
    Rule(
        cel="!has(self.pools) || self.pools.all(q, self.policies.exists(p, "
        "(has(p.rollout.pool) && p.rollout.pool == q.name) || "
        "(has(p.trainer.pool) && p.trainer.pool == q.name)))",
        message="every pool must be named by a rollout or trainer (a pool no role uses would hold "
        "devices for nothing)",
        check=lambda s: all(q.name in {r.pool for r in s.policy_roles()} for q in s.pools or ()),
        field=".pools",
    ),
    Rule(
        cel="!has(self.pools) || self.policies.all(p, !has(p.rollout.pool) || "
        "p.rollout.engine != 'vllm' || self.pools.all(q, q.name != p.rollout.pool || q.gpus >= 1))",
        message="a pool that runs a vllm rollout (rollout.engine vllm, the default) must have gpus >= 1 "
        "(vLLM runs on GPUs only); on a CPU pool set the policy's rollout.engine: torch",
        check=lambda s: all(
            p.rollout.pool is None or p.rollout.engine != "vllm" or s.pool_gpus(p.rollout.pool) >= 1
            for p in s.policies
        ),
        field=".pools",
    ),
    Rule(
        cel="!has(self.pools) || self.policies.all(p, !has(p.trainer.pool) || "
        "!has(p.trainer.ranksPerPod) || self.pools.all(q, q.name != p.trainer.pool || q.gpus == 0 || "
        "q.gpus == p.trainer.ranksPerPod))",
        message="a trainer on a pool with GPUs runs one rank per GPU: its ranksPerPod must equal the "
        "pool's gpus",
        check=lambda s: all(
            p.frozen
            or p.trainer.pool is None
            or p.trainer.ranks_per_pod is None
            or s.pool_gpus(p.trainer.pool) in (0, p.trainer.ranks_per_pod)
            for p in s.policies
        ),
        field=".policies",
    ),
    Rule(
        cel="self.policies.all(p, !has(p.rollout.pool) || !has(p.trainer.pool) || "
        "p.rollout.pool == p.trainer.pool || "
        "!self.policies.exists(o, has(o.trainer.pool) && o.trainer.pool == p.rollout.pool))",
        message="a policy whose trainer is on one pool may run its rollout on another pool only if no "
        "trainer runs there: each pool's training turns would wait for the other's",
        check=lambda s: all(
            p.rollout.pool is None
            or p.trainer_pool in (None, p.rollout.pool)
            or all(o.trainer_pool != p.rollout.pool for o in s.policies)
            for p in s.policies
        ),
        field=".policies",
    ),
    Rule(
        cel="!has(self.weightSync) || !has(self.weightSync.deltas) || self.weightSync.deltas == 0 || "
        "(has(self.weightSync.transport) && self.weightSync.transport in ['objectstore', 'collective'])",
        message="deltas need transport objectstore or collective: objectstore keeps versions in a store an "
        "engine fetches from, collective sends each version to engines that hold the one before; shm "
        "and cudaipc hand each version over whole (storage writes deltas by fullEvery)",
        check=lambda s: s.weight_sync.deltas == 0 or s.weight_sync.transport in ("objectstore", "collective"),
        field=".weightSync.deltas",
    ),
    Rule(
        cel="!has(self.weightSync) || !has(self.weightSync.deltas) || self.weightSync.deltas == 0 || "
        "!has(self.weightSync.transport) || self.weightSync.transport != 'collective' || "
        "self.policies.all(p, has(p.rollout.engine) && p.rollout.engine == 'torch')",
        message="deltas over collective are read by torch engines: every policy needs rollout.engine "
        "torch (vLLM's worker receives whole versions)",
        check=lambda s: (
            s.weight_sync.deltas == 0
            or s.weight_sync.transport != "collective"
            or all(p.rollout.engine == "torch" for p in s.policies)
        ),
        field=".weightSync.deltas",
    ),
    Rule(
        cel="!has(self.weightSync) || self.weightSync.transport != 'cudaipc' || self.policies.all(p, "
        "(has(p.frozen) && p.frozen) || has(p.rollout.pool) && has(p.trainer.pool) && "
        "p.rollout.pool == p.trainer.pool && has(self.pools) && "
        "self.pools.exists(q, q.name == p.rollout.pool && q.replicas.max == 1))",
        message="cudaipc needs every trained policy's rollout and its trainer on one pool of one pod "
        "(replicas.max 1): engines copy the trainer's GPU memory, so they must share its host",
        check=lambda s: (
            s.weight_sync.transport != "cudaipc" or all(p.frozen or s.on_one_pod(p) for p in s.policies)
        ),
        field=".weightSync.transport",
    ),
    Rule(
        cel="!has(self.weightSync) || !has(self.weightSync.transport) || "
        "self.weightSync.transport != 'collective' || !has(self.pools) || self.policies.all(p, "
        "(has(p.frozen) && p.frozen) || !has(p.rollout.pool) || !has(p.trainer.pool) || "
        "p.rollout.pool != p.trainer.pool || self.pools.all(q, q.name != p.rollout.pool || "
        "(has(q.gpus) ? q.gpus : 1) < 1 || q.replicas.max == 1))",
        message="collective cannot serve a policy whose rollout and trainer share a GPU pool of "
        "several pods: trainer rank 0 and the engine of pod 0 would be two NCCL ranks on one GPU, "
        "which NCCL refuses. Use auto (objectstore for such a policy: through host memory), or a "
        "pool of one pod (replicas.max 1, where auto picks cudaipc)",
        check=lambda s: (
            s.weight_sync.transport != "collective"
            or not any(s.shares_gpus_across_pods(p) for p in s.policies)
        ),
        field=".weightSync.transport",
    ),
    Rule(
        cel="!has(self.weightSync) || self.weightSync.transport != 'cudaipc' || !has(self.pools) || "
        "self.policies.all(p, !has(p.trainer.pool) || "
        "self.pools.all(q, q.name != p.trainer.pool || q.gpus >= 1))",
        message="cudaipc shares the trainer's CUDA memory: a pool that runs a trainer must have gpus >= 1",
        check=lambda s: (
            s.weight_sync.transport != "cudaipc"
            or all(
                p.trainer_pool not in s.pool_names or s.pool_gpus(p.trainer_pool or "") >= 1
                for p in s.policies
            )
        ),
        field=".weightSync.transport",
    ),
    Rule(
        cel="self.policies.all(p, !has(p.rollout.pool) || !has(p.algorithm) || !has(p.algorithm.lora) || "
        "self.policies.all(o, o.name == p.name || !(has(o.rollout.pool) && o.rollout.pool == p.rollout.pool && ((has(o.algorithm) && has(o.algorithm.lora)) || (has(o.frozen) && o.frozen)) && o.model.uri == p.model.uri && (has(o.model.dtype) ? o.model.dtype : 'auto') == (has(p.model.dtype) ? p.model.dtype : 'auto')) || "
        "(has(o.rollout.engine) ? o.rollout.engine : 'vllm') == (has(p.rollout.engine) ? p.rollout.engine : 'vllm')))",
        message="policies that share a base model as LoRA adapters (and frozen policies served that "
        "base) must agree on rollout.engine (one engine serves all of them)",
        check=lambda s: all(
            len({s.policy(n).rollout.engine for n in b.policies}) == 1 for b in s.shared_bases()
        ),
        field=".policies",
    ),
    Rule(
        cel="self.policies.all(p, !has(p.rollout.pool) || !has(p.algorithm) || !has(p.algorithm.lora) || "
        "self.policies.all(o, o.name == p.name || !(has(o.rollout.pool) && o.rollout.pool == p.rollout.pool && ((has(o.algorithm) && has(o.algorithm.lora)) || (has(o.frozen) && o.frozen)) && o.model.uri == p.model.uri && (has(o.model.dtype) ? o.model.dtype : 'auto') == (has(p.model.dtype) ? p.model.dtype : 'auto')) || "
        "(has(o.model.trustRemoteCode) && o.model.trustRemoteCode) == "
        "(has(p.model.trustRemoteCode) && p.model.trustRemoteCode)))",
        message="policies that share a base model as LoRA adapters (and frozen policies served that "
        "base) must agree on model.trustRemoteCode (one engine loads the base for all of them)",
        check=lambda s: all(
            len({s.policy(n).model.trust_remote_code for n in b.policies}) == 1 for b in s.shared_bases()
        ),
        field=".policies",
    ),
    Rule(
        cel="!has(self.weightSync) || !has(self.weightSync.transport) || "
        "!(self.weightSync.transport in ['collective', 'cudaipc', 'storage']) || "
        "self.policies.all(p, !has(p.rollout.pool) || !has(p.algorithm) || !has(p.algorithm.lora) || "
        "!self.policies.exists(o, o.name != p.name && has(o.rollout.pool) && o.rollout.pool == p.rollout.pool && ((has(o.algorithm) && has(o.algorithm.lora)) || (has(o.frozen) && o.frozen)) && o.model.uri == p.model.uri && (has(o.model.dtype) ? o.model.dtype : 'auto') == (has(p.model.dtype) ? p.model.dtype : 'auto')))",
        message="policies that share a base model as LoRA adapters receive adapter versions through "
        "objectstore or shm (auto picks one): one engine serves them all, and collective, cudaipc and "
        "storage connect an engine to one policy's trainer",
        check=lambda s: (
            s.weight_sync.transport not in ("collective", "cudaipc", "storage") or not s.shared_bases()
        ),
        field=".weightSync.transport",
    ),
    Rule(
        cel="!has(self.weightSync) || !has(self.weightSync.transport) || "
        "!(self.weightSync.transport in ['collective', 'cudaipc', 'storage']) || "
        "self.policies.all(p, !has(p.league) || !has(p.algorithm) || !has(p.algorithm.lora))",
        message="a LoRA policy with a league receives adapter versions through objectstore or shm "
        "(auto picks one): its engines hold its LoRA adapter and past versions of it, and "
        "collective, cudaipc and storage send merged weights",
        check=lambda s: (
            s.weight_sync.transport not in ("collective", "cudaipc", "storage")
            or all(p.league is None or p.algorithm.lora is None for p in s.policies)
        ),
        field=".weightSync.transport",
    ),
    Rule(
        cel="!has(self.weightSync) || !has(self.weightSync.transport) || "
        "self.weightSync.transport != 'storage' || "
        "self.policies.all(p, has(p.rollout.engine) && p.rollout.engine == 'torch')",
        message="transport storage is read by torch engines: every policy needs rollout.engine torch "
        "(vLLM engines receive through collective or cudaipc)",
        check=lambda s: (
            s.weight_sync.transport != "storage" or all(p.rollout.engine == "torch" for p in s.policies)
        ),
        field=".weightSync.transport",
    ),
)
