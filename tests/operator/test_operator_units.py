"""Unit tests of the operator's pure parts: builders, merge, autoscaler, conditions, progress schema,
merge patches, settings and ``polyrl render``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from polyrl_operator import naming
from polyrl_operator.api import RLJob
from polyrl_operator.api.progress import Progress
from polyrl_operator.autoscale import ScaleState, Signals, decide
from polyrl_operator.builders import (
    JobRef,
    PodRequest,
    build_pod,
    build_workload,
    runtime_config,
    strategic_merge,
)
from polyrl_operator.builders.common import manifest_hash
from polyrl_operator.builders.priority import Priority
from polyrl_operator.cli import main
from polyrl_operator.kube import merge_patch, path_for
from polyrl_operator.planning import render
from polyrl_operator.planning.conditions import set_conditions
from polyrl_operator.settings import Autoscale, OperatorSettings, Placement, load_settings
from polyrl_testenv.bad_rljobs import EXAMPLES
from polyrl_testenv.operator_fixtures import PROGRESS_SAMPLES, T0, gpu_job, later, stored_job

REF = JobRef("debate", "team-a", "uid-1")


def gpu_model() -> RLJob:
    body = gpu_job()
    return RLJob.model_validate(
        {k: v for k, v in body.items() if k != "metadata"}
        | {"metadata": {"name": "debate", "namespace": "team-a"}}
    )


def test_pod_builder_places_gpus_by_admin_mapping_and_falls_back_to_a_label() -> None:
    job = gpu_model()
    settings = OperatorSettings(
        gpu_types={
            "l40s": Placement(
                node_selector={"node.kubernetes.io/instance-type": "g6e.xlarge"},
                tolerations=[{"key": "gpu", "operator": "Exists"}],
            )
        }
    )
    # The job names a queue: its pods name the class only once it resolved to a PriorityClass.
    rollout = build_pod(
        job, REF, PodRequest("rollout", 3, "proposer"), settings, Priority("rl-batch", "PriorityClass", 9)
    )
    assert rollout["metadata"]["name"] == "debate-proposer-rollout-3"
    assert rollout["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "g6e.xlarge"}
    assert rollout["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    main_c = rollout["spec"]["containers"][0]
    assert main_c["resources"] == {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}
    assert main_c["command"] == ["polyrl-runtime"]
    config = "/etc/polyrl/config/rljob.json"
    assert main_c["args"] == ["worker", "--config", config, "--role", "rollout", "--policy", "proposer"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in main_c["env"]}
    assert env["POLYRL_COORDINATOR_ADDRESS"] == "debate-coordinator.team-a.svc:6379"
    assert env["RAY_AUTH_TOKEN"] == {"secretKeyRef": {"name": "debate-ray-token", "key": "ray-token"}}
    assert rollout["spec"]["subdomain"] == "debate-proposer-rollout"
    assert rollout["spec"]["priorityClassName"] == "rl-batch"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in rollout["spec"]["volumes"]
    trainer = build_pod(job, REF, PodRequest("trainer", 0, "judge", attempt=2), settings)
    assert trainer["spec"]["nodeSelector"] == {"polyrl.dev/gpu-type": "h100"}  # unmapped name
    assert trainer["metadata"]["labels"][naming.LABEL_ATTEMPT] == "2"
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in trainer["spec"]["containers"][0]["env"]
    coordinator = build_pod(job, REF, PodRequest("coordinator"), settings)
    assert (
        "nodeSelector" not in coordinator["spec"] and "resources" not in coordinator["spec"]["containers"][0]
    )


def test_pod_template_override_merges_strategically() -> None:
    body = stored_job()
    body["spec"]["policies"][0]["trainer"]["podTemplate"] = {
        "metadata": {"labels": {"team": "a"}, "annotations": {"note": "x"}},
        "spec": {
            "containers": [{"name": "main", "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}],
            "tolerations": [{"key": "spot", "operator": "Exists"}],
            "serviceAccountName": "trainer",
        },
    }
    job = RLJob.model_validate(body | {"metadata": {"name": "signal-game"}})
    pod = build_pod(
        job, JobRef("signal-game", "ns", "u"), PodRequest("trainer", 0, "speaker"), OperatorSettings()
    )
    [c] = pod["spec"]["containers"]
    assert [m["name"] for m in c["volumeMounts"]] == ["config", "podinfo", "scratch", "data"]
    assert c["image"] == OperatorSettings().default_image
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["config", "podinfo", "scratch", "data"]
    assert pod["spec"]["serviceAccountName"] == "trainer"
    assert (
        pod["metadata"]["labels"]["team"] == "a" and pod["metadata"]["labels"][naming.LABEL_ROLE] == "trainer"
    )


def test_strategic_merge_rules() -> None:
    base = {
        "a": {"b": 1, "c": 2},
        "env": [{"name": "X", "value": "1"}],
        "tolerations": [{"k": 1}],
        "args": [1],
    }
    out = strategic_merge(
        base,
        {
            "a": {"c": None, "d": 3},
            "env": [{"name": "X", "value": "2"}, {"name": "Y"}],
            "tolerations": [{"k": 2}],
            "args": [2],
        },
    )
    assert out == {
        "a": {"b": 1, "d": 3},
        "env": [{"name": "X", "value": "2"}, {"name": "Y"}],
        "tolerations": [{"k": 1}, {"k": 2}],
        "args": [2],
    }
    assert base["a"] == {"b": 1, "c": 2}


def test_hash_ignores_mutable_annotations_only() -> None:
    pod = build_pod(gpu_model(), REF, PodRequest("coordinator"), OperatorSettings())
    digest = manifest_hash(pod)
    pod["metadata"]["annotations"][naming.ANNOTATION_DRAIN] = "true"
    assert manifest_hash(pod) == digest
    pod["spec"]["containers"][0]["image"] = "other"
    assert manifest_hash(pod) != digest


def test_workload_has_one_podset_per_role_at_max_count() -> None:
    wl = build_workload(gpu_model(), REF, OperatorSettings(), active=True)
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2"
    names = [p["name"] for p in wl["spec"]["podSets"]]
    assert names[:2] == ["coordinator", "workflow"] and len(names) == 8
    proposer = next(p for p in wl["spec"]["podSets"] if p["name"] == "proposer-rollout")
    assert proposer["count"] == 8
    assert "hostname" not in proposer["template"]["spec"]


def test_config_map_is_the_rljob_the_runtime_parses() -> None:
    job = gpu_model()
    config = runtime_config(job, REF)
    again = RLJob.model_validate_json(json.dumps(config))
    assert again.spec == job.spec


PARAMS = Autoscale(backlog_high=4, utilisation_low=0.3, out_window=30, in_window=120, cooldown=60)


def test_autoscale_scales_out_only_after_the_window_and_respects_max() -> None:
    busy = Signals(backlog=40, utilisation=1.0, ready=2)
    d = decide(2, 1, 8, signals=busy, state=ScaleState(), now=0, params=PARAMS)
    assert d.desired == 2 and d.state.high_since == 0
    d = decide(2, 1, 8, signals=busy, state=d.state, now=29, params=PARAMS)
    assert d.desired == 2
    d = decide(2, 1, 8, signals=busy, state=d.state, now=30, params=PARAMS)
    assert d.desired == 8 and d.reason is not None  # ceil(40 / 4) = 10, capped at 8
    assert decide(2, 1, 3, signals=busy, state=ScaleState(high_since=0), now=31, params=PARAMS).desired == 3


def test_autoscale_hysteresis_and_cooldown() -> None:
    idle = Signals(backlog=0, utilisation=0.1, ready=3)
    mid = Signals(backlog=2, utilisation=0.5, ready=3)  # between the marks: no change either way
    state = ScaleState(last_change=0)
    assert decide(3, 1, 8, signals=idle, state=state, now=30, params=PARAMS).desired == 3  # cooldown
    d = decide(3, 1, 8, signals=idle, state=ScaleState(), now=100, params=PARAMS)
    d = decide(3, 1, 8, signals=mid, state=d.state, now=200, params=PARAMS)
    assert d.desired == 3 and d.state.low_since is None  # the window restarted
    d = decide(3, 1, 8, signals=idle, state=d.state, now=300, params=PARAMS)
    d = decide(3, 1, 8, signals=idle, state=d.state, now=420, params=PARAMS)
    assert d.desired == 2  # one at a time
    assert decide(1, 1, 8, signals=idle, state=ScaleState(low_since=0), now=1000, params=PARAMS).desired == 1
    assert (
        decide(
            3, 1, 8, signals=Signals(40, 1.0, ready=2), state=ScaleState(high_since=0), now=99, params=PARAMS
        ).desired
        == 3
    )
    assert decide(0, 2, 8, signals=None, state=ScaleState(), now=0, params=PARAMS).desired == 2


def test_conditions_keep_transition_time_until_status_flips() -> None:
    conds = set_conditions([], {"Ready": (False, "Creating", "")}, generation=1, now=T0)
    same = set_conditions(conds, {"Ready": (False, "PodsNotReady", "x")}, generation=2, now=later(10))
    assert same[0].last_transition_time == conds[0].last_transition_time and same[0].reason == "PodsNotReady"
    flipped = set_conditions(same, {"Ready": (True, "PodsReady", "")}, generation=2, now=later(20))
    assert flipped[0].last_transition_time == "2026-01-01T12:00:20Z"
    ordered = set_conditions(
        flipped, {"Failed": (False, "NotFailed", ""), "Admitted": (True, "NoQueue", "")}, generation=2, now=T0
    )
    assert [c.type for c in ordered] == ["Admitted", "Ready", "Failed"]


def test_merge_patch_is_minimal_and_removes_keys() -> None:
    assert merge_patch({"a": 1, "b": {"c": 1, "d": 2}}, {"a": 1, "b": {"c": 1}}) == {"b": {"d": None}}
    assert merge_patch({"x": [1]}, {"x": [1]}) == {}
    assert merge_patch({"x": [1]}, {"x": [2], "y": 3}) == {"x": [2], "y": 3}


def test_paths() -> None:
    assert path_for("v1", "Pod", "ns", "p") == "/api/v1/namespaces/ns/pods/p"
    assert (
        path_for("polyrl.dev/v1alpha1", "RLJob", "ns", "j", "status")
        == "/apis/polyrl.dev/v1alpha1/namespaces/ns/rljobs/j/status"
    )
    assert (
        path_for("kueue.x-k8s.io/v1beta2", "ResourceFlavor", "ns", "f")
        == "/apis/kueue.x-k8s.io/v1beta2/resourceflavors/f"
    )


@pytest.mark.parametrize("sample", sorted(p.stem for p in PROGRESS_SAMPLES.glob("*.json")))
def test_recorded_progress_samples_parse(sample: str) -> None:
    doc = Progress.model_validate_json((PROGRESS_SAMPLES / f"{sample}.json").read_text())
    assert doc.schema_version == 1
    assert Progress.model_validate(doc.to_wire()) == doc


def test_settings_file(tmp_path: Path) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text(
        "defaultImage: img:1\ngpuTypes:\n  h100: {nodeSelector: {pool: h100}}\nautoscale: {cooldown: 5}\n"
    )
    settings = load_settings(path)
    assert settings.default_image == "img:1" and settings.autoscale.cooldown == 5
    assert settings.placement("h100").node_selector == {"pool": "h100"}
    assert settings.placement("a10").node_selector == {"polyrl.dev/gpu-type": "a10"}


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_render_prints_what_the_operator_creates(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(path), "-n", "demo"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    kinds = [d["kind"] for d in docs]
    assert kinds.index("ConfigMap") < kinds.index("Pod")
    assert all(d["metadata"]["namespace"] in ("demo", "team-a") for d in docs)
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert secret["stringData"]["ray-token"].startswith("<")
    body = yaml.safe_load(path.read_text())
    assert render(body, OperatorSettings()) == render(body, OperatorSettings())  # deterministic


def test_render_rejects_what_the_operator_would_reject(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = stored_job()
    body["spec"]["workflow"]["podTemplate"] = {"spec": {"restartPolicy": "OnFailure"}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(body))
    assert main(["render", str(path)]) == 1
    assert "spec.workflow.podTemplate.spec.restartPolicy" in capsys.readouterr().err


def test_every_pod_runs_as_the_jobs_own_account_with_the_restricted_profile() -> None:
    job = gpu_model()
    for role, policy in (
        ("coordinator", None),
        ("workflow", None),
        ("rollout", "proposer"),
        ("trainer", "judge"),
    ):
        pod = build_pod(job, REF, PodRequest(role, 0, policy), OperatorSettings())  # type: ignore[arg-type]
        spec = pod["spec"]
        assert (
            spec["serviceAccountName"] == "debate-runtime" and spec["automountServiceAccountToken"] is False
        )
        assert spec["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        [c] = spec["containers"]
        assert c["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        assert {"name": "scratch", "mountPath": "/tmp"} in c["volumeMounts"]
        [token] = [e for e in c["env"] if e["name"] == "RAY_AUTH_TOKEN"]
        assert token == {
            "name": "RAY_AUTH_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "debate-ray-token", "key": "ray-token"}},
        }


def test_pod_security_settings_apply_per_role() -> None:
    settings = OperatorSettings.model_validate(
        {"podSecurity": {"runAsUser": 2000, "readOnlyRootFilesystem": {"workflow": False}}}
    )
    job = gpu_model()
    workflow = build_pod(job, REF, PodRequest("workflow", 0), settings)
    trainer = build_pod(job, REF, PodRequest("trainer", 0, "judge"), settings)
    assert workflow["spec"]["securityContext"]["runAsUser"] == 2000
    assert workflow["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is False
    assert trainer["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is False  # unlisted


def test_network_policies_and_service_account_of_a_job() -> None:
    from polyrl_operator.builders import build_network_policies, build_service_account

    sa = build_service_account(REF)
    assert sa["metadata"]["name"] == "debate-runtime" and sa["automountServiceAccountToken"] is False
    settings = OperatorSettings.model_validate(
        {
            "networkPolicy": {
                "operatorNamespace": "ops",
                "operatorPodLabels": {"app": "op"},
                "extraIngress": [{"from": [{"namespaceSelector": {}}]}],
            }
        }
    )
    isolation, progress = build_network_policies(REF, settings)
    assert isolation["metadata"]["name"] == "debate-isolation"
    assert isolation["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {naming.LABEL_JOB: "debate"}}}]},
        {"from": [{"namespaceSelector": {}}]},
    ]
    assert progress["spec"]["podSelector"]["matchLabels"] == naming.selector("debate", "coordinator")
    [rule] = progress["spec"]["ingress"]
    assert rule == {
        "from": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
                "podSelector": {"matchLabels": {"app": "op"}},
            }
        ],
        "ports": [{"protocol": "TCP", "port": naming.PORT_HTTP}],
    }
    off = OperatorSettings.model_validate({"networkPolicy": {"enabled": False}})
    assert build_network_policies(REF, off) == []
    assert "NetworkPolicy" not in off.child_kinds()


def test_operator_namespace_comes_from_the_pod_unless_set() -> None:
    from polyrl_operator.cli import with_own_namespace

    assert OperatorSettings().network_policy.namespace() == "polyrl-system"
    mine = with_own_namespace(OperatorSettings(), "ops")
    assert mine.network_policy.namespace() == "ops"
    pinned = OperatorSettings.model_validate({"networkPolicy": {"operatorNamespace": "admin"}})
    assert with_own_namespace(pinned, "ops").network_policy.namespace() == "admin"


def test_kueue_off_rejects_jobs_that_name_a_queue(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    settings = tmp_path / "settings.yaml"
    settings.write_text("kueue: {enabled: false}\n")
    assert main(["render", str(EXAMPLES / "debate-gpu.yaml"), "--settings", str(settings)]) == 1
    assert "spec.scheduling.queueName" in capsys.readouterr().err
    off = OperatorSettings.model_validate({"kueue": {"enabled": False}})
    assert "Workload" not in off.child_kinds()
    assert main(["render", str(EXAMPLES / "signal-game-cpu.yaml"), "--settings", str(settings)]) == 0


def test_pvc_uris_mount_their_claims_where_the_runtime_looks() -> None:
    doc = stored_job()
    doc["spec"]["checkpoint"]["uri"] = "pvc://ckpt/runs/signal"
    doc["spec"]["policies"][0]["model"]["uri"] = "pvc://models/speaker"
    job = RLJob.model_validate(doc)

    def mounts(role: Any, policy: str | None) -> tuple[dict[str, Any], dict[str, str]]:
        pod = build_pod(job, REF, PodRequest(role, 0, policy), OperatorSettings())
        claims = {
            v["name"]: v["persistentVolumeClaim"]
            for v in pod["spec"]["volumes"]
            if "persistentVolumeClaim" in v
        }
        main_c = pod["spec"]["containers"][0]
        by_claim = {claims[m["name"]]["claimName"]: m for m in main_c["volumeMounts"] if m["name"] in claims}
        env = {e["name"]: e.get("value") for e in main_c["env"]}
        return by_claim, json.loads(env.get("POLYRL_PVC_MOUNTS") or "{}")

    # the checkpoint claim on the coordinator and every trainer (each rank writes its shard)
    coord, coord_env = mounts("coordinator", None)
    assert {c: m["mountPath"] for c, m in coord.items()} == {"ckpt": "/mnt/polyrl/pvc/ckpt"} == coord_env
    trainer, trainer_env = mounts("trainer", "speaker")
    assert set(trainer) == {"ckpt", "models"} and not any(m["readOnly"] for m in trainer.values())
    assert trainer_env == {"ckpt": "/mnt/polyrl/pvc/ckpt", "models": "/mnt/polyrl/pvc/models"}
    # the model claim read-only on the policy's engines; nothing on pods that need no claim
    rollout, _ = mounts("rollout", "speaker")
    assert list(rollout) == ["models"] and rollout["models"]["readOnly"] is True
    assert mounts("rollout", "listener") == ({}, {}) and mounts("workflow", None) == ({}, {})
    assert mounts("trainer", "listener")[1] == {"ckpt": "/mnt/polyrl/pvc/ckpt"}
