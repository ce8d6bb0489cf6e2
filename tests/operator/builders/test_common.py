"""What every child manifest shares (``polyrl_operator.builders.common``): the content hash, which
ignores the annotations the operator patches on live pods and nothing else."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from polyrl_operator import naming, pod_contract
from polyrl_operator.api import RLJob
from polyrl_operator.builders import JobRef, PodRequest, build_pod
from polyrl_operator.builders.common import manifest_hash
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv.operator_fixtures import gpu_job


def _annotate(key: str) -> Callable[[dict[str, Any]], None]:
    def change(pod: dict[str, Any]) -> None:
        pod["metadata"]["annotations"][key] = "x"

    return change


def _image(pod: dict[str, Any]) -> None:
    pod["spec"]["containers"][0]["image"] = "other"


HASH_CASES: list[tuple[str, Callable[[dict[str, Any]], None], bool]] = [
    ("the drain request", _annotate(pod_contract.ANNOTATION_DRAIN), True),
    ("the drain's start", _annotate(naming.ANNOTATION_DRAIN_SINCE), True),
    ("the checkpoint request", _annotate(pod_contract.ANNOTATION_CHECKPOINT_REQUEST), True),
    ("the checkpoint request's time", _annotate(naming.ANNOTATION_CHECKPOINT_SINCE), True),
    ("another annotation", _annotate("example.com/note"), False),
    ("the image", _image, False),
]


@pytest.mark.parametrize(("case", "change", "same"), HASH_CASES, ids=[c[0] for c in HASH_CASES])
def test_hash_ignores_mutable_annotations_only(
    case: str, change: Callable[[dict[str, Any]], None], same: bool
) -> None:
    job = RLJob.model_validate({**gpu_job(), "metadata": {"name": "debate", "namespace": "team-a"}})
    pod = build_pod(job, JobRef("debate", "team-a", "uid-1"), PodRequest("coordinator"), OperatorSettings())
    digest = manifest_hash(pod)
    change(pod)
    assert (manifest_hash(pod) == digest) is same
