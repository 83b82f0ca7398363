"""A management-plane client that behaves like MindIE's controller (standard library only).

What it copies from the MindIE-Motor controller's contract (see docs/server.md):

* HTTPS with TLS 1.3 only, presenting a client certificate, verifying the server's chain against
  a CA, **no host-name check** (``check_hostname=True`` turns it on);
* a new connection per request, ``Content-Type: application/json``, a compact JSON body;
* a per-attempt timeout (5 s) and retries on transport failures (3, so up to 4 attempts); any
  HTTP status counts as delivered and is not retried at that layer;
* a role post succeeds only on HTTP 200 with ``result == "ok"`` (exactly, lowercase); a 200 with
  another ``result`` is re-posted after a pause, a bounded number of times; anything else fails;
* after posting, ``GET /v1/status`` is polled until ``roleStatus == "RoleReady"`` and
  ``currentRole`` equals the posted role.

Example::

    from pdlink.client import ManagementClient, NodeSpec, role_body
    c = ManagementClient("127.0.0.1", 1026, ca="ca.pem", cert="client.pem", key="client.key")
    body = role_body(NodeSpec.parse("2@127.0.0.1:1"), [NodeSpec.parse("1@127.0.0.1:0")])
    c.assign("decode", body)          # post, check result, wait for RoleReady
"""

from __future__ import annotations

import http.client
import json
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .server.roles import ROLE_NAMES

__all__ = ["ManagementClient", "Response", "ClientError", "RoleRejected", "NotReady", "NodeSpec", "role_body",
           "ROLES"]

ROLES = ROLE_NAMES  # the REST roles (server/roles.py)


class ClientError(Exception):
    """A request could not be completed (transport failure after every retry, or a bad answer)."""


class RoleRejected(ClientError):
    """The server did not accept the role assignment; ``response`` holds its answer (may be None)."""

    def __init__(self, message: str, response: Response | None = None):
        super().__init__(message)
        self.response = response


class NotReady(ClientError):
    """The node did not reach RoleReady with the expected role in time; ``last`` is its last status."""

    def __init__(self, message: str, last: dict[str, Any] | None = None):
        super().__init__(message)
        self.last = last


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body.decode("utf-8"))


class ManagementClient:
    """Talks to one server's management plane (or its metrics plane, for ``metrics()``)."""

    def __init__(self, host: str, port: int, *, https: bool = True, ca: str | None = None,
                 cert: str | None = None, key: str | None = None, check_hostname: bool = False,
                 timeout: float = 5.0, retries: int = 3, retry_wait: float = 0.5):
        self.host, self.port, self.https = host, port, https
        self.timeout, self.retries, self.retry_wait = timeout, retries, retry_wait
        self._ctx: ssl.SSLContext | None = None
        if https:
            from .server.tls import client_context

            self._ctx = client_context(ca, cert, key, check_hostname)

    def _connection(self) -> http.client.HTTPConnection:
        if self.https:
            return http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self._ctx)
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
                ) -> Response:
        """One request on a new connection, retried on transport failures only."""
        data = None
        hdrs = {"Accept": "*/*"}
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
            hdrs["Content-Type"] = "application/json"
        hdrs.update(headers or {})
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.retry_wait)
            conn = self._connection()
            try:
                conn.request(method, path, body=data, headers=hdrs)
                resp = conn.getresponse()
                return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
            except (OSError, http.client.HTTPException) as e:  # ssl.SSLError is an OSError
                last = e
            finally:
                conn.close()
        raise ClientError(f"{method} {self._url(path)} failed after {self.retries + 1} attempt(s): {last}") from last

    def _url(self, path: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.https else 'http'}://{host}:{self.port}{path}"

    def get_json(self, path: str) -> Any:
        resp = self.request("GET", path)
        if resp.status != 200:
            raise ClientError(f"GET {self._url(path)}: HTTP {resp.status}: {resp.body[:500]!r}")
        try:
            return resp.json()
        except ValueError:
            raise ClientError(f"GET {self._url(path)}: the answer is not JSON") from None

    def status(self) -> dict[str, Any]:
        """``GET /v1/status``."""
        return self.get_json("/v1/status")

    def config(self) -> dict[str, Any]:
        """``GET /v1/config``."""
        return self.get_json("/v1/config")

    def healthy(self) -> bool:
        """``GET /health`` answered 200."""
        return self.request("GET", "/health").status == 200

    def metrics(self) -> str:
        """``GET /metrics`` (call it on a client for the metrics plane when it has its own port)."""
        resp = self.request("GET", "/metrics")
        if resp.status != 200:
            raise ClientError(f"GET {self._url('/metrics')}: HTTP {resp.status}")
        return resp.body.decode()

    def post_role(self, role: str, body: dict[str, Any], result_retries: int = 3, result_wait: float = 5.0
                  ) -> Response:
        """``POST /v1/role/{role}`` until the answer is 200 with ``result == "ok"``.

        A 200 whose ``result`` is anything else is posted again after ``result_wait`` seconds, at
        most ``result_retries`` more times (MindIE's controller: 1440 times, 5 s apart). Any other
        status, or a body that is not JSON, raises ``RoleRejected`` at once."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        path = f"/v1/role/{role}"
        for attempt in range(result_retries + 1):
            resp = self.request("POST", path, body)
            if resp.status != 200:
                raise RoleRejected(f"POST {self._url(path)}: HTTP {resp.status}: {resp.body[:500]!r}", resp)
            try:
                result = resp.json().get("result")
            except (ValueError, AttributeError):
                raise RoleRejected(f"POST {self._url(path)}: HTTP 200 with a body that is not a JSON object",
                                   resp) from None
            if result == "ok":
                return resp
            if attempt < result_retries:
                time.sleep(result_wait)
        raise RoleRejected(f"POST {self._url(path)}: result was {result!r}, not 'ok', "
                           f"{result_retries + 1} time(s)", resp)

    def wait_ready(self, role: str, timeout: float = 60.0, interval: float = 5.0) -> dict[str, Any]:
        """Poll ``GET /v1/status`` until ``RoleReady`` with ``currentRole == role``; returns that
        status. Transport failures while polling count as "not yet". ``NotReady`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        while True:
            try:
                last = self.status()
                service = last.get("service", {})
                if service.get("roleStatus") == "RoleReady" and service.get("currentRole") == role:
                    return last
            except ClientError:
                pass
            if time.monotonic() >= deadline:
                raise NotReady(f"{self._url('/v1/status')}: not RoleReady as {role} within {timeout} s; "
                               f"last status: {json.dumps(last)[:1000] if last else 'none'}", last)
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))

    def assign(self, role: str, body: dict[str, Any], wait: bool = True, timeout: float = 60.0,
               interval: float = 5.0, result_retries: int = 3, result_wait: float = 5.0) -> dict[str, Any]:
        """Post the role, then (``wait``) wait until ready; returns the last status (or ``{}``)."""
        self.post_role(role, body, result_retries, result_wait)
        return self.wait_ready(role, timeout, interval) if wait else {}


# ---------------------------------------------------------------------------------------- bodies

@dataclass
class NodeSpec:
    """An instance as the controller describes it: id, IP, and device ids (physical; device ``i``
    gets logical id and rank ``i``)."""

    id: int
    server_ip: str
    device_ids: list[int] = field(default_factory=lambda: [0])
    device_ips: list[str] | None = None  # default: server_ip for every device

    @classmethod
    def parse(cls, text: str) -> NodeSpec:
        """``ID@IP`` or ``ID@IP:DEV[,DEV...]`` (``DEV``: device ids, default ``0``); an IPv6 address
        goes in brackets: ``3@[::1]:0,1``."""
        ident, sep, rest = text.partition("@")
        if not sep or not ident.isdigit():
            raise ValueError(f"node spec must be ID@IP[:DEV,...], got {text!r}")
        if rest.startswith("["):
            ip, _, tail = rest[1:].partition("]")
            devs = tail[1:] if tail.startswith(":") else ""
        else:
            ip, _, devs = rest.partition(":")
        try:
            device_ids = [int(d) for d in devs.split(",")] if devs else [0]
        except ValueError:
            raise ValueError(f"device ids must be integers in {text!r}") from None
        return cls(int(ident), ip, device_ids)

    def to_json(self, local: bool) -> dict[str, Any]:
        ips = self.device_ips or [self.server_ip] * len(self.device_ids)
        devices = [{"device_id": str(d), "device_ip": ips[i], "device_logical_id": str(i), "rank_id": str(i)}
                   for i, d in enumerate(self.device_ids)]
        out: dict[str, Any] = {"server_ip": self.server_ip, "id": self.id, "host_ip": self.server_ip,
                               "device": devices}
        if local:
            out.update(instance_idx_in_pod=0, num_instances_per_pod=1, is_single_container=True)
        return out


def role_body(local: NodeSpec, peers: Sequence[NodeSpec], p_percentage: int | None = None) -> dict[str, Any]:
    """The body MindIE's controller would send for ``local`` with ``peers``."""
    body: dict[str, Any] = {"local": local.to_json(True), "peers": [p.to_json(False) for p in peers]}
    if p_percentage is not None:
        body["local"]["p_percentage"] = p_percentage
    return body
