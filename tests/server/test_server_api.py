"""``pdlink serve`` over real HTTPS with mutual TLS: every validation rule and status code of
``POST /v1/role/{role}``, error bodies that leave the state untouched, the other endpoints,
failed links in the status, concurrent role posts, TLS refusals (no certificate, a foreign CA, a
revoked certificate, TLS 1.2, plain HTTP), and a server that stays up through all of it."""

from __future__ import annotations

import copy
import json
import socket
import ssl
import threading
from types import SimpleNamespace

import pytest

from internals import ClientError, ManagementClient, NotReady, Response, RoleRejected, client_context
from server_util import LOCAL, Certs, Serve, decode_body, free_block, free_ports, wait_for, write_config

LOCAL_ID = 10
LIMIT = 1024 * 1024  # maxRequestLength: 1 (MB)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    certs = Certs(str(root / "certs"))
    mgmt, metrics = free_ports(2)
    base = free_block(8)
    path = write_config(str(root / "config.json"),
                        {"ipAddress": LOCAL, "port": mgmt, "managementPort": mgmt, "metricsPort": metrics,
                         "maxRequestLength": 1, **certs.server_config(crl=True)},
                        kv={"listenPortBase": base, "linkTotalTimeMs": 600, "linkRetryIntervalMs": 50})
    server = Serve(path).wait_ready()
    try:
        yield SimpleNamespace(certs=certs, server=server, port=mgmt, metrics_port=metrics, base=base,
                              client=certs.client(mgmt), metrics=certs.client(metrics))
    finally:
        server.stop()


@pytest.fixture(scope="module")
def assigned(srv):
    """The server has accepted one assignment (its identity is instance LOCAL_ID)."""
    srv.client.post_role("decode", body())
    return srv


def body(**kw):
    """A controller-like decode body: local LOCAL_ID on device 0, one peer (11) on device 1."""
    return decode_body(kw.get("local_id", LOCAL_ID), kw.get("dev", [0]), kw.get("peers", [(11, [1])]))


def state(client):
    s = client.status()
    return s["service"], s["pdlink"]["generation"], s["pdlink"]["clusterId"]


def check_error(resp, status, error_type, *words):
    assert resp.status == status, (resp.status, resp.body)
    doc = resp.json()
    assert set(doc) == {"error", "error_type"}, doc
    assert doc["error_type"] == error_type, doc
    for w in words:
        assert w in doc["error"], doc
    return doc


def raw(srv, data: bytes, tls=True, cert=True, timeout=5.0) -> bytes:
    """Send raw bytes (over TLS with the client certificate by default); everything read back."""
    sock = socket.create_connection((LOCAL, srv.port), timeout)
    try:
        if tls:
            c = srv.certs
            ctx = client_context(c.ca, c.client_cert if cert else None, c.client_key if cert else None)
            sock = ctx.wrap_socket(sock)
        if data:
            try:
                sock.sendall(data)
            except (BrokenPipeError, ConnectionResetError, ssl.SSLError):  # the server may close early
                pass
        out = []
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, ssl.SSLError, TimeoutError):
                break
            if not chunk:
                break
            out.append(chunk)
        return b"".join(out)
    finally:
        sock.close()


# ------------------------------------------------------------------------------------- 200

def test_ok_body_is_lowercase_ok(srv):
    resp = srv.client.request("POST", "/v1/role/decode", body())
    assert resp.status == 200
    assert resp.body == b'{"result":"ok"}'  # exactly: MindIE's controller compares result == "ok"
    assert resp.headers["content-type"] == "application/json"
    assert resp.headers["connection"] == "close" and len(resp.headers["requestuuid"]) == 32
    assert int(resp.headers["x-pdlink-generation"]) >= 1
    assert srv.client.status()["service"]["currentRole"] == "decode"


def test_full_controller_body_is_accepted(srv):
    b = body(peers=[(11, [1]), (12, [2])])
    b["local"].update(p_percentage=30, super_pod_id="7")
    b["local"]["device"][0]["super_device_id"] = "100"
    b["peers"][1]["super_pod_id"] = 7
    b["extra_field_from_a_newer_controller"] = {"x": 1}
    assert srv.client.post_role("prefill", b).status == 200
    status = wait_for(lambda: (s := srv.client.status())["pdlink"]["appliedGeneration"] ==
                      s["pdlink"]["generation"] and s, 10)
    assert status["service"]["currentRole"] == "prefill" and "p_percentage" not in status["service"]
    assert sorted(p["target"] for p in status["pdlink"]["peers"]) == [11, 12]
    assert status["pdlink"]["devices"][0]["listen"] == f"127.0.0.1:{srv.base}"  # prefill listens: base + device 0


# ------------------------------------------------------------------------------------- 400 / 404 / 405 / 413

@pytest.mark.parametrize("data,headers,words", [
    (b"{", {"Content-Type": "application/json"}, ["not valid JSON", "Reset to previous node status"]),
    (b"", {"Content-Type": "application/json"}, ["not valid JSON"]),
    (b'{"local": NaN}', {"Content-Type": "application/json"}, ["not valid JSON"]),
    (b'{"local": "\xff"}', {"Content-Type": "application/json"}, ["not valid JSON"]),
    (b"[" * 100000, {"Content-Type": "application/json"}, ["not valid JSON"]),
    (json.dumps(body()).encode(), {"Content-Type": "text/plain"}, ["Content-Type must be application/json"]),
    (json.dumps(body()).encode(), {"Content-Type": ""}, ["Content-Type must be application/json"]),
])
def test_400_malformed_requests(assigned, data, headers, words):
    before = state(assigned.client)
    resp = assigned.client.request("POST", "/v1/role/decode", data, headers)
    check_error(resp, 400, "Bad Request", *words)
    assert state(assigned.client) == before


def test_json_content_type_with_charset_is_accepted(srv):
    resp = srv.client.request("POST", "/v1/role/decode", json.dumps(body()).encode(),
                              {"Content-Type": "application/json; charset=utf-8"})
    assert resp.status == 200


@pytest.mark.parametrize("method,path,status,error_type", [
    ("POST", "/v1/role/foo", 404, "NotFoundError"),
    ("POST", "/v1/role/PREFILL", 404, "NotFoundError"),
    ("POST", "/v2/role/prefill", 404, "NotFoundError"),
    ("GET", "/v1/nothing", 404, "NotFoundError"),
    ("POST", "/v1/pdlink/test/kv/pull", 404, "NotFoundError"),  # testKv is off
    ("GET", "/metrics", 404, "NotFoundError"),  # metrics has its own port here
    ("GET", "/v1/role/prefill", 405, "Method Not Allowed"),
    ("POST", "/v1/status", 405, "Method Not Allowed"),
])
def test_404_and_405(assigned, method, path, status, error_type):
    before = state(assigned.client)
    resp = assigned.client.request(method, path, body() if method == "POST" else None)
    check_error(resp, status, error_type)
    assert state(assigned.client) == before


def test_413_declared_length_over_the_limit(assigned):
    before = state(assigned.client)
    head = (f"POST /v1/role/decode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {LIMIT + 1}\r\n\r\n").encode()
    out = raw(assigned, head + b"{")  # the body is never sent: the header decides
    assert out.startswith(b"HTTP/1.1 413 "), out[:200]
    doc = json.loads(out.split(b"\r\n\r\n", 1)[1])
    assert doc["error_type"] == "Payload Too Large" and "maxRequestLength" in doc["error"]
    assert state(assigned.client) == before


def test_413_chunked_body_over_the_limit(assigned):
    before = state(assigned.client)
    payload = b" " * (LIMIT + 10)
    req = (b"POST /v1/role/decode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(payload):x}\r\n".encode() + payload + b"\r\n0\r\n\r\n")
    out = raw(assigned, req)
    assert out.startswith(b"HTTP/1.1 413 "), out[:200]
    assert state(assigned.client) == before


def test_a_body_at_the_limit_is_read(assigned):
    data = json.dumps(body()).encode()
    data += b" " * (LIMIT - len(data))
    assert assigned.client.request("POST", "/v1/role/decode", data).status == 200


# ------------------------------------------------------------------------------------- 422

def _set(path, value):
    def f(b):
        node = b
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return b
    return f


def _del(path):
    def f(b):
        node = b
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
        return b
    return f


CASES_422 = [
    ("not an object", lambda b: [b], "must be a JSON object"),
    ("no local", _del(["local"]), "local is required"),
    ("local not an object", _set(["local"], []), "local must be an object"),
    ("no server_ip", _del(["local", "server_ip"]), "local.server_ip is required"),
    ("server_ip invalid", _set(["local", "server_ip"], "1.2.3"), "local.server_ip is not a valid IP"),
    ("server_ip 0.0.0.0", _set(["local", "server_ip"], "0.0.0.0"), "unspecified"),
    ("server_ip a number", _set(["local", "server_ip"], 1), "must be an IP address string"),
    ("no device", _del(["local", "device"]), "local.device must be a non-empty array"),
    ("empty device", _set(["local", "device"], []), "local.device must be a non-empty array"),
    ("device not a list", _set(["local", "device"], {"device_ip": LOCAL}), "non-empty array"),
    ("too many devices", _set(["local", "device"], [{"device_ip": LOCAL, "device_logical_id": str(i)}
                                                    for i in range(65)]), "more than 64"),
    ("device not an object", _set(["local", "device", 0], "0"), "local.device[0] must be an object"),
    ("no device_logical_id", _del(["local", "device", 0, "device_logical_id"]), "device_logical_id is required"),
    ("device_logical_id int", _set(["local", "device", 0, "device_logical_id"], 0), "numeric string"),
    ("device_logical_id neg", _set(["local", "device", 0, "device_logical_id"], "-1"), "numeric string"),
    ("device_logical_id alpha", _set(["local", "device", 0, "device_logical_id"], "a"), "numeric string"),
    ("device_logical_id huge", _set(["local", "device", 0, "device_logical_id"], "4294967296"), "numeric string"),
    ("device_logical_id unicode", _set(["local", "device", 0, "device_logical_id"], "\u0663"), "numeric string"),
    ("no device_ip", _del(["local", "device", 0, "device_ip"]), "device_ip is required"),
    ("device_ip invalid", _set(["local", "device", 0, "device_ip"], "x"), "device_ip is not a valid IP"),
    ("device_id alpha", _set(["local", "device", 0, "device_id"], "zero"), "local.device[0].device_id"),
    ("rank_id int", _set(["local", "device", 0, "rank_id"], 0), "local.device[0].rank_id"),
    ("super_device_id alpha", _set(["local", "device", 0, "super_device_id"], "x"), "super_device_id"),
    ("id without host_ip", _del(["local", "host_ip"]), "id and local.host_ip must be given together"),
    ("host_ip without id", _del(["local", "id"]), "given together"),
    ("id negative", _set(["local", "id"], -1), "local.id must be an unsigned integer"),
    ("id a string", _set(["local", "id"], "10"), "local.id must be an unsigned integer"),
    ("id a bool", _set(["local", "id"], True), "local.id must be an unsigned integer"),
    ("id too big", _set(["local", "id"], 2**64 - 1), "local.id must be an unsigned integer"),
    ("host_ip invalid", _set(["local", "host_ip"], "host"), "local.host_ip is not a valid IP"),
    ("p_percentage 101", _set(["local", "p_percentage"], 101), "p_percentage"),
    ("p_percentage str", _set(["local", "p_percentage"], "50"), "p_percentage"),
    ("instance_idx negative", _set(["local", "instance_idx_in_pod"], -1), "instance_idx_in_pod"),
    ("num_instances str", _set(["local", "num_instances_per_pod"], "1"), "num_instances_per_pod"),
    ("is_single_container str", _set(["local", "is_single_container"], "yes"), "is_single_container"),
    ("super_pod_id list", _set(["local", "super_pod_id"], [1]), "super_pod_id"),
    ("repeated logical id", lambda b: (b["local"]["device"].append(dict(b["local"]["device"][0], device_id="9")), b)[1],
     "repeats a device_logical_id"),
    ("peers not an array", _set(["peers"], {"server_ip": LOCAL}), "peers must be an array"),
    ("peer not an object", _set(["peers", 0], "p"), "peers[0] must be an object"),
    ("peer without server_ip", _del(["peers", 0, "server_ip"]), "peers[0].server_ip is required"),
    ("peer device ip invalid", _set(["peers", 0, "device", 0, "device_ip"], "::g"), "peers[0].device[0].device_ip"),
    ("peer has fewer devices", _set(["peers", 0, "device"], []), "peers[0].device must be a non-empty array"),
    ("peer has more devices", lambda b: (b["peers"][0]["device"].append(
        {"device_ip": LOCAL, "device_logical_id": "1"}), b)[1], "it must have as many as the local node"),
    ("peer id without host_ip", _del(["peers", 0, "host_ip"]), "peers[0].id and peers[0].host_ip"),
    ("peer is the local instance", _set(["peers", 0, "id"], LOCAL_ID), "has the local instance's id"),
    ("same peer twice", lambda b: (b["peers"].append(copy.deepcopy(b["peers"][0])), b)[1], "name the same instance"),
    ("too many peers", lambda b: (b.__setitem__("peers", [dict(copy.deepcopy(b["peers"][0]), id=100 + i)
                                                          for i in range(257)]), b)[1], "more than 256"),
]


@pytest.mark.parametrize("name,mutate,words", CASES_422, ids=[c[0] for c in CASES_422])
def test_422_body_breaks_the_rules(assigned, name, mutate, words):
    before = state(assigned.client)
    resp = assigned.client.request("POST", "/v1/role/decode", mutate(body()))
    check_error(resp, 422, "Input validation error", words, "Reset to previous node status")
    assert state(assigned.client) == before


# ------------------------------------------------------------------------------------- 503

@pytest.mark.parametrize("name,make,words", [
    ("device count", lambda: decode_body(LOCAL_ID, [0, 1], [(11, [2, 3])]), "this server hosts 1"),
    ("identity change", lambda: decode_body(99, [0], [(11, [1])]), "restart the server"),
    ("IPv6 listen address", lambda: decode_body(LOCAL_ID, [0], [(11, [1])], ip="::1"), "needs an IPv4"),
    ("port past 65535", lambda: decode_body(LOCAL_ID, [65000], [(11, [1])]), "exceeds 65535"),
])
def test_503_cannot_be_applied(assigned, name, make, words):
    before = state(assigned.client)
    resp = assigned.client.request("POST", "/v1/role/prefill", make())
    check_error(resp, 503, "Service Unavailable", words, "Reset to previous node status")
    assert state(assigned.client) == before
    with pytest.raises(RoleRejected) as e:  # the client reports it
        assigned.client.post_role("prefill", make())
    assert e.value.response is not None
    assert e.value.response.status == 503


# ------------------------------------------------------------------------------------- other endpoints

def test_config_and_health(assigned):
    assert assigned.client.config() == {"modelName": "pdlink", "maxSeqLen": 2560, "npuMemSize": -1, "cpuMemSize": 5,
                                        "worldSize": 1, "maxOutputLen": 512, "cacheBlockSize": 128}
    for path in ("/health", "/v2/health/live", "/v2/health/ready"):
        resp = assigned.client.request("GET", path)
        assert (resp.status, resp.body) == (200, b"")


def test_status_document(assigned):
    s = assigned.client.status()
    assert set(s) == {"service", "resource", "linkStatus", "pdlink"}
    assert s["service"]["roleStatus"] in ("RoleUnknown", "RoleSwitching", "RoleReady")
    assert set(s["resource"]) == {"availSlotsNum", "availBlockNum", "waitingRequestNum", "runningRequestNum",
                                  "swappedRequestNum", "freeNpuBlockNums", "freeCpuBlockNums", "totalNpuBlockNums",
                                  "totalCpuBlockNums"}
    assert all(isinstance(v, int) and v >= 0 for v in s["resource"].values())
    assert 0 <= s["resource"]["availSlotsNum"] <= 5000


def test_a_failed_link_is_reported_not_fatal(assigned):
    c = assigned.client
    c.post_role("decode", body(peers=[(21, [5])]))  # nothing listens at base + 5
    status = wait_for(lambda: (s := c.status())["linkStatus"]["peers"] and s, 10)
    (peer,) = status["linkStatus"]["peers"]
    assert peer["target"] == 21 and peer["link"].startswith("failed : ")
    assert "Connection refused" in peer["link"] and f"127.0.0.1:{assigned.base + 5}" in peer["link"]
    assert status["service"] == {"roleStatus": "RoleSwitching", "currentRole": "decode"}  # no peer is ok
    assert assigned.server.alive() and c.healthy()  # never linked, so not "lost"
    with pytest.raises(NotReady) as e:
        c.wait_ready("decode", timeout=0.3, interval=0.1)
    assert e.value.last is not None
    assert e.value.last["linkStatus"]["peers"][0]["target"] == 21
    text = assigned.metrics.metrics()
    assert 'pdlink_errors_total{code="LLM_LINK_FAILED",op="link"}' in text
    assert 'pdlink_role_requests_total{code="200"}' in text


def test_an_assignment_that_fails_to_apply_is_reported(assigned):
    """Accepted (200), but the listener cannot bind: RoleUnknown with the reason, so a controller
    posts again; the engines keep their previous role; a good post recovers."""
    c = assigned.client
    c.post_role("decode", body())
    bad = body()
    bad["local"]["server_ip"] = "192.0.2.1"  # TEST-NET-1: not an address of this machine
    assert c.post_role("prefill", bad).status == 200
    status = wait_for(lambda: (s := c.status())["service"]["roleStatus"] == "RoleUnknown" and s, 10)
    assert status, c.status()
    assert status["service"]["currentRole"] == "prefill"
    assert "cannot listen on 192.0.2.1" in status["pdlink"]["lastError"]
    assert status["pdlink"]["engineRole"] == "decode" and status["pdlink"]["devices"][0]["listen"] is None
    good = c.post_role("prefill", body())
    assert good.status == 200
    # The engines take the role while the post is applied; its outcome is known once it is applied.
    gen = int(good.headers["x-pdlink-generation"])
    status = wait_for(lambda: (s := c.status())["pdlink"]["appliedGeneration"] == gen and s, 10)
    assert status, c.status()
    assert status["pdlink"]["engineRole"] == "prefill" and status["pdlink"]["lastError"] is None
    assert status["service"]["roleStatus"] != "RoleUnknown"


def test_concurrent_role_posts_are_serialised(assigned):
    c = assigned.client
    posts = [("prefill" if i % 2 else "decode", body(peers=[(200 + i, [1]), (300 + i, [2])])) for i in range(8)]
    results: list[Response | None] = [None] * len(posts)

    def post(i):
        results[i] = c.request("POST", f"/v1/role/{posts[i][0]}", posts[i][1])

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(posts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(r is not None and r.status == 200 and r.json() == {"result": "ok"} for r in results)
    responses = [r for r in results if r is not None]  # all of them, in post order
    gens = sorted(int(r.headers["x-pdlink-generation"]) for r in responses)
    assert gens == list(range(gens[0], gens[0] + len(posts)))  # each post got its own generation
    last = max(range(len(posts)), key=lambda i: int(responses[i].headers["x-pdlink-generation"]))
    status = wait_for(lambda: (s := c.status())["pdlink"]["appliedGeneration"] == gens[-1] and s, 15)
    assert status, c.status()
    assert status["service"]["currentRole"] == posts[last][0]
    assert sorted(p["target"] for p in status["pdlink"]["peers"]) == [200 + last, 300 + last]
    assert status["pdlink"]["engineRole"] == posts[last][0] and status["pdlink"]["lastError"] is None
    assert c.healthy()


# ------------------------------------------------------------------------------------- TLS

def test_client_without_certificate_is_refused(srv):
    c = srv.certs
    bare = ManagementClient(LOCAL, srv.port, ca=c.ca, retries=0)
    with pytest.raises(ClientError):
        bare.status()
    out = raw(srv, b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n", cert=False)
    assert not out.startswith(b"HTTP/")


@pytest.mark.parametrize("who", ["stranger", "revoked"])
def test_client_certificates_the_server_refuses(srv, who):
    c = srv.certs
    cert, key = (c.stranger_cert, c.stranger_key) if who == "stranger" else (c.revoked_cert, c.revoked_key)
    with pytest.raises(ClientError):
        ManagementClient(LOCAL, srv.port, ca=c.ca, cert=cert, key=key, retries=0).status()
    assert srv.client.status()  # the good certificate still works (and passes the CRL check)


def test_tls_12_is_refused(srv):
    c = srv.certs
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(c.ca)
    ctx.load_cert_chain(c.client_cert, c.client_key)
    with socket.create_connection((LOCAL, srv.port), 5) as s:
        with pytest.raises(ssl.SSLError):
            with ctx.wrap_socket(s, server_hostname=LOCAL) as t:
                t.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n")
                t.recv(100)


def test_client_verifies_the_server(srv):
    c = srv.certs
    with pytest.raises(ClientError, match="CERTIFICATE_VERIFY_FAILED"):
        ManagementClient(LOCAL, srv.port, ca=c.other_ca, cert=c.client_cert, key=c.client_key, retries=0).status()
    ok = ManagementClient(LOCAL, srv.port, ca=c.ca, cert=c.client_cert, key=c.client_key, check_hostname=True)
    assert ok.status()  # the server certificate names 127.0.0.1


def test_plain_http_on_the_tls_port_gets_no_answer(srv):
    out = raw(srv, b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n", tls=False)
    assert b"roleStatus" not in out


# ------------------------------------------------------------------------------------- robustness

def test_the_server_stays_up_after_bad_requests(srv):
    # garbage HTTP inside TLS, an absurd header, a truncated request, a connection closed at once,
    # raw TLS garbage
    assert raw(srv, b"\x00\x01GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400")
    raw(srv, b"GET /v1/status HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100000 + b"\r\n\r\n")
    raw(srv, b"POST /v1/role/decode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100"
             b"\r\n\r\n{\"local\"", timeout=0.5)
    socket.create_connection((LOCAL, srv.port), 5).close()
    raw(srv, b"\x16\x03\x01\x00\x05hello", tls=False)
    assert srv.server.alive()
    assert srv.client.healthy()
    assert srv.client.status()["service"]["currentRole"] in ("prefill", "decode")


def test_the_metrics_plane_is_tls_too(srv):
    c = srv.certs
    with pytest.raises(ClientError):
        ManagementClient(LOCAL, srv.metrics_port, ca=c.ca, retries=0).metrics()
    text = srv.metrics.metrics()
    assert "pdlink_links" in text and "pdlink_role_info" in text


# ------------------------------------------------------------------------------------- fresh servers

def test_first_assignment_rules_on_a_fresh_server(tmp_path):
    """A fresh server (server-side TLS only: no CA, so a client without a certificate is served)
    refuses a first assignment without peers (503) unless it is flex with 0 < p_percentage < 100,
    and accepts the seed's minimal body."""
    certs = Certs(str(tmp_path / "certs"))
    (mgmt,) = free_ports(1)
    base = free_block(2)
    path = write_config(str(tmp_path / "config.json"),
                        {"ipAddress": LOCAL, "port": mgmt, "metricsPort": mgmt, **certs.server_config(ca=False)},
                        kv={"listenPortBase": base, "linkTotalTimeMs": 500, "linkRetryIntervalMs": 50})
    server = Serve(path).wait_ready()
    try:
        c = ManagementClient(LOCAL, mgmt, ca=certs.ca, retries=0)  # no client certificate
        seed_local = {"server_ip": LOCAL, "device": [{"device_ip": LOCAL, "device_logical_id": "0"}]}
        assert c.status()["service"] == {"roleStatus": "RoleUnknown", "currentRole": "none"}
        for role, extra in [("prefill", {}), ("decode", {}), ("flex", {}), ("flex", {"p_percentage": 100}),
                            ("flex", {"p_percentage": 0})]:
            resp = c.request("POST", f"/v1/role/{role}", {"local": dict(seed_local, **extra)})
            check_error(resp, 503, "Service Unavailable", "must list peers")
            resp = c.request("POST", f"/v1/role/{role}", {"local": dict(seed_local, **extra), "peers": []})
            check_error(resp, 503, "Service Unavailable", "must list peers")
        assert c.status()["service"] == {"roleStatus": "RoleUnknown", "currentRole": "none"}
        assert c.post_role("flex", {"local": dict(seed_local, p_percentage=50)}).status == 200
        ready = c.wait_ready("flex", timeout=10, interval=0.05)
        assert ready["service"] == {"roleStatus": "RoleReady", "currentRole": "flex", "p_percentage": 50}
        assert ready["pdlink"]["clusterId"] == 0x7F000001  # no id: derived from server_ip 127.0.0.1
        # the seed document's body, verbatim in shape (no id, no device_id)
        seed = {"local": seed_local, "peers": [
            {"server_ip": "127.0.0.2", "device": [{"device_ip": "127.0.0.2", "device_logical_id": "0"}]}]}
        assert c.post_role("decode", seed).status == 200
        status = wait_for(lambda: (s := c.status())["linkStatus"]["peers"] and s, 10)
        assert status["linkStatus"]["peers"][0]["target"] == 0x7F000002
        assert status["pdlink"]["peers"][0]["addresses"] == [f"127.0.0.2:{base}"]
        # a later post may drop every peer
        assert c.post_role("decode", {"local": seed_local, "peers": []}).status == 200
        assert c.wait_ready("decode", timeout=10, interval=0.05)["linkStatus"]["peers"] == []
    finally:
        assert server.stop() == 0


def test_standard_infer_mode_over_plain_http(tmp_path):
    (mgmt,) = free_ports(1)
    path = write_config(str(tmp_path / "config.json"), {"ipAddress": LOCAL, "port": mgmt, "metricsPort": mgmt,
                                                        "httpsEnabled": False, "inferMode": "standard"})
    server = Serve(path).wait_ready()
    try:
        c = ManagementClient(LOCAL, mgmt, https=False, retries=0)
        assert c.status()["service"] == {"roleStatus": "RoleReady", "currentRole": "none"}
        check_error(c.request("POST", "/v1/role/prefill", body()), 503, "Service Unavailable", "inferMode")
        assert "pdlink_role_requests_total" in c.metrics()  # metricsPort == port: one listener
        assert "httpsEnabled is false" not in server.output  # loopback: no warning
    finally:
        assert server.stop() == 0


def test_no_unhandled_error_was_logged(srv):
    assert srv.server.alive()
    assert "Traceback" not in srv.server.output and "unhandled error" not in srv.server.output, srv.server.output


def test_health_answers_while_large_role_bodies_are_decoded(tmp_path):
    """Role bodies may be as large as maxRequestLength (40 MB by default). Decoding one holds
    Python's GIL for the whole document, so pdlink decodes large ones in a worker process: /health
    answers while two such bodies (sent in full) are still being decoded, and their answers come
    after it (422 here: the bodies lack `local`, and nothing changes)."""
    certs = Certs(str(tmp_path / "certs"))
    (mgmt,) = free_ports(1)
    path = write_config(str(tmp_path / "config.json"),
                        {"ipAddress": LOCAL, "port": mgmt, "managementPort": mgmt, **certs.server_config()},
                        kv={"listenPortBase": free_block(8)})
    server = Serve(path).wait_ready()
    try:
        # 20 MB of 4,000-digit numbers: about a second to decode, and within the shape bounds (5,000 items;
        # 1.3 million small objects, as before, are now refused before decoding)
        payload = b'{"padding": [' + b",".join([b"9" * 4000] * 5000) + b']}'
        head = (f"POST /v1/role/decode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode()
        posts = []
        for _ in range(2):  # both bodies arrive in full only at the end, together
            sock = socket.create_connection((LOCAL, mgmt), 60)
            sock = client_context(certs.ca, certs.client_cert, certs.client_key).wrap_socket(sock)
            sock.sendall(head + payload[:-1])
            posts.append(sock)
        for sock in posts:
            sock.sendall(payload[-1:])
        probe = socket.create_connection((LOCAL, mgmt), 30)
        probe = client_context(certs.ca, certs.client_cert, certs.client_key).wrap_socket(probe)
        probe.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        health = probe.recv(65536)  # the status line and headers: all that is needed here
        probe.close()
        assert health.startswith(b"HTTP/1.1 200"), health[:100]
        early = []
        for sock in posts:  # no answer yet (a TLS session ticket may be there, but no application data)
            sock.setblocking(False)
            try:
                early.append(sock.recv(100))
            except ssl.SSLWantReadError:
                pass
        assert early == [], f"a role body was answered before /health (decoding blocked the event loop): {early}"
        for sock in posts:
            sock.settimeout(60)
            answer = b""
            while b"local is required" not in answer and (chunk := sock.recv(65536)):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 422") and b"local is required" in answer, answer[:300]
            sock.close()
    finally:
        server.stop()
