"""Jobs whose weights reach their engines as deltas: through storage (weightSync.transport storage, a
genuine S3 server on loopback: whole versions and deltas written under the URI) and over collective
(weightSync.deltas); every engine serves exactly the trainer's weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from driver_harness import make_job, run

from polyrl_runtime import storage
from polyrl_runtime.weights.storage import policy_root

pytestmark = pytest.mark.slow


def test_a_sync_job_through_s3_serves_exactly_the_trainers_weights(
    ray_local: Any, bucket: str, tmp_path: Path
) -> None:
    uri = f"s3://{bucket}/weights/selfplay"
    job = make_job(
        mode="sync",
        maxStaleness=0,
        training={"totalSteps": 4},
        weightSync={"transport": "storage", "uri": uri, "fullEvery": 2},
    )
    _, summary = run(job, tmp_path)
    assert summary.state == "done", summary.message
    assert summary.steps == {"agent": 4}
    for rec in summary.records:
        # behaviour logprobs (engine) == proximal logprobs (trainer): the engine applied each
        # version (a whole one or a delta) bit for bit
        assert rec.staleness_max == 0 and rec.is_weight_mean == pytest.approx(1.0, abs=1e-3), rec
    # Versions 0-4: whole 0, 2 and 4 and the deltas 1 and 3; the generation before the newest whole
    # version's (2, 3) is kept for engines still reading it, the older one (0, 1) is gone.
    names = storage.list_names(policy_root(uri, "agent"))
    assert names == ["v000000000002.whole", "v000000000003.delta", "v000000000004.whole"], names


def test_a_sync_job_with_collective_deltas_serves_exactly_the_trainers_weights(
    ray_local: Any, tmp_path: Path
) -> None:
    job = make_job(
        mode="sync",
        maxStaleness=0,
        training={"totalSteps": 3},
        weightSync={"transport": "collective", "deltas": 1},
    )
    driver, summary = run(job, tmp_path)
    assert summary.state == "done", summary.message
    for rec in summary.records:  # each version after the first arrived as deltas, bit for bit
        assert rec.staleness_max == 0 and rec.is_weight_mean == pytest.approx(1.0, abs=1e-3), rec
    manifest = driver.registry.latest("agent")
    assert manifest is not None and manifest.version == 3 and manifest.deltas
