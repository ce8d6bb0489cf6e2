"""One storage layer for models and checkpoints: `file://`, `pvc://` and `s3://` URIs.

`file://P` and `pvc://CLAIM/P` are local directories (a claim is mounted where `POLYRL_PVC_MOUNTS`
says); code reads and writes them in place. `s3://BUCKET/PREFIX` is an object store reached through
fsspec's s3fs: a directory is the set of objects under `PREFIX/`, copied as a tree. Writers stage a
tree in a local directory and upload it (`staged_dir`); readers download a tree to a local directory
(`fetched_dir`, or `cached_copy` for models, downloaded once per host and URI).

Credentials and endpoint come from the environment, as every AWS client reads them:
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION` / `AWS_DEFAULT_REGION`,
and `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` for S3-compatible servers. In a cluster they come from
the Secret the RLJob names in `spec.storage.credentialsSecret` (every pod's environment); the operator
also sets `POLYRL_CREDENTIALS_SECRET` to its name so that errors can point at it. Credentials are
never logged and never passed through Ray (its runtime-env agent logs what it is given): each
process reads its own environment.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import structlog

from polyrl_operator import pod_contract as contract
from polyrl_runtime.waiting import lock_deadline_s, locked

log = structlog.get_logger(__name__)

OBJECT_STORE_SCHEMES = ("s3://",)
LOCAL_SCHEMES = ("file://", "pvc://")
_MANIFEST = ".polyrl-manifest.json"


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URI and what went wrong."""


class NotFoundError(StorageError):
    """The bucket or key does not exist."""


def is_object_store(uri: str | Path) -> bool:
    return str(uri).startswith(OBJECT_STORE_SCHEMES)


def local_path(uri: str) -> Path:
    """file:///P -> /P; pvc://CLAIM/P -> <where this pod mounts CLAIM>/P.

    The operator mounts each claim a pod needs and names the mount points in `POLYRL_PVC_MOUNTS`
    (JSON, claim -> path; /mnt/polyrl/pvc/CLAIM when unset, as in docs/runtime-contract.md)."""
    if uri.startswith("file://"):
        return Path(uri.removeprefix("file://"))
    if uri.startswith("pvc://"):
        claim, _, rest = uri.removeprefix("pvc://").partition("/")
        mounts = json.loads(os.environ.get(contract.ENV_PVC_MOUNTS) or "{}")
        return Path(mounts.get(claim, f"{contract.PVC_ROOT}/{claim}")) / rest
    raise ValueError(f"{uri}: not a local URI (file:// or pvc://)")


def join(base: str | Path, *parts: str) -> str:
    """`base` (a local path or an object-store URI) with `parts` appended, '/'-separated."""
    if not is_object_store(base):
        return str(Path(base).joinpath(*parts))
    return "/".join([str(base).rstrip("/"), *parts])


def cache_root() -> Path:
    """Where downloads are kept on this host: `$POLYRL_CACHE`, else ~/.cache/polyrl."""
    return Path(os.environ.get("POLYRL_CACHE") or Path.home() / ".cache" / "polyrl")


# -- the object store ---------------------------------------------------------------------------


def _filesystem() -> Any:
    """An s3fs filesystem configured from the environment.

    Credentials and endpoint are passed explicitly so that fsspec's instance cache (keyed by these
    arguments) never hands out a filesystem built with other credentials. Listings are not cached:
    other processes (trainer ranks, the coordinator) write the same prefixes."""
    try:
        s3fs: Any = importlib.import_module("s3fs")
    except ImportError as e:  # pragma: no cover - s3fs is a runtime dependency
        raise StorageError("s3:// needs the `s3fs` package") from e
    env = os.environ
    client: dict[str, str] = {}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        client["endpoint_url"] = endpoint
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        client["region_name"] = region
    return s3fs.S3FileSystem(
        key=env.get("AWS_ACCESS_KEY_ID"),
        secret=env.get("AWS_SECRET_ACCESS_KEY"),
        token=env.get("AWS_SESSION_TOKEN"),
        client_kwargs=client,
        use_listings_cache=False,
    )


def _key(uri: str) -> str:
    """`s3://bucket/prefix/` -> `bucket/prefix` (what s3fs calls a path)."""
    key = uri.removeprefix("s3://").strip("/")
    if not key:
        raise StorageError(f"{uri}: no bucket in the URI (s3://BUCKET/PREFIX)")
    return key


def _explain(uri: str, what: str, e: BaseException) -> StorageError:
    """A StorageError naming the URI, the operation and the likely cause."""
    secret = os.environ.get(contract.ENV_CREDENTIALS_SECRET)
    where = f"the credentials Secret {secret}" if secret else "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
    if isinstance(e, PermissionError):
        cause = f"access denied ({e}); check {where}"
    elif isinstance(e, FileNotFoundError):
        cause = "no such bucket or key"
    elif type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        cause = f"no credentials; set {where}"
    elif type(e).__name__ in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError"):
        cause = f"cannot reach the endpoint ({e}); check AWS_ENDPOINT_URL"
    else:
        cause = f"{type(e).__name__}: {e}"
    kind = NotFoundError if isinstance(e, FileNotFoundError) else StorageError
    return kind(f"{uri}: {what} failed: {cause}")


@contextlib.contextmanager
def _errors(uri: str, what: str) -> Iterator[None]:
    try:
        yield
    except StorageError:
        raise
    except Exception as e:
        raise _explain(uri, what, e) from e


def _objects(fs: Any, uri: str) -> dict[str, dict[str, Any]]:
    """The objects under `uri` as a tree: relative path -> s3fs's info (size, ETag)."""
    base = _key(uri)
    try:
        found: dict[str, dict[str, Any]] = fs.find(base, detail=True)
    except FileNotFoundError:
        return {}
    return {
        k[len(base) + 1 :]: v for k, v in found.items() if k.startswith(base + "/") and v["type"] == "file"
    }


def list_names(uri: str) -> list[str]:
    """The names directly under `uri` (files and directories), sorted; [] when there are none.

    For an object store a directory exists only while objects are under it (some S3 servers keep
    empty directory entries after their objects are deleted; they are not listed)."""
    if not is_object_store(uri):
        path = Path(uri)
        return sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    with _errors(uri, "listing"):
        objects = _objects(_filesystem(), uri)
    return sorted({rel.split("/", 1)[0] for rel in objects})


def exists(uri: str) -> bool:
    if not is_object_store(uri):
        return Path(uri).exists()
    with _errors(uri, "checking"):
        return bool(_filesystem().exists(_key(uri)))


def read_bytes(uri: str) -> bytes:
    if not is_object_store(uri):
        return Path(uri).read_bytes()
    with _errors(uri, "reading"):
        data: bytes = _filesystem().cat_file(_key(uri))
    return data


def write_bytes(uri: str, data: bytes) -> None:
    if not is_object_store(uri):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
        Path(uri).write_bytes(data)
        return
    with _errors(uri, "writing"):
        _filesystem().pipe_file(_key(uri), data)


def put_tree(local: Path, uri: str) -> int:
    """Upload every file under `local` to `uri` (same relative paths); the number of files."""
    files = sorted(p for p in Path(local).rglob("*") if p.is_file())
    if not files:
        return 0
    base = _key(uri)
    with _errors(uri, "uploading"):
        _filesystem().put(
            [str(p) for p in files], [f"{base}/{p.relative_to(local).as_posix()}" for p in files]
        )
    log.debug("storage.uploaded", uri=uri, files=len(files))
    return len(files)


def get_tree(uri: str, local: Path) -> int:
    """Download every object under `uri` into `local`; the number of files. An empty or missing
    prefix is an error: a directory the caller expects is not there."""
    fs = _filesystem()
    with _errors(uri, "downloading"):
        objects = _objects(fs, uri)
        if not objects:
            raise NotFoundError(f"{uri}: downloading failed: no objects under this prefix")
        base = _key(uri)
        rels = sorted(objects)
        for rel in rels:
            (Path(local) / rel).parent.mkdir(parents=True, exist_ok=True)
        fs.get([f"{base}/{r}" for r in rels], [str(Path(local) / r) for r in rels])
    log.debug("storage.downloaded", uri=uri, files=len(rels))
    return len(rels)


def remove_file(uri: str) -> None:
    """Remove one file or object; a missing one is not an error."""
    if not is_object_store(uri):
        Path(uri).unlink(missing_ok=True)
        return
    with _errors(uri, "removing"), contextlib.suppress(FileNotFoundError):
        _filesystem().rm_file(_key(uri))


def remove_tree(uri: str) -> None:
    """Remove `uri` and everything under it; nothing there is not an error."""
    if not is_object_store(uri):
        shutil.rmtree(uri, ignore_errors=True)
        return
    fs = _filesystem()
    with _errors(uri, "removing"):
        keys = [f"{_key(uri)}/{rel}" for rel in _objects(fs, uri)]
        if keys:
            fs.rm(keys)


# -- staging: local directories for object-store trees -------------------------------------------


@contextlib.contextmanager
def staged_dir(location: str) -> Iterator[Path]:
    """A local directory to write the tree for `location` into. For an object store, a temporary
    directory uploaded when the block ends without an error (and removed either way); for a local
    location, the directory itself."""
    if not is_object_store(location):
        Path(location).mkdir(parents=True, exist_ok=True)
        yield Path(location)
        return
    with tempfile.TemporaryDirectory(prefix="polyrl-stage-") as tmp:
        yield Path(tmp)
        put_tree(Path(tmp), location)


@contextlib.contextmanager
def fetched_dir(location: str) -> Iterator[Path]:
    """A local directory holding the tree at `location` for the duration of the block."""
    if not is_object_store(location):
        yield Path(location)
        return
    with tempfile.TemporaryDirectory(prefix="polyrl-fetch-") as tmp:
        get_tree(location, Path(tmp))
        yield Path(tmp)


def cached_object(uri: str) -> Path:
    """A local copy of the one object at `uri` (say, a GGUF model file), downloaded once per host into
    `<cache_root>/objects/<hash of the URI>/<its name>`, with `cached_copy`'s invariants (downloaded
    again when its size or ETag changed)."""
    fs = _filesystem()
    with _errors(uri, "checking"):
        info = fs.info(_key(uri))
    if info.get("type") != "file":
        raise NotFoundError(f"{uri}: not an object (a prefix with objects under it?)")
    file_name = _key(uri).rsplit("/", 1)[-1]

    def download(part: Path) -> None:
        with _errors(uri, "downloading"):
            fs.get_file(_key(uri), str(part / file_name))

    return _cached(uri, {"size": info.get("size"), "ETag": info.get("ETag")}, download) / file_name


def cached_copy(uri: str) -> Path:
    """A local copy of the tree at `uri`, downloaded once per host into
    `<cache_root>/objects/<hash of the URI>`.

    Invariants: the copy is complete whenever it exists (downloaded beside it, then renamed); one
    process downloads while others wait (an exclusive file lock per URI); a copy whose listing (keys,
    sizes, ETags) no longer matches the store is downloaded again."""
    fs = _filesystem()
    with _errors(uri, "listing"):
        listing = {rel: [info.get("size"), info.get("ETag")] for rel, info in _objects(fs, uri).items()}
    if not listing:
        raise NotFoundError(f"{uri}: no objects under this prefix (no such bucket or key)")
    return _cached(uri, listing, lambda part: get_tree(uri, part))


def _cached(uri: str, listing: Any, download: Callable[[Path], Any]) -> Path:
    """`<cache_root>/objects/<hash of uri>`, filled by `download(directory)` unless it holds the
    download of the same `listing` already (see `cached_copy`)."""
    objects_dir = cache_root() / "objects"
    objects_dir.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:32]
    dest = objects_dir / name
    lock_path = objects_dir / f"{name}.lock"
    with (
        lock_path.open("w") as lock,
        locked(lock, lock_path, what=f"download of {uri}", deadline_s=lock_deadline_s()),
    ):
        manifest = dest / _MANIFEST
        if manifest.is_file() and json.loads(manifest.read_text()) == listing:
            return dest
        part = Path(tempfile.mkdtemp(prefix=f"{name}.", suffix=".part", dir=objects_dir))
        try:
            download(part)
            (part / _MANIFEST).write_text(json.dumps(listing, sort_keys=True))
            if dest.exists():
                shutil.rmtree(dest)
            part.rename(dest)
        finally:
            shutil.rmtree(part, ignore_errors=True)
        log.info(
            "storage.cached", uri=uri, path=str(dest), files=sum(p.is_file() for p in dest.rglob("*")) - 1
        )
    return dest
