"""The storage layer against a genuine S3 server (SeaweedFS on loopback) and the local file system."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from polyrl_runtime import storage
from polyrl_runtime.storage import StorageError


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _write_tree(root: Path) -> dict[str, bytes]:
    files = {
        "config.json": b'{"a": 1}',
        "sub/weights.bin": os.urandom(300_000),
        "sub/deeper/empty.txt": b"",
        "sub/deeper/x.txt": b"x",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_a_tree_round_trips_through_s3_and_is_listed_and_removed(bucket: str, tmp_path: Path) -> None:
    files = _write_tree(tmp_path / "src")
    uri = f"s3://{bucket}/runs/one"
    assert storage.put_tree(tmp_path / "src", uri) == 4
    assert storage.list_names(uri) == ["config.json", "sub"]
    assert storage.list_names(f"s3://{bucket}/runs") == ["one"]
    assert storage.exists(storage.join(uri, "sub", "weights.bin"))
    assert storage.get_tree(uri, tmp_path / "dst") == 4
    assert _tree(tmp_path / "dst") == files
    storage.write_bytes(storage.join(uri, "state.json"), b"{}")
    assert storage.read_bytes(storage.join(uri, "state.json")) == b"{}"
    storage.remove_tree(uri)
    assert storage.list_names(f"s3://{bucket}/runs") == []
    assert not storage.exists(storage.join(uri, "config.json"))
    storage.remove_tree(uri)  # nothing there: not an error


def test_staged_dir_uploads_on_success_only_and_fetched_dir_downloads(bucket: str, tmp_path: Path) -> None:
    uri = f"s3://{bucket}/staged"
    with pytest.raises(RuntimeError, match="boom"), storage.staged_dir(uri) as d:
        (d / "partial").write_text("never uploaded")
        raise RuntimeError("boom")
    assert storage.list_names(uri) == []
    with storage.staged_dir(uri) as d:
        staging = d
        (d / "a" / "b").mkdir(parents=True)
        (d / "a" / "b" / "c.txt").write_text("c")
    assert not staging.exists()  # the staging directory is removed after the upload
    with storage.fetched_dir(uri) as got:
        assert (got / "a" / "b" / "c.txt").read_text() == "c"
    assert not got.exists()


def test_local_locations_are_used_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYRL_PVC_MOUNTS", json.dumps({"models": str(tmp_path / "mnt")}))
    assert storage.local_path("pvc://models/a/b") == tmp_path / "mnt" / "a" / "b"
    assert storage.local_path("file:///x/y") == Path("/x/y")
    with storage.staged_dir(str(tmp_path / "out")) as d:
        assert d == tmp_path / "out"
        (d / "f").write_text("f")
    assert storage.list_names(str(tmp_path / "out")) == ["f"]
    with pytest.raises(ValueError, match="s3://b/k: not a local URI"):
        storage.local_path("s3://b/k")


def test_wrong_credentials_are_a_clear_error_naming_the_uri_and_the_secret(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage.write_bytes(f"s3://{bucket}/k/file", b"1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    monkeypatch.setenv("POLYRL_CREDENTIALS_SECRET", "team-s3")
    with pytest.raises(StorageError) as e:
        storage.get_tree(f"s3://{bucket}/k", tmp_path / "dst")
    message = str(e.value)
    assert message.startswith(f"s3://{bucket}/k: downloading failed: access denied"), message
    assert "check the credentials Secret team-s3" in message
    assert "not-the-secret" not in message
    monkeypatch.delenv("POLYRL_CREDENTIALS_SECRET")
    with pytest.raises(
        StorageError, match=r"access denied .*check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
    ):
        storage.read_bytes(f"s3://{bucket}/k/file")


def test_a_missing_key_or_bucket_is_a_clear_error(bucket: str, tmp_path: Path) -> None:
    with pytest.raises(StorageError, match=rf"s3://{bucket}/nothing: reading failed: no such bucket or key"):
        storage.read_bytes(f"s3://{bucket}/nothing")
    with pytest.raises(StorageError, match="s3://no-such-bucket-xyz/m: downloading failed: no objects"):
        storage.get_tree("s3://no-such-bucket-xyz/m", tmp_path / "dst")
    with pytest.raises(StorageError, match="no bucket in the URI"):
        storage.list_names("s3://")


def test_cached_copy_downloads_once_and_again_when_the_objects_change(bucket: str, tmp_path: Path) -> None:
    _write_tree(tmp_path / "src")
    uri = f"s3://{bucket}/model"
    storage.put_tree(tmp_path / "src", uri)
    first = storage.cached_copy(uri)
    assert first.parent == storage.cache_root() / "objects"
    assert (first / "sub" / "deeper" / "x.txt").read_text() == "x"
    marker = first / "sub" / "deeper" / "x.txt"
    inode = marker.stat().st_ino
    assert storage.cached_copy(uri + "/") == first and marker.stat().st_ino == inode  # not downloaded again
    storage.write_bytes(storage.join(uri, "sub", "deeper", "x.txt"), b"changed")
    assert storage.cached_copy(uri) == first
    assert marker.read_text() == "changed"
    assert [p.name for p in first.parent.iterdir() if p.name.endswith(".part")] == []
    with pytest.raises(StorageError, match=rf"s3://{bucket}/absent: no objects under this prefix"):
        storage.cached_copy(f"s3://{bucket}/absent")


def test_a_hugging_face_model_loads_from_s3_like_the_local_directory(
    bucket: str, tiny_qwen2_dir: Path
) -> None:
    from polyrl_runtime.models import load_model, load_tokenizer

    uri = f"s3://{bucket}/models/tiny-qwen2"
    storage.put_tree(tiny_qwen2_dir, uri)
    remote = load_model(uri, dtype="float32")
    local = load_model(f"file://{tiny_qwen2_dir}", dtype="float32")
    remote_state, local_state = remote.state_dict(), local.state_dict()
    assert remote_state.keys() == local_state.keys()
    for name, tensor in local_state.items():
        assert torch.equal(remote_state[name], tensor), name
    text = "hello, world"
    assert load_tokenizer(uri).encode(text) == load_tokenizer(f"file://{tiny_qwen2_dir}").encode(text)


def test_a_model_that_cannot_be_read_is_a_model_load_error_naming_the_uri(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from polyrl_runtime.models import ModelLoadError, load_model

    with pytest.raises(ModelLoadError, match=rf"s3://{bucket}/absent: no objects under this prefix"):
        load_model(f"s3://{bucket}/absent", dtype="float32")
    storage.write_bytes(f"s3://{bucket}/m/config.json", b"{}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "someone-else")
    with pytest.raises(ModelLoadError, match=rf"s3://{bucket}/m: listing failed: access denied"):
        load_model(f"s3://{bucket}/m", dtype="float32")
