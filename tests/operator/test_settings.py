"""Operator settings (``polyrl_operator.settings``): the file, and the kinds of children the settings
turn on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from polyrl_operator.settings import OperatorSettings, load_settings


def test_settings_file(tmp_path: Path) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text(
        "defaultImage: img:1\ngpuTypes:\n  h100: {nodeSelector: {pool: h100}}\nautoscale: {cooldown: 5}\n"
    )
    settings = load_settings(path)
    assert settings.default_image == "img:1" and settings.autoscale.cooldown == 5
    assert settings.placement("h100").node_selector == {"pool": "h100"}
    assert settings.placement("a10").node_selector == {"polyrl.dev/gpu-type": "a10"}


GATES: list[tuple[str, dict[str, Any], str, bool]] = [
    ("NetworkPolicies by default", {}, "NetworkPolicy", True),
    ("NetworkPolicies off", {"networkPolicy": {"enabled": False}}, "NetworkPolicy", False),
    ("Kueue off: no Workload", {"kueue": {"enabled": False}}, "Workload", False),
]


@pytest.mark.parametrize(("case", "settings", "kind", "created"), GATES, ids=[g[0] for g in GATES])
def test_settings_gate_child_kinds(case: str, settings: dict[str, Any], kind: str, created: bool) -> None:
    assert (kind in OperatorSettings.model_validate(settings).child_kinds()) is created
