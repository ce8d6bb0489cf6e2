"""Throwaway TLS material for the test control plane.

The CRD server only serves HTTPS and authenticates callers by client certificate. A client
certificate in the group ``system:masters`` makes the delegating authorizer allow everything
without calling out to a (non-existent) SubjectAccessReview API, which is what lets the server run
alone. The openssl CLI is used (present on every Debian-like machine) so that nothing beyond the
standard library is needed here.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TLSFiles:
    """PEM files: a CA, a server certificate for 127.0.0.1/localhost, an admin client certificate."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str) -> None:
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {proc.stderr.strip()}")


def _issue(directory: Path, name: str, subject: str, ca: TLSFiles | None, extensions: str) -> None:
    key, csr, cert = (directory / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
    ext_file = directory / f"{name}.ext"
    ext_file.write_text(extensions)
    # EC P-256: key generation is instant, unlike RSA, and every client here supports it.
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(key))
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
    if ca is None:  # self-signed CA
        signer = ["-signkey", str(key)]
    else:
        signer = ["-CA", str(ca.ca_cert), "-CAkey", str(ca.ca_key), "-CAcreateserial"]
    _openssl(
        "x509", "-req", "-in", str(csr), *signer, "-days", "30", "-sha256",
        "-extfile", str(ext_file), "-out", str(cert),
    )  # fmt: skip


def make_tls(directory: Path) -> TLSFiles:
    """Create all certificates in ``directory`` (a private temp folder) and return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    files = TLSFiles(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )
    _issue(
        directory, "ca", "/CN=polyrl-test-ca", None,
        "basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\n",
    )  # fmt: skip
    _issue(
        directory, "server", "/CN=polyrl-test-apiserver", files,
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )  # fmt: skip
    _issue(
        directory, "client", "/O=system:masters/CN=polyrl-test-admin", files,
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=clientAuth\n",
    )  # fmt: skip
    return files
