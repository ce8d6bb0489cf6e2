"""Which policies share a base model (`RLJobSpec.shared_bases`): rollouts on one pool with the same
`model.uri` and `model.dtype`, each either trained with `algorithm.lora` (served as an adapter) or
frozen (served the base alone), two or more with one LoRA policy at least."""

from __future__ import annotations

from typing import Any

import pytest

from polyrl_operator.api import RLJobSpec, SharedBase

QWEN = "builtin://tiny-qwen2"
OTHER = "file:///models/other"

# (name, kind, pool, model uri, dtype); kind: lora (trained, an adapter), full (trained, full
# weights) or frozen.
Member = tuple[str, str, str | None, str, str]


def _spec(*members: Member) -> RLJobSpec:
    policies: list[dict[str, Any]] = []
    for name, kind, pool, uri, dtype in members:
        p: dict[str, Any] = {
            "name": name,
            "model": {"uri": uri, "dtype": dtype},
            "algorithm": {"name": "grpo", "groupSize": 4},
            "rollout": {"engine": "torch", **({"pool": pool} if pool else {"gpus": 0})},
        }
        if kind == "frozen":
            p["frozen"] = True
        else:
            p["trainer"] = {"gpus": 0}
        if kind == "lora":
            p["algorithm"]["lora"] = {"rank": 4}
        policies.append(p)
    pools = sorted({m[2] for m in members if m[2] is not None})
    return RLJobSpec.model_validate(
        {
            "training": {"totalSteps": 2, "episodesPerStep": 8},
            "workflow": {"entrypoint": "polyrl_runtime.workflows.signal:SignalGame"},
            "policies": policies,
            **({"pools": [{"name": q, "gpus": 0} for q in pools]} if pools else {}),
        }
    )


@pytest.mark.parametrize(
    ("members", "expected"),
    [
        pytest.param(
            [("a", "lora", "p", QWEN, "float32"), ("b", "lora", "p", QWEN, "float32")],
            [SharedBase("p", QWEN, "float32", ("a", "b"))],
            id="two-lora-policies",
        ),
        pytest.param(
            [("a", "lora", "p", QWEN, "float32"), ("b", "full", "p", QWEN, "float32")],
            [],
            id="a-full-weight-policy-shares-nothing",
        ),
        pytest.param(
            [("a", "lora", "p", QWEN, "float32"), ("b", "lora", "q", QWEN, "float32")],
            [],
            id="different-pools",
        ),
        pytest.param(
            [("a", "lora", "p", QWEN, "float32"), ("b", "lora", "p", QWEN, "bfloat16")],
            [],
            id="different-dtypes",
        ),
        pytest.param(
            [("a", "lora", None, QWEN, "float32"), ("b", "lora", None, QWEN, "float32")],
            [],
            id="no-pool",
        ),
        pytest.param(
            [("speaker", "lora", "p", QWEN, "float32"), ("listener", "frozen", "p", QWEN, "float32")],
            [SharedBase("p", QWEN, "float32", ("speaker", "listener"), frozen=("listener",))],
            id="one-lora-policy-and-a-frozen-one",
        ),
        pytest.param(
            [
                ("judge", "frozen", "p", QWEN, "float32"),
                ("a", "lora", "p", QWEN, "float32"),
                ("b", "lora", "p", QWEN, "float32"),
            ],
            [SharedBase("p", QWEN, "float32", ("judge", "a", "b"), frozen=("judge",))],
            id="a-frozen-policy-joins-a-group-in-policy-order",
        ),
        pytest.param(
            [
                ("a", "lora", "p", QWEN, "float32"),
                ("x", "frozen", "p", QWEN, "float32"),
                ("y", "frozen", "p", QWEN, "float32"),
            ],
            [SharedBase("p", QWEN, "float32", ("a", "x", "y"), frozen=("x", "y"))],
            id="two-frozen-policies-and-one-lora-policy",
        ),
        pytest.param(
            [
                ("a", "full", "p", QWEN, "float32"),
                ("x", "frozen", "p", QWEN, "float32"),
                ("y", "frozen", "p", QWEN, "float32"),
            ],
            [],
            id="frozen-policies-alone-share-nothing",
        ),
        pytest.param(
            [("a", "lora", "p", QWEN, "float32"), ("x", "frozen", "p", OTHER, "float32")],
            [],
            id="a-frozen-policy-of-another-model",
        ),
        pytest.param(
            [("a", "lora", "p", QWEN, "float32"), ("x", "frozen", "p", QWEN, "bfloat16")],
            [],
            id="a-frozen-policy-of-another-dtype",
        ),
        pytest.param(
            [("a", "lora", "p", QWEN, "float32"), ("x", "frozen", "q", QWEN, "float32")],
            [],
            id="a-frozen-policy-on-another-pool",
        ),
        pytest.param(
            [("a", "lora", "p", QWEN, "float32"), ("x", "frozen", None, QWEN, "float32")],
            [],
            id="a-frozen-policy-on-pods-of-its-own",
        ),
        pytest.param(
            [
                ("a", "lora", "p", QWEN, "float32"),
                ("x", "frozen", "p", QWEN, "float32"),
                ("b", "lora", "q", QWEN, "float32"),
                ("c", "lora", "q", QWEN, "float32"),
            ],
            [
                SharedBase("p", QWEN, "float32", ("a", "x"), frozen=("x",)),
                SharedBase("q", QWEN, "float32", ("b", "c")),
            ],
            id="one-group-per-pool",
        ),
    ],
)
def test_which_policies_share_a_base(members: list[Member], expected: list[SharedBase]) -> None:
    spec = _spec(*members)
    assert spec.shared_bases() == expected
    for name, *_ in members:
        group = spec.shared_base(name)
        assert group == next((b for b in expected if name in b.policies), None)
    for base in expected:
        assert base.trained == tuple(n for n in base.policies if n not in base.frozen)
        assert base.trained  # a group has a policy served as an adapter
