"""``pdlink.client`` and the ``pdlink role`` CLI behave like MindIE's controller, checked against a
scripted stub server (plain HTTP on loopback, in a thread): a 200 whose ``result`` is not exactly
``"ok"`` is posted again and finally refused, other statuses fail at once, transport failures are
retried, readiness means RoleReady *and* the expected role; bodies built by the client pass the
server's rules."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from internals import ClientError, ManagementClient, NodeSpec, NotReady, RoleRejected, parse_role_request, role_body


class Stub:
    """Answers from a script: a list of (status, body bytes) consumed per request (the last one repeats)."""

    def __init__(self, script):
        self.script = list(script)
        self.requests: list[tuple[str, str, str | None, bytes]] = []  # method, path, Content-Type, body
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                stub.requests.append((self.command, self.path, self.headers.get("Content-Type"),
                                      self.rfile.read(length)))
                status, body = stub.script.pop(0) if len(stub.script) > 1 else stub.script[0]
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def client(self, **kw):
        return ManagementClient("127.0.0.1", self.port, https=False, retry_wait=0.01, **kw)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stub():
    made = []

    def make(*script):
        s = Stub(script)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


BODY = role_body(NodeSpec.parse("2@127.0.0.1:1"), [NodeSpec.parse("1@127.0.0.1:0")])
OK = (200, b'{"result":"ok"}')


def status_doc(role_status, role):
    return (200, json.dumps({"service": {"roleStatus": role_status, "currentRole": role}}).encode())


def test_the_seeds_uppercase_OK_is_not_success(stub):
    s = stub((200, b'{"result": "OK"}'))
    with pytest.raises(RoleRejected, match="'OK'"):
        s.client().post_role("decode", BODY, result_retries=2, result_wait=0.01)
    assert len(s.requests) == 3  # posted again, as the controller does, then given up
    method, path, ctype, data = s.requests[0]
    assert (method, path, ctype) == ("POST", "/v1/role/decode", "application/json")
    assert json.loads(data) == BODY and b" " not in data  # a compact body


def test_ok_after_a_non_ok_result(stub):
    s = stub((200, b'{"result":"busy"}'), (200, b'{"result":"busy"}'), OK)
    assert s.client().post_role("prefill", BODY, result_retries=3, result_wait=0.01).status == 200
    assert len(s.requests) == 3


@pytest.mark.parametrize("answer", [(422, b'{"error":"x","error_type":"Input validation error"}'),
                                    (503, b'{"error":"x","error_type":"Service Unavailable"}'),
                                    (200, b"not json"), (200, b"[1]")])
def test_other_answers_fail_at_once(stub, answer):
    s = stub(answer)
    with pytest.raises(RoleRejected):
        s.client().post_role("decode", BODY, result_retries=5, result_wait=0.01)
    assert len(s.requests) == 1


def test_transport_failures_are_retried():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        c = ManagementClient("127.0.0.1", port, https=False, retries=2, retry_wait=0.01)
        with pytest.raises(ClientError, match="after 3 attempt"):
            c.status()


def test_ready_means_role_ready_with_the_expected_role(stub):
    s = stub(status_doc("RoleSwitching", "decode"), status_doc("RoleSwitching", "decode"),
             status_doc("RoleReady", "decode"))
    assert s.client().wait_ready("decode", timeout=5, interval=0.01)["service"]["roleStatus"] == "RoleReady"
    assert len(s.requests) == 3
    s = stub(status_doc("RoleReady", "prefill"))
    with pytest.raises(NotReady) as e:
        s.client().wait_ready("decode", timeout=0.2, interval=0.02)
    assert e.value.last is not None
    assert e.value.last["service"]["currentRole"] == "prefill"


def test_client_bodies_pass_the_server_rules():
    body = role_body(NodeSpec.parse("7@10.0.0.7:4,5"), [NodeSpec.parse("8@10.0.0.8:6,7"),
                                                          NodeSpec.parse("9@[fd00::9]:0,1")], p_percentage=40)
    req = parse_role_request("flex", body)
    assert req.local.id == 7 and [d.device_id for d in req.local.devices] == ["4", "5"]
    assert [p.id for p in req.peers] == [8, 9] and req.p_percentage == 40
    assert body["local"]["device"][1] == {"device_id": "5", "device_ip": "10.0.0.7", "device_logical_id": "1",
                                          "rank_id": "1"}
    for bad in ("7", "x@1.2.3.4", "7@1.2.3.4:a"):
        with pytest.raises(ValueError):
            NodeSpec.parse(bad)


def _cli(*args):
    env = {k: v for k, v in os.environ.items()}
    return subprocess.run([sys.executable, "-m", "pdlink", *args], capture_output=True, text=True, env=env,
                          timeout=30)


def test_cli_role_with_a_body_file_and_its_errors(stub, tmp_path):
    s = stub(OK)
    body_file = tmp_path / "body.json"
    body_file.write_text(json.dumps(BODY))
    out = _cli("role", "decode", "--http", "--server", f"127.0.0.1:{s.port}", "--body", str(body_file), "--no-wait")
    assert out.returncode == 0 and out.stdout == "decode: accepted\n", out.stderr
    assert json.loads(s.requests[0][3]) == BODY
    s = stub((422, b'{"error":"bad","error_type":"Input validation error"}'))
    out = _cli("role", "prefill", "--http", "--server", f"127.0.0.1:{s.port}", "--local", "1@127.0.0.1")
    assert out.returncode == 1 and "HTTP 422" in out.stderr
    out = _cli("role", "prefill", "--http", "--server", f"127.0.0.1:{s.port}", "--local", "nope")
    assert out.returncode == 2 and "ID@IP" in out.stderr
    out = _cli("role", "prefill", "--http", "--server", f"127.0.0.1:{s.port}")
    assert out.returncode == 2 and "--local" in out.stderr
