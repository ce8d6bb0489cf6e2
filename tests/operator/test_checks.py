"""The operator's own checks (``polyrl_operator.checks``) on top of the CRD's."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyrl_operator.cli import main
from polyrl_operator.settings import OperatorSettings
from polyrl_testenv.bad_rljobs import EXAMPLES


def test_kueue_off_rejects_jobs_that_name_a_queue(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    settings = tmp_path / "settings.yaml"
    settings.write_text("kueue: {enabled: false}\n")
    assert main(["render", str(EXAMPLES / "debate-gpu.yaml"), "--settings", str(settings)]) == 1
    assert "spec.scheduling.queueName" in capsys.readouterr().err
    off = OperatorSettings.model_validate({"kueue": {"enabled": False}})
    assert "Workload" not in off.child_kinds()
    assert main(["render", str(EXAMPLES / "signal-game-cpu.yaml"), "--settings", str(settings)]) == 0
