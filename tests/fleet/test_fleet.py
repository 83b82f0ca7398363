"""A small fleet: 8 ``pdlink serve`` instances (mutual TLS on the management plane, a link secret
on every KV link) on 2 emulated hosts, driven by the benchmark's controller (``bench/fleet_driver.py``)
through 5 role storms: the first assignment, one with two hosts partitioned for 2 s, one with an
instance SIGKILLed and restarted, one while a host's link flaps (down and up every 0.5 s for 2 s),
and a last quiet one. Checked:

* every storm converges (every instance RoleReady with its planned role and exactly its planned
  peers, each "ok") within ``STORM_BOUND`` seconds (a hang guard, not a timing claim: the
  benchmark measures the times);
* every test pull is verified (200) or failed with a named code (``ALLOWED``), and none found a
  wrong byte; every pull after a storm converged is verified;
* the faults happened: a probe across the partition, and one across the flapping link, found the
  other host unreachable while it held; the killed instance ran twice and was posted its role again
  by the controller;
* at the end every instance is in the state its status names, and every process is gone.

The same on this machine's loopback (no wire, no partition) runs where emulated hosts cannot be
made. Emulated hosts need ``pdlink.testing.hosts`` and root: without them the hosts case is skipped
with the reason (``hostbed.require_hosts``), or fails under ``PDLINK_REQUIRE_HOSTS=1``.
"""

from __future__ import annotations

import os
import sys

import pytest

from hostbed import require_hosts
from pdlink.testing.hosts import Hosts
from poll import wait_until
from where import REPO

pytest.importorskip("trustme", reason="the fleet test needs the test extra: pip install '.[test]'")
pytest.importorskip("uvicorn", reason="the fleet test needs the server extra: pip install '.[server]'")

sys.path.insert(0, str(REPO / "bench"))
from fleet_driver import Fleet, Loopback, free_bases, summary, workdir_under  # noqa: E402

N, HOSTS, STORMS = 8, 2, 5
PARTITION, KILL, FLAP = 1, 2, 3  # the storms with a fault
STORM_BOUND = 45.0  # s: link attempts give up after 8 s and are posted again; a partition lasts 2 s
# what a pull may answer while a storm converges (a pull after it converged must be 200):
# 409 not linked yet, 503 the link failed or no engine yet, 504 the peer did not answer in time,
# 422 the target is not a peer (yet), "transport" no HTTP answer (the instance is down), 404
# LLM_KV_CACHE_NOT_EXIST the peer has no test cache yet (a restarted prefill's engine listens, and a
# decode links in, a moment before the server registers the test cache: node.py creates the
# engines, then registers it).
ALLOWED = {200, 404, 409, 422, 503, 504, "transport"}


def _hosts(kind: str):
    if kind == "loopback":
        return Loopback(HOSTS), False
    require_hosts()  # skips with the reason, or fails under PDLINK_REQUIRE_HOSTS=1
    return Hosts(HOSTS + 1, profile="dc"), True  # the last host runs the controller


@pytest.mark.parametrize("kind", ["hosts", "loopback"])
def test_a_small_fleet_converges_through_storms_a_partition_and_a_kill(kind):
    hosts_cm, emulated = _hosts(kind)
    anchors: list[int] = []
    with hosts_cm as hosts, workdir_under(str(REPO / "build")) as work:
        if emulated:
            anchors = hosts.anchor_pids()
        bases = (21000, 26000) if emulated else free_bases([hosts[i].ip for i in range(HOSTS)], N // HOSTS)
        fleet = Fleet(hosts, N, work, controller_host=emulated, seed=7, mgmt_base=bases[0], kv_base=bases[1],
                      pullers=1, storm_timeout=STORM_BOUND, pool=8)
        try:
            fleet.start(timeout=90)
            faults = {PARTITION: "partition", FLAP: "flap"} if emulated else {}
            storms = [fleet.storm(faults.get(k, "kill" if k == KILL else ""), partition_s=2.0) for k in range(STORMS)]
            finals = fleet.final_states()
        finally:
            codes = fleet.stop()
        s = summary(fleet)
        logs = {i.index: fleet.log_tail(i) for i in fleet.instances}

    assert [st.converged_s is not None for st in storms] == [True] * STORMS, (s, logs)
    for i, st in finals.items():  # the state each status names is the planned one, every peer linked
        assert fleet.converged(i, st, fleet.roles), (i, st)
    pulls = fleet.pulls
    assert {p.status for p in pulls} <= ALLOWED, s["pulls"]
    assert {p.error_type for p in pulls if p.status == 404} <= {"LLM_KV_CACHE_NOT_EXIST"}, s["pulls"]
    assert all(p.error_type != "Verification Failed" for p in pulls), s["pulls"]
    after = [p for p in pulls if p.phase == "after"]
    assert all(st.after_ok >= 1 for st in storms)  # each converged storm was followed by pulls
    assert [p.status for p in after] == [200] * len(after), s["pulls"]
    assert all(p.nbytes == fleet.pull_bytes for p in pulls if p.status == 200)
    # the kill happened: one instance started twice, and the controller posted to it again
    assert sorted(i.starts for i in fleet.instances) == [1] * (N - 1) + [2]
    assert storms[KILL].reposts >= 1
    assert any("SIGKILLed and restarted" in e for _, e in fleet.timeline.events)
    if emulated:  # the partition and the flapping happened: each cut the hosts apart while it held
        assert storms[PARTITION].probe == "unreachable", storms[PARTITION]
        assert storms[FLAP].probe == "unreachable", storms[FLAP]
    # everything is gone: instances exited on SIGTERM (the killed one's first life was reaped)
    assert set(codes.values()) == {0}, (codes, logs)
    assert fleet.processes_left() == []
    assert not os.path.exists(work)
    wait_until(lambda: all(_gone(p) for p in anchors), 10, "the hosts' namespaces torn down")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie holds no namespace
    except OSError:
        return True
