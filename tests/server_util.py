"""Helpers for the ``pdlink serve`` tests: certificates made here, config files, server processes.

Every server is a real ``python -m pdlink serve`` process on loopback; ``Serve`` stops it (SIGTERM,
then SIGKILL) and the fixtures that create one always stop it. Ports come from ``ports``
(drawn at random, away from the kernel's ephemeral choices); the KV listen ports of a server are
``listenPortBase + device id``, a free consecutive block (``free_block``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from typing import Any

import pytest

trustme = pytest.importorskip("trustme", reason="the server tests need the test extra: pip install '.[test]'")
pytest.importorskip("uvicorn", reason="the server tests need the test extra: pip install '.[test]'")
pytest.importorskip("starlette", reason="the server tests need the test extra: pip install '.[test]'")
pytest.importorskip("prometheus_client", reason="the server tests need the test extra: pip install '.[test]'")

from internals import ManagementClient, NodeSpec, role_body  # noqa: E402
from ports import free_block, free_ports  # noqa: E402,F401 (the server tests import them from here)

LOCAL = "127.0.0.1"


def _crl(ca: Any, revoked: Any) -> bytes:
    """A CRL signed by ``ca`` that revokes ``revoked``'s certificate (PEM)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
    ca_key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), password=None)
    assert isinstance(ca_key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)), type(ca_key)  # trustme's key types
    cert = x509.load_pem_x509_certificate(revoked.cert_chain_pems[0].bytes())
    now = datetime.datetime.now(datetime.timezone.utc)
    entry = x509.RevokedCertificateBuilder().serial_number(cert.serial_number).revocation_date(now).build()
    crl = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject).last_update(now)
           .next_update(now + datetime.timedelta(days=1)).add_revoked_certificate(entry)
           .sign(ca_key, hashes.SHA256()))
    return crl.public_bytes(serialization.Encoding.PEM)


class Certs:
    """A CA, a server certificate for 127.0.0.1 and a client certificate; a foreign CA with its own
    client certificate, and a client certificate of the CA revoked by ``crl`` (both to be refused).
    Keys are mode 0600, as the server requires."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)
        ca = trustme.CA()
        other = trustme.CA()
        server = ca.issue_cert(LOCAL, "localhost")
        client = ca.issue_cert("pdlink-controller")
        stranger = other.issue_cert("stranger")
        self.ca = self._write("ca.pem", ca.cert_pem.bytes())
        self.server_cert = self._write("server.pem", b"".join(p.bytes() for p in server.cert_chain_pems))
        self.server_key = self._write("server.key.pem", server.private_key_pem.bytes(), 0o600)
        self.client_cert = self._write("client.pem", b"".join(p.bytes() for p in client.cert_chain_pems))
        self.client_key = self._write("client.key.pem", client.private_key_pem.bytes(), 0o600)
        self.other_ca = self._write("other_ca.pem", other.cert_pem.bytes())
        self.stranger_cert = self._write("stranger.pem", b"".join(p.bytes() for p in stranger.cert_chain_pems))
        self.stranger_key = self._write("stranger.key.pem", stranger.private_key_pem.bytes(), 0o600)
        revoked = ca.issue_cert("revoked-controller")
        self.revoked_cert = self._write("revoked.pem", b"".join(p.bytes() for p in revoked.cert_chain_pems))
        self.revoked_key = self._write("revoked.key.pem", revoked.private_key_pem.bytes(), 0o600)
        self.crl = self._write("crl.pem", _crl(ca, revoked))

    def _write(self, name: str, data: bytes, mode: int = 0o644) -> str:
        path = os.path.join(self.root, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)
        return path

    def server_config(self, ca: bool = True, crl: bool = False) -> dict[str, Any]:
        """ServerConfig TLS fields (absolute paths) using these files on every plane; ``ca=False``:
        no client authentication; ``crl``: check client certificates against ``crl``."""
        out: dict[str, Any] = {"httpsEnabled": True, "tlsCaPath": self.root}
        for prefix, ca_key in (("tls", "tlsCaFile"), ("managementTls", "managementTlsCaFile"),
                               ("metricsTls", "metricsTlsCaFile")):
            out[ca_key] = ["ca.pem"] if ca else []
            out[f"{prefix}Cert"] = self.server_cert
            out[f"{prefix}Pk"] = self.server_key
            out[f"{prefix}CrlPath"] = self.root
            out[f"{prefix}CrlFiles"] = ["crl.pem"] if crl else []
        return out

    def client(self, port: int, **kw: Any) -> ManagementClient:
        kw.setdefault("retries", 1)
        kw.setdefault("retry_wait", 0.1)
        return ManagementClient(LOCAL, port, ca=self.ca, cert=self.client_cert, key=self.client_key, **kw)


def write_config(path: str, server: dict[str, Any], kv: dict[str, Any] | None = None,
                 extra: dict[str, Any] | None = None, mode: int = 0o600) -> str:
    doc: dict[str, Any] = {"Version": "1.0.0", "ServerConfig": dict(server)}
    if kv is not None:
        doc["KvTransferConfig"] = kv
    doc.update(extra or {})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f)
    os.chmod(path, mode)
    return path


class Serve:
    """One ``pdlink serve`` process; output is collected in ``output``."""

    def __init__(self, config: str | None, env: dict[str, str] | None = None, args: list[str] | None = None):
        cmd = [sys.executable, "-m", "pdlink", "-v", "serve"] + (["--config", config] if config else []) + (args or [])
        full_env = dict(os.environ)
        for k in ("MIES_CONFIG_JSON_PATH", "MINDIE_LLM_HOME_PATH", "MIES_INSTALL_PATH", "MIES_CONTAINER_IP",
                  "MIES_CONTAINER_MANAGEMENT_IP"):
            full_env.pop(k, None)
        full_env.update(env or {})
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                                     start_new_session=True)
        self._lines: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.append(line)
            if line.startswith("pdlink serve: ready"):
                self._ready.set()

    @property
    def output(self) -> str:
        return "".join(self._lines)

    def wait_ready(self, timeout: float = 20.0) -> Serve:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None:
                self._reader.join(2)
                raise AssertionError(f"pdlink serve exited with {self.proc.returncode}:\n{self.output}")
            if time.monotonic() > deadline:
                raise AssertionError(f"pdlink serve not ready within {timeout} s:\n{self.output}")
        return self

    def wait_exit(self, timeout: float = 20.0) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"pdlink serve still running after {timeout} s:\n{self.output}") from None
        self._reader.join(2)
        return rc

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(2)
        return self.proc.returncode


def decode_body(local_id: int, local_dev: list[int], peers: list[tuple], ip: str = LOCAL) -> dict[str, Any]:
    """A controller-like body: ``peers`` are ``(id, [device ids])``."""
    return role_body(NodeSpec(local_id, ip, list(local_dev)), [NodeSpec(i, ip, list(d)) for i, d in peers])


def wait_for(fn, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


async def asgi_post(app: Any, path: str, body: bytes, ctype: bytes = b"application/json") -> tuple[int, dict]:
    """POSTs ``body`` to ``path`` of an ASGI ``app`` in this process (no socket): the status and the
    decoded JSON answer (``{}`` for an empty one). ``path`` may hold percent escapes and unpaired
    surrogates, as a hostile client's request line can."""
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "path": urllib.parse.unquote(path), "raw_path": path.encode("utf-8", "surrogateescape"),
             "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(data) if data else {}
