"""The job's ConfigMap (``polyrl_operator.builders.config``): the RLJob as the runtime parses it, for
every example."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from polyrl_operator.api import RLJob
from polyrl_operator.builders import JobRef, build_config_map, runtime_config
from polyrl_operator.pod_contract import CONFIG_FILE
from polyrl_testenv.bad_rljobs import EXAMPLES

REF = JobRef("debate", "team-a", "uid-1")


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_config_map_is_the_rljob_the_runtime_parses(path: Path) -> None:
    job = RLJob.model_validate(yaml.safe_load(path.read_text()))
    again = RLJob.model_validate_json(json.dumps(runtime_config(job, REF)))
    assert again.spec == job.spec
    mounted = build_config_map(job, REF)["data"][CONFIG_FILE]
    assert RLJob.model_validate_json(mounted).spec == job.spec
