"""The API client's pure helpers (``polyrl_operator.kube``): merge patches and REST paths."""

from __future__ import annotations

from polyrl_operator.kube import merge_patch, path_for


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
