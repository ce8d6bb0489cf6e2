"""Driver tests share the session's Ray (tests/runtime/conftest.py): actors are placed without the
polyrl/<policy>/<role> resources there; `polyrl run` and the multi-process test cover placement."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
DATA = Path(__file__).parent.parent / "data"


@pytest.fixture
def ray_local(ray_session: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The session's Ray, with the test data folder importable here (the session's workers have it
    on their PYTHONPATH: tests/runtime/conftest.py)."""
    monkeypatch.syspath_prepend(str(DATA))
    yield ray_session
    sys.modules.pop("faulty_workflows", None)
