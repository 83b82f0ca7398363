"""Helpers for the rank-table link API (``LLMDataDist.link``): HCCL rank tables naming loopback
devices, a free port to put PDLINK_LINK_PORT_BASE on (comm.py: a rank's endpoint is its
``device_ip`` at that base plus its ``device_id``), and the status poll."""

from __future__ import annotations

import json

from llm_datadist import RegisterMemStatus
from peer import Peer
from peers import kv
from poll import wait_until
from ports import free_port  # noqa: F401 (the comm-link tests import it from here)


def rank_table(version: str = "1.2", super_pod: bool = True, ips: tuple[str, ...] = ("127.0.0.1", "127.0.0.2")) -> str:
    """One server per address, each with device 0 as rank i (rank i's endpoint: ``ips[i]`` at the
    port base)."""
    servers = [{"server_id": f"host{i}", "device": [{"device_id": "0", "device_ip": ip, "rank_id": str(i)}]}
               for i, ip in enumerate(ips)]
    table: dict[str, object] = {"version": version, "server_count": str(len(servers)), "server_list": servers,
                                "status": "completed"}
    if super_pod:
        table["super_pod_list"] = [{"super_pod_id": "0",
                                    "server_list": [{"server_id": s["server_id"]} for s in servers]}]
    return json.dumps(table)


def wait_ok(peer: Peer, comm_id: int, limit: float = 20.0) -> None:
    """Polls ``query_register_mem_status`` in ``peer`` until OK (PREPARING meanwhile, nothing else)."""
    def ok() -> bool:
        status = peer.call(kv.comm_status, comm_id)
        assert status in (RegisterMemStatus.PREPARING, RegisterMemStatus.OK), status
        return bool(status == RegisterMemStatus.OK)

    wait_until(ok, limit, f"comm {comm_id} OK")
