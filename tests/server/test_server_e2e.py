"""End to end over HTTPS with mutual TLS: two ``pdlink serve`` processes (two devices each, the
test KV surface on) get prefill and decode roles from a controller-like client, reach RoleReady,
KV is pulled prefill -> decode and verified byte for byte, the roles are swapped through the API
(once with the ``pdlink role`` CLI) and KV flows the other way; then a re-post with a changed
peer list is applied as a diff, a peer that never links is reported failed, a dropped link makes
the other side unhealthy, and a re-post heals it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from server_util import LOCAL, Certs, Serve, decode_body, free_block, free_ports, wait_for, write_config

A, B, C = 1, 2, 3  # instance ids; C is never started
DEV = {A: [0, 1], B: [2, 3], C: [4, 5]}  # device ids: KV ports are listenPortBase + device id
TEST_KV = {"enabled": True, "numTensors": 2, "numBlocks": 16, "blockBytes": 4096}
PULL_BYTES = 2 * TEST_KV["numTensors"] * TEST_KV["numBlocks"] * TEST_KV["blockBytes"]  # two devices


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    certs = Certs(str(root / "certs"))
    ports = free_ports(4)
    base = free_block(8)
    secret = root / "link.secret"  # every engine of A and B proves it knows it when linking
    secret.write_text("pdlink-e2e-secret\n")
    secret.chmod(0o600)
    servers, clients, metrics = {}, {}, {}
    try:
        for ident, (mgmt, met) in ((A, ports[:2]), (B, ports[2:])):
            path = write_config(str(root / f"{ident}.json"),
                                {"ipAddress": LOCAL, "port": mgmt, "managementPort": mgmt, "metricsPort": met,
                                 **certs.server_config()},
                                kv={"deviceCount": 2, "listenPortBase": base, "linkTotalTimeMs": 1500,
                                    "linkRetryIntervalMs": 50, "testKv": TEST_KV, "linkSecretFile": str(secret)})
            servers[ident] = Serve(path)
            clients[ident] = certs.client(mgmt)
            metrics[ident] = certs.client(met)
        for s in servers.values():
            s.wait_ready()
        yield SimpleNamespace(certs=certs, servers=servers, c=clients, m=metrics, base=base,
                              port={A: ports[0], B: ports[2]}, root=root)
    finally:
        for s in servers.values():
            s.stop()


def body(me, *peers):
    return decode_body(me, DEV[me], [(p, DEV[p]) for p in peers])


def metric(text, name, **labels):
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{re.escape(name)}{{{re.escape(want)}}} (\S+)$" if labels else
                  rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def metric_sum(text, name, **labels):
    """The sum of every sample of ``name`` whose labels include ``labels`` (the engines' families
    carry more labels: ``peer``, ``path``)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}{{(.*)}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1).split(",") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def pull(pair, who, target):
    return pair.c[who].request("POST", "/v1/pdlink/test/kv/pull", {"target": target})


def assign(pair, roles):
    """Post every role first (as the controller does), then wait for each node to be ready."""
    for who, (role, peers) in roles.items():
        pair.c[who].post_role(role, body(who, *peers))
    return {who: pair.c[who].wait_ready(role, timeout=20, interval=0.05) for who, (role, _) in roles.items()}


def test_kv_flows_prefill_to_decode_then_back_after_a_swap(pair):
    ready = assign(pair, {A: ("prefill", [B]), B: ("decode", [A])})
    a, b = ready[A], ready[B]
    assert a["linkStatus"]["peers"] == [{"target": B, "link": "ok"}]
    assert b["linkStatus"]["peers"] == [{"target": A, "link": "ok"}]
    assert [d["listen"] for d in a["pdlink"]["devices"]] == [f"127.0.0.1:{pair.base}", f"127.0.0.1:{pair.base + 1}"]
    assert [d["listen"] for d in b["pdlink"]["devices"]] == [None, None]  # a decoder does not listen
    for i, dev in enumerate(b["pdlink"]["devices"]):  # device i linked to the peer's device i, decode dialled
        (link,) = dev["links"]
        assert link["target"] == A and link["initiator"] and link["address"] == f"127.0.0.1:{pair.base + i}"
    assert a["resource"]["totalNpuBlockNums"] == 2 * TEST_KV["numBlocks"]

    # KV: decode pulls prefill's test cache on both devices and verifies every byte
    resp = pull(pair, B, A)
    assert resp.status == 200, resp.body
    assert resp.json()["verified"] is True and resp.json()["bytes"] == PULL_BYTES
    text = pair.m[B].metrics()
    # the engines' telemetry, one engine per device (pdlink.metrics with the server's device label)
    for device in ("0", "1"):
        assert metric_sum(text, "pdlink_transfer_bytes_total", device=device, op="pull", peer=str(A)) == PULL_BYTES / 2
        assert metric_sum(text, "pdlink_transfers_total", device=device, op="pull", peer=str(A)) == 1
        assert metric_sum(text, "pdlink_transfer_seconds_count", device=device, op="pull", stage="total") == 1
        assert metric_sum(text, "pdlink_links", device=device) == 1
    assert metric(text, "pdlink_role_switches_total", role="decode") == 1
    assert metric(text, "pdlink_role_info", role="decode", role_status="RoleReady") == 1

    # swap the roles through the API: A by the client, B by the `pdlink role` CLI
    pair.c[A].post_role("decode", body(A, B))
    c = pair.certs
    out = subprocess.run(
        [sys.executable, "-m", "pdlink", "role", "prefill", "--server", f"127.0.0.1:{pair.port[B]}",
         "--ca", c.ca, "--cert", c.client_cert, "--key", c.client_key, "--local", f"{B}@127.0.0.1:2,3",
         "--peer", f"{A}@127.0.0.1:0,1", "--interval", "0.05", "--wait-timeout", "20"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("prefill: accepted\n")
    cli_status = json.loads(out.stdout.split("\n", 1)[1])
    assert cli_status["service"] == {"roleStatus": "RoleReady", "currentRole": "prefill"}
    a = pair.c[A].wait_ready("decode", timeout=20, interval=0.05)
    assert a["linkStatus"]["peers"] == [{"target": B, "link": "ok"}]
    assert [d["listen"] for d in a["pdlink"]["devices"]] == [None, None]
    b = pair.c[B].status()
    assert [d["listen"] for d in b["pdlink"]["devices"]] == [f"127.0.0.1:{pair.base + 2}",
                                                            f"127.0.0.1:{pair.base + 3}"]

    # KV flows the other way: the new decoder (A) pulls the new prefill's (B) cache
    resp = pull(pair, A, B)
    assert resp.status == 200 and resp.json()["verified"] is True, resp.body
    text = pair.m[A].metrics()
    assert metric(text, "pdlink_role_switches_total", role="prefill") == 1
    assert metric(text, "pdlink_role_switches_total", role="decode") == 1
    assert metric_sum(text, "pdlink_transfer_bytes_total", op="pull", peer=str(B)) == PULL_BYTES

    out = subprocess.run([sys.executable, "-m", "pdlink", "status", "--server", f"127.0.0.1:{pair.port[A]}",
                          "--ca", c.ca, "--cert", c.client_cert, "--key", c.client_key, "--config"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["status"]["service"]["currentRole"] == "decode" and doc["config"]["worldSize"] == 2


def test_peer_diff_failed_peer_lost_link_and_health(pair):
    assign(pair, {A: ("decode", [B]), B: ("prefill", [A])})
    links_before = [d["links"] for d in pair.c[B].status()["pdlink"]["devices"]]
    switches_before = metric(pair.m[B].metrics(), "pdlink_role_switches_total", role="prefill")

    # same role, one peer added (C never comes up): a diff, the link to A is kept as it is
    pair.c[B].post_role("prefill", body(B, A, C))
    status = wait_for(lambda: (s := pair.c[B].status())["service"]["roleStatus"] == "RoleReady" and
                      len(s["linkStatus"]["peers"]) == 2 and s, 15)
    assert status, pair.c[B].status()
    peers = {p["target"]: p["link"] for p in status["linkStatus"]["peers"]}
    assert peers[A] == "ok"
    assert peers[C].startswith("failed : ") and "did not link in" in peers[C]  # B listens, C would dial it
    assert [d["links"] for d in status["pdlink"]["devices"]] == links_before  # not relinked
    assert metric(pair.m[B].metrics(), "pdlink_role_switches_total", role="prefill") == switches_before
    assert pair.c[A].status()["linkStatus"]["peers"] == [{"target": B, "link": "ok"}]
    assert pull(pair, A, B).json()["verified"] is True
    bad = pull(pair, A, 99)  # not a linked peer: the pull fails cleanly, a conflict with the link state
    assert bad.status == 409
    assert bad.json()["error_type"] == "LLM_NOT_YET_LINK"

    # A is dropped from B's peers: B unlinks it; A sees the link lost and turns unhealthy
    pair.c[B].post_role("prefill", body(B, C))
    lost = wait_for(lambda: (s := pair.c[A].status())["linkStatus"]["peers"][0]["link"] != "ok" and s, 10)
    assert lost and lost["linkStatus"]["peers"][0]["link"].startswith("failed : link lost")
    resp = pair.c[A].request("GET", "/health")
    assert resp.status == 500 and set(resp.json()) == {"error", "error_type"}
    resp = pair.c[A].request("GET", "/v2/health/live")
    assert resp.status == 500 and "message" in resp.json()
    assert wait_for(lambda: all(not d["links"] for d in pair.c[B].status()["pdlink"]["devices"]), 10)

    # the controller re-posts both: the link comes back, health too
    ready = assign(pair, {B: ("prefill", [A]), A: ("decode", [B])})
    assert ready[A]["linkStatus"]["peers"] == [{"target": B, "link": "ok"}]
    assert pair.c[A].request("GET", "/health").status == 200
    assert pull(pair, A, B).json()["verified"] is True
    assert all(s.alive() for s in pair.servers.values())


def test_an_engine_without_the_link_secret_cannot_link(pair):
    """D (another server, another secret) is told to decode from B (prefill): its link is refused
    in the handshake and reported; B is unaffected."""
    D = 4
    (mgmt,) = free_ports(1)
    path = write_config(str(pair.root / "d.json"),
                        {"ipAddress": LOCAL, "port": mgmt, "metricsPort": mgmt, **pair.certs.server_config()},
                        kv={"deviceCount": 2, "listenPortBase": pair.base, "linkTotalTimeMs": 500,
                            "linkRetryIntervalMs": 50}, mode=0o600)
    server = Serve(path, env={"PDLINK_LINK_SECRET": "not-the-secret"}).wait_ready()
    try:
        c = pair.certs.client(mgmt)
        c.post_role("decode", decode_body(D, [6, 7], [(B, DEV[B])]))
        status = wait_for(lambda: (s := c.status())["linkStatus"]["peers"] and s, 10)
        (peer,) = status["linkStatus"]["peers"]
        assert peer["target"] == B and "link secret differs" in peer["link"]
        assert pair.c[B].status()["linkStatus"]["peers"] == [{"target": A, "link": "ok"}]
    finally:
        assert server.stop() == 0


def test_servers_stop_cleanly(pair):
    for s in pair.servers.values():
        assert s.stop() == 0
        assert "pdlink serve: stopped" in s.output
        assert "Traceback" not in s.output, s.output
