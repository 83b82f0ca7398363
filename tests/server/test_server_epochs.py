"""Role epochs and phases on the REST shim (issue 34): MindIE's ``POST /v1/role/{role}`` with an
optional ``expected_epoch``, vLLM's ``GET``/``POST /v1/pd_role`` and SGLang's ``POST
/pd_role_switch``, against real ``pdlink serve`` processes over plain HTTP on loopback (one TLS
server checks that the new routes sit behind the same mutual TLS as the others).

What is proven: each shape's answers and status codes; a stale epoch is 409 and changes nothing;
controllers racing with the same expected epoch (threads released together) get exactly one win;
the same role is a success; bad bodies get one exact status and change no state; the router's
poll reaches ``phase == "ready"`` with the epoch + 1; a drain that cannot finish (a test pull held
by a frozen peer) rolls back to the old role and epoch, shown by the phases seen and by the held
pull ending with its own timeout; a controller process killed while its switch drains leaves the
instance ``draining`` and the switch goes on to commit; one killed after its switch left the
instance ``failed`` leaves it in that named phase, and the next post resolves it.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from internals import ManagementClient
from peers import controller
from poll import wait_until
from server_util import LOCAL, Certs, Serve, decode_body, free_block, free_ports, write_config

P_ID, D_ID = 1, 2  # the prefill instance (device 0) and the decode instance (device 1)
SYNC_MS = 3000  # syncKvTimeoutMs: how long a pull from a frozen peer is held
VLLM_KEYS = {"role", "epoch", "phase", "target_role", "active_requests", "error", "transition_seconds"}
SGL_KEYS = {"success", "message", "old_role", "new_role"}


def _serve(root: str, name: str, base: int, test_kv: bool = True, infer_mode: str = "dmi") -> SimpleNamespace:
    mgmt, metrics = free_ports(2)
    path = write_config(os.path.join(root, name, "config.json"),
                        {"ipAddress": LOCAL, "port": mgmt, "managementPort": mgmt, "metricsPort": metrics,
                         "httpsEnabled": False, "inferMode": infer_mode},
                        kv={"listenPortBase": base, "linkTotalTimeMs": 2000, "linkRetryIntervalMs": 50,
                            "syncKvTimeoutMs": SYNC_MS, "roleDrainTimeoutMs": 30000, "testKv": {"enabled": test_kv}})
    server = Serve(path).wait_ready()
    return SimpleNamespace(server=server, port=mgmt, client=ManagementClient(LOCAL, mgmt, https=False, retries=0))


def _body(local: int, dev: int, peer: int, peer_dev: int, **extra: Any) -> dict[str, Any]:
    return dict(decode_body(local, [dev], [(peer, [peer_dev])]), **extra)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """A prefill instance (P) and a decode instance (D), linked, each with the test KV cache."""
    root = str(tmp_path_factory.mktemp("epochs"))
    base = free_block(8)
    p = _serve(root, "p", base)
    try:
        d = _serve(root, "d", base)
        try:
            assert p.client.post_role("prefill", _body(P_ID, 0, D_ID, 1)).status == 200
            assert d.client.post_role("decode", _body(D_ID, 1, P_ID, 0)).status == 200
            for node, role in ((p, "prefill"), (d, "decode")):
                node.client.wait_ready(role, timeout=20, interval=0.02)
            yield SimpleNamespace(p=p, d=d, base=base)
        finally:
            d.server.stop()
    finally:
        p.server.stop()


@pytest.fixture
def fresh(tmp_path) -> Iterator[SimpleNamespace]:
    """One instance that has no role yet (its peer, instance 9, never exists)."""
    node = _serve(str(tmp_path), "fresh", free_block(8))
    try:
        yield node
    finally:
        node.server.stop()


def pd_role(node: SimpleNamespace) -> dict[str, Any]:
    return node.client.get_json("/v1/pd_role")


def state(node: SimpleNamespace) -> tuple[Any, ...]:
    """Everything a refused post must leave as it was."""
    doc, status = pd_role(node), node.client.status()
    return (doc["role"], doc["epoch"], doc["phase"], status["service"]["currentRole"], status["pdlink"]["generation"],
            status["pdlink"]["appliedGeneration"], status["pdlink"]["engineRole"])


def ready_at(node: SimpleNamespace, role: str, epoch: int, timeout: float = 20) -> dict[str, Any]:
    """The router's poll: until ``phase == "ready"`` with ``role`` at ``epoch``."""
    return wait_until(lambda: (doc := pd_role(node))["phase"] == "ready" and doc["role"] == role
                      and doc["epoch"] == epoch and doc, timeout, f"ready as {role} at epoch {epoch}")


def vllm_post(node: SimpleNamespace, role: str, epoch: int, drain: float | None = 30.0):
    body: dict[str, Any] = {"role": role, "expected_epoch": epoch}
    if drain is not None:
        body["drain_timeout"] = drain
    return node.client.request("POST", "/v1/pd_role", body)


def back_to(node: SimpleNamespace, role: str) -> int:
    """Put ``node`` in ``role`` (vLLM's shape) and return its epoch."""
    doc = pd_role(node)
    if doc["role"] == role and doc["phase"] == "ready":
        return int(doc["epoch"])
    assert vllm_post(node, role, doc["epoch"]).status == 202
    return int(ready_at(node, role, doc["epoch"] + 1)["epoch"])


# ------------------------------------------------------------------------------ a fresh instance

def test_a_fresh_instance_is_ready_at_epoch_0_and_its_first_role_is_epoch_1(fresh):
    doc = pd_role(fresh)
    assert doc == {"role": None, "epoch": 0, "phase": "ready", "target_role": None, "active_requests": 0,
                   "error": None, "transition_seconds": None}
    s = fresh.client.status()["pdlink"]
    assert (s["epoch"], s["phase"], s["generation"]) == (0, "ready", 0)
    # only MindIE's post carries the peers a first assignment needs
    r = vllm_post(fresh, "decode", 0)
    assert r.status == 409 and "POST /v1/role" in r.json()["detail"]
    r = fresh.client.request("POST", "/pd_role_switch", {"new_role": "decode"})
    assert r.status == 400
    assert r.json() == {"success": False, "message": r.json()["message"], "old_role": None, "new_role": "decode"}
    assert "not running in PD" in r.json()["message"]
    # a stale epoch on MindIE's post: 409, nothing accepted
    r = fresh.client.request("POST", "/v1/role/decode", _body(D_ID, 1, 9, 0, expected_epoch=1))
    assert r.status == 409 and r.json()["error_type"] == "Conflict" and "stale role epoch" in r.json()["error"]
    assert state(fresh) == (None, 0, "ready", "none", 0, 0, None)
    r = fresh.client.request("POST", "/v1/role/decode", _body(D_ID, 1, 9, 0, expected_epoch=0))
    assert r.status == 200 and r.json() == {"result": "ok"}
    doc = ready_at(fresh, "decode", 1)
    assert doc["target_role"] == "decode" and doc["error"] is None and doc["transition_seconds"] >= 0
    s = fresh.client.status()["pdlink"]
    assert (s["epoch"], s["phase"], s["generation"], s["appliedGeneration"]) == (1, "ready", 1, 1)


def test_mindies_unfenced_posts_coalesce_and_count_committed_changes_only(fresh):
    """Without an epoch a post is MindIE's as before (200, coalesced); the epoch counts the role
    changes that were committed, generation every accepted post."""
    c = fresh.client
    assert c.post_role("decode", _body(D_ID, 1, 9, 0)).status == 200
    ready_at(fresh, "decode", 1)
    assert c.post_role("decode", _body(D_ID, 1, 8, 0)).status == 200  # peers only: no role change
    gen = int(c.post_role("prefill", _body(D_ID, 1, 9, 0)).headers["x-pdlink-generation"])
    wait_until(lambda: c.status()["pdlink"]["appliedGeneration"] == gen, 20, "applied")
    s = ready_at(fresh, "prefill", 2)
    assert c.status()["pdlink"]["generation"] == 3 and s["epoch"] == 2


def test_a_fenced_mindie_post_that_changes_only_peers_keeps_the_epoch(pair):
    d = pair.d
    e = back_to(d, "decode")
    r = d.client.request("POST", "/v1/role/decode", _body(D_ID, 1, 7, 5, expected_epoch=e))
    assert r.status == 200
    gen = int(r.headers["x-pdlink-generation"])
    wait_until(lambda: d.client.status()["pdlink"]["appliedGeneration"] == gen, 20, "applied")
    ready_at(d, "decode", e)
    assert [p["target"] for p in d.client.status()["pdlink"]["peers"]] == [7]
    r = d.client.request("POST", "/v1/role/decode", _body(D_ID, 1, P_ID, 0, expected_epoch=e))
    assert r.status == 200
    ready_at(d, "decode", e)
    d.client.wait_ready("decode", timeout=20, interval=0.02)


# ------------------------------------------------------------------------------ vLLM's shape

def test_vllm_switch_is_accepted_and_polled_to_ready_with_epoch_plus_one(pair):
    d = pair.d
    e = back_to(d, "decode")
    r = vllm_post(d, "prefill", e, drain=5)
    assert r.status == 202
    doc = r.json()
    assert set(doc) == VLLM_KEYS
    assert doc["target_role"] == "prefill" and doc["epoch"] == e and doc["role"] == "decode"
    assert doc["phase"] in ("draining", "switching", "ready")
    done = ready_at(d, "prefill", e + 1)
    assert done["error"] is None and d.client.status()["pdlink"]["engineRole"] == "prefill"
    # the role it has at its epoch: accepted, nothing changes; one epoch behind is stale even for
    # that role (vLLM's code accepts it as a retry: see docs/compatibility.md)
    before = state(d)
    assert vllm_post(d, "prefill", e + 1).status == 202
    assert vllm_post(d, "prefill", e).status == 409
    assert state(d) == before
    # a stale epoch: 409, nothing changes
    before = state(d)
    r = vllm_post(d, "decode", e)
    assert r.status == 409 and "stale" in r.json()["detail"].lower()
    assert state(d) == before
    # drain_timeout may be left out (roleDrainTimeoutMs)
    assert vllm_post(d, "decode", e + 1, drain=None).status == 202
    ready_at(d, "decode", e + 2)
    # the decode instance is linked again and pulls byte-exact (the node verifies each byte)
    d.client.wait_ready("decode", timeout=20, interval=0.02)
    r = d.client.request("POST", "/v1/pdlink/test/kv/pull", {"target": P_ID})
    assert r.status == 200 and r.json()["verified"] is True


def test_flex_is_a_role_too(pair):
    d = pair.d
    e = back_to(d, "decode")
    assert vllm_post(d, "flex", e).status == 202
    ready_at(d, "flex", e + 1)
    assert d.client.status()["service"]["currentRole"] == "flex"
    back_to(d, "decode")


# ------------------------------------------------------------------------------ SGLang's shape

def test_sglang_switch_same_role_and_refusals(pair):
    d = pair.d
    e = back_to(d, "decode")
    r = d.client.request("POST", "/pd_role_switch", {"new_role": "decode"})
    assert r.status == 200
    assert r.json() == {"success": True, "message": "already in target role", "old_role": "decode",
                        "new_role": "decode"}
    assert pd_role(d)["epoch"] == e
    r = d.client.request("POST", "/pd_role_switch", {"new_role": "prefill"})
    assert r.status == 200
    assert r.json() == {"success": True, "message": "ok", "old_role": "decode", "new_role": "prefill"}
    doc = pd_role(d)  # answered once the switch is done
    assert (doc["role"], doc["epoch"], doc["phase"]) == ("prefill", e + 1, "ready")
    r = d.client.request("POST", "/pd_role_switch", {"new_role": "decode"})
    assert r.status == 200 and r.json()["old_role"] == "prefill" and r.json()["new_role"] == "decode"
    assert pd_role(d)["epoch"] == e + 2


# ------------------------------------------------------------------------------ bad bodies

VLLM_BAD = [
    ("not json", b"{", "application/json"),
    ("not an object", b"[]", "application/json"),
    ("no role", b'{"expected_epoch": 0}', "application/json"),
    ("unknown role", b'{"role": "mix", "expected_epoch": 0}', "application/json"),
    ("role not a string", b'{"role": ["decode"], "expected_epoch": 0}', "application/json"),
    ("no epoch", b'{"role": "decode"}', "application/json"),
    ("negative epoch", b'{"role": "decode", "expected_epoch": -1}', "application/json"),
    ("epoch a bool", b'{"role": "decode", "expected_epoch": true}', "application/json"),
    ("epoch a float", b'{"role": "decode", "expected_epoch": 0.5}', "application/json"),
    ("drain 0", b'{"role": "decode", "expected_epoch": 0, "drain_timeout": 0}', "application/json"),
    ("drain over 3600", b'{"role": "decode", "expected_epoch": 0, "drain_timeout": 3600.5}', "application/json"),
    ("drain a string", b'{"role": "decode", "expected_epoch": 0, "drain_timeout": "1"}', "application/json"),
    ("NaN", b'{"role": "decode", "expected_epoch": 0, "drain_timeout": NaN}', "application/json"),
    ("not json content type", b'{"role": "decode", "expected_epoch": 0}', "text/plain"),
]


def _raw(node: SimpleNamespace, path: str, data: bytes, ctype: str):
    return node.client.request("POST", path, data, headers={"Content-Type": ctype})


@pytest.mark.parametrize("name,data,ctype", VLLM_BAD, ids=[b[0] for b in VLLM_BAD])
def test_vllm_bad_bodies_are_422_and_change_nothing(pair, name, data, ctype):
    before = state(pair.d)
    r = _raw(pair.d, "/v1/pd_role", data, ctype)
    assert r.status == 422, (r.status, r.body)
    assert set(r.json()) == {"detail", "error", "error_type"}
    assert state(pair.d) == before


SGL_BAD = [
    ("not json", b"{", "application/json"),
    ("no new_role", b"{}", "application/json"),
    ("unknown role", b'{"new_role": "both"}', "application/json"),
    ("empty role", b'{"new_role": ""}', "application/json"),
    ("flex is not SGLang's", b'{"new_role": "flex"}', "application/json"),
    ("role not a string", b'{"new_role": 1}', "application/json"),
    ("not json content type", b'{"new_role": "prefill"}', "text/plain"),
]


@pytest.mark.parametrize("name,data,ctype", SGL_BAD, ids=[b[0] for b in SGL_BAD])
def test_sglang_bad_bodies_are_400_and_change_nothing(pair, name, data, ctype):
    before = state(pair.d)
    r = _raw(pair.d, "/pd_role_switch", data, ctype)
    assert r.status == 400, (r.status, r.body)
    assert set(r.json()) == SGL_KEYS and r.json()["success"] is False
    assert state(pair.d) == before


@pytest.mark.parametrize("epoch", [-1, "0", True, 0.5, 2**63])
def test_mindie_bad_expected_epoch_is_422_and_changes_nothing(pair, epoch):
    before = state(pair.d)
    r = pair.d.client.request("POST", "/v1/role/prefill", _body(D_ID, 1, P_ID, 0, expected_epoch=epoch))
    assert r.status == 422 and "expected_epoch" in r.json()["error"]
    assert state(pair.d) == before


def test_oversized_switch_bodies_are_413(pair):
    before = state(pair.d)
    big = b'{"role": "decode", "expected_epoch": 0, "pad": "' + b"x" * 5000 + b'"}'
    assert _raw(pair.d, "/v1/pd_role", big, "application/json").status == 413
    assert _raw(pair.d, "/pd_role_switch", big, "application/json").status == 413
    assert state(pair.d) == before


# ------------------------------------------------------------------------------ racing controllers

def _race(n: int, post) -> list[Any]:
    """``post(i)`` from ``n`` threads released together; their responses."""
    gate = threading.Barrier(n)
    out: list[Any] = [None] * n

    def run(i: int) -> None:
        gate.wait(10)
        out[i] = post(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_racing_vllm_controllers_exactly_one_wins(pair):
    d = pair.d
    e = back_to(d, "decode")
    results = _race(8, lambda i: vllm_post(d, "prefill" if i % 2 else "flex", e))
    codes = sorted(r.status for r in results)
    assert codes == [202] + [409] * 7, codes
    won = next(r for r in results if r.status == 202).json()["target_role"]
    ready_at(d, won, e + 1)
    assert d.client.status()["pdlink"]["engineRole"] == won  # never between roles: one of them, at e + 1
    back_to(d, "decode")


def test_racing_mindie_controllers_with_an_epoch_exactly_one_wins(pair):
    d = pair.d
    e = back_to(d, "decode")
    gen = d.client.status()["pdlink"]["generation"]
    roles = ["prefill", "flex", "prefill", "flex"]
    results = _race(4, lambda i: d.client.request("POST", f"/v1/role/{roles[i]}",
                                                  _body(D_ID, 1, P_ID, 0, expected_epoch=e)))
    assert sorted(r.status for r in results) == [200, 409, 409, 409]
    won = roles[next(i for i, r in enumerate(results) if r.status == 200)]
    ready_at(d, won, e + 1)
    s = d.client.status()
    assert s["pdlink"]["generation"] == gen + 1 and s["service"]["currentRole"] == won  # nothing coalesced
    back_to(d, "decode")


def test_mixed_shapes_race_exactly_one_wins(pair):
    d = pair.d
    e = back_to(d, "decode")

    def post(i: int):
        if i == 0:
            return d.client.request("POST", "/v1/role/prefill", _body(D_ID, 1, P_ID, 0, expected_epoch=e))
        return vllm_post(d, "flex", e)

    results = _race(2, post)
    assert sorted(r.status for r in results) in ([200, 409], [202, 409])
    ready_at(d, "prefill" if results[0].status == 200 else "flex", e + 1)
    back_to(d, "decode")


# ------------------------------------------------------------------------------ drain timeout

def _frozen(node: SimpleNamespace) -> Any:
    class Frozen:
        def __enter__(self) -> None:
            os.kill(node.server.proc.pid, signal.SIGSTOP)

        def __exit__(self, *exc: object) -> None:
            os.kill(node.server.proc.pid, signal.SIGCONT)

    return Frozen()


def _start_held_pull(d: SimpleNamespace, held: dict[str, Any]) -> threading.Thread:
    """Starts a test pull of ``d`` from the (frozen) prefill on a thread, its response stored in
    ``held["r"]``; returns once ``d`` counts it in flight."""
    puller = threading.Thread(target=lambda: held.update(
        r=ManagementClient(LOCAL, d.port, https=False, retries=0, timeout=60).request(
            "POST", "/v1/pdlink/test/kv/pull", {"target": P_ID})))
    puller.start()
    wait_until(lambda: pd_role(d)["active_requests"] == 1, 10, "the pull is in flight")
    return puller


def test_drain_timeout_rolls_back_to_the_old_role_and_epoch(pair):
    """A test pull held by a frozen peer cannot finish within a 0.2 s drain: the switch goes
    ``rolling_back`` (admission stays closed until the held pull has ended with its own timeout),
    then ``ready`` with the old role at the old epoch; the next post switches."""
    d = pair.d
    e = back_to(d, "decode")
    d.client.wait_ready("decode", timeout=20, interval=0.02)
    held: dict[str, Any] = {}
    with _frozen(pair.p):
        puller = _start_held_pull(d, held)
        before = state(d)
        r = d.client.request("POST", "/pd_role_switch", {"new_role": "prefill"})  # SGLang refuses, no drain
        assert r.status == 400 and "not idle" in r.json()["message"] and r.json()["success"] is False
        assert state(d) == before
        r = vllm_post(d, "prefill", e, drain=0.2)
        assert r.status == 202
        seen = wait_until(lambda: (doc := pd_role(d))["phase"] == "rolling_back" and doc, 10, "rolling_back")
        assert (seen["role"], seen["epoch"]) == ("decode", e)
        # fenced meanwhile: a new pull is refused, a new switch too
        r = d.client.request("POST", "/v1/pdlink/test/kv/pull", {"target": P_ID})
        assert r.status == 409 and r.json()["error_type"] == "Conflict"
        assert vllm_post(d, "prefill", e).status == 409
        r = d.client.request("POST", "/v1/role/prefill", _body(D_ID, 1, P_ID, 0, expected_epoch=e))
        assert r.status == 409 and "in progress" in r.json()["error"]
        r = d.client.request("POST", "/v1/role/prefill", _body(D_ID, 1, P_ID, 0))  # MindIE's unfenced post
        assert r.status == 503 and "fenced role switch" in r.json()["error"]
        r = d.client.request("POST", "/pd_role_switch", {"new_role": "prefill"})
        assert r.status == 400 and "in progress" in r.json()["message"]
        puller.join(60)
    assert held["r"].status == 504 and held["r"].json()["error_type"] == "LLM_TIMEOUT"  # it was held
    doc = ready_at(d, "decode", e)
    assert "drain timeout" in doc["error"] and doc["target_role"] == "prefill"
    s = d.client.status()
    assert s["service"]["currentRole"] == "decode" and s["pdlink"]["engineRole"] == "decode"
    assert s["pdlink"]["epoch"] == e and s["pdlink"]["phase"] == "ready"
    assert vllm_post(d, "prefill", e).status == 202
    ready_at(d, "prefill", e + 1)
    back_to(d, "decode")


# ------------------------------------------------------------------------------ controller death

def test_a_controller_that_dies_leaves_a_named_phase_and_the_next_post_resolves_it(pair, peers):
    """A controller process posts a switch to prefill while D's listen port is taken, and is
    killed: D is ``failed`` (the role is uncertain), keeps saying so, admits no fenced post from a
    stale epoch, and the next controller's post at the epoch resolves it."""
    d = pair.d
    e = back_to(d, "decode")
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind((LOCAL, pair.base + 1))  # D's device 1 listens at listenPortBase + 1 as prefill
    blocker.listen(1)
    try:
        first = peers("controller")
        status, doc = first.call(controller.post, d.port, "/v1/pd_role",
                                 {"role": "prefill", "expected_epoch": e, "drain_timeout": 30})
        assert status == 202 and doc["target_role"] == "prefill"
        failed = wait_until(lambda: (x := pd_role(d))["phase"] == "failed" and x, 20, "failed")
        first.kill()
        assert failed["epoch"] == e and failed["error"]
        assert pd_role(d)["phase"] == "failed"  # nobody resolves it by itself
        assert d.client.status()["service"]["roleStatus"] == "RoleUnknown"
        assert vllm_post(d, "prefill", e - 1).status == 409  # still fenced by the epoch
        r = d.client.request("POST", "/pd_role_switch", {"new_role": "prefill"})  # a post that fails again
        assert r.status == 400 and "switch failed" in r.json()["message"]
        assert r.json()["old_role"] == "decode" and pd_role(d)["phase"] == "failed"
    finally:
        blocker.close()
    second = peers("controller-2")
    status, doc = second.call(controller.post, d.port, "/v1/pd_role", {"role": "prefill", "expected_epoch": e})
    assert status == 202
    done = ready_at(d, "prefill", e + 1)
    assert done["error"] is None
    assert second.call(controller.pd_role, d.port)["epoch"] == e + 1
    back_to(d, "decode")


def test_a_controller_killed_while_its_switch_drains_leaves_it_draining_and_it_goes_on(pair, peers):
    """The switch a controller started is the server's: killed while the drain waits for a pull
    held by a frozen peer, the instance stays ``draining`` (admitting no other switch), and once
    the pull has ended the switch commits at epoch + 1 with nobody asking again."""
    d = pair.d
    e = back_to(d, "decode")
    d.client.wait_ready("decode", timeout=20, interval=0.02)
    ctl = peers("controller")
    assert ctl.call(controller.pd_role, d.port)["epoch"] == e  # started before anything is held
    held: dict[str, Any] = {}
    with _frozen(pair.p):
        puller = _start_held_pull(d, held)
        status, doc = ctl.call(controller.post, d.port, "/v1/pd_role",
                               {"role": "prefill", "expected_epoch": e, "drain_timeout": 60})
        assert status == 202 and doc["phase"] == "draining"
        ctl.kill()
        doc = pd_role(d)
        assert (doc["phase"], doc["role"], doc["epoch"], doc["active_requests"]) == ("draining", "decode", e, 1)
        assert vllm_post(d, "flex", e).status == 409  # another controller cannot take over
    puller.join(60)
    assert "r" in held  # the held pull ended (verified, or its own timeout if the thaw came late)
    done = ready_at(d, "prefill", e + 1)
    assert done["error"] is None and done["target_role"] == "prefill"
    back_to(d, "decode")


# ------------------------------------------------------------------------------ off and over TLS

def test_standard_infer_mode_has_no_pd_role(tmp_path):
    node = _serve(str(tmp_path), "std", free_block(8), test_kv=False, infer_mode="standard")
    try:
        assert node.client.request("GET", "/v1/pd_role").status == 404
        assert vllm_post(node, "decode", 0).status == 404
        r = node.client.request("POST", "/pd_role_switch", {"new_role": "decode"})
        assert r.status == 400 and "not running in PD" in r.json()["message"]
        assert node.client.status()["pdlink"]["phase"] == "ready"
    finally:
        assert node.server.stop() == 0


def test_the_new_routes_need_the_client_certificate(tmp_path):
    certs = Certs(str(tmp_path / "certs"))
    mgmt, metrics = free_ports(2)
    path = write_config(str(tmp_path / "config.json"),
                        {"ipAddress": LOCAL, "port": mgmt, "managementPort": mgmt, "metricsPort": metrics,
                         **certs.server_config()}, kv={"listenPortBase": free_block(8)})
    server = Serve(path).wait_ready()
    try:
        good = certs.client(mgmt)
        assert good.get_json("/v1/pd_role")["phase"] == "ready"
        anonymous = ManagementClient(LOCAL, mgmt, ca=certs.ca, retries=0)
        for method, route in (("GET", "/v1/pd_role"), ("POST", "/v1/pd_role"), ("POST", "/pd_role_switch")):
            with pytest.raises(Exception):  # noqa: B017 - the handshake fails: no HTTP status at all
                anonymous.request(method, route, {"new_role": "decode"} if method == "POST" else None)
    finally:
        server.stop()


def test_no_unhandled_error_was_logged(pair):
    for node in (pair.p, pair.d):
        assert node.server.alive()
        assert "unhandled error" not in node.server.output
