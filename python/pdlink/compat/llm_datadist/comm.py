"""Two-sided links from an HCCL rank table: ``LLMDataDist.link`` / ``unlink`` /
``query_register_mem_status`` (llm_datadist llm_datadist_api.md §6.7, CacheManager mode).

Every member of a communicator calls ``link(comm_name, cluster_rank_info, rank_table)`` with
the same arguments. pdlink has no HCCL, so the rank table is used as an address book: each
rank's endpoint is ``(device_ip, PDLINK_LINK_PORT_BASE + device_id)`` (base 26800 unless the
environment variable says otherwise). For every pair of members the higher rank dials the
lower rank's endpoint, retrying until it answers, on a background thread; ``link`` returns a
comm id at once and ``query_register_mem_status`` reports PREPARING until every pair is
linked, then OK, or FAILED once the link time (``llm.LinkTotalTime`` seconds, else
``HCCL_CONNECT_TIMEOUT``, else 120 s) has passed. Transfers before that fail with
LLM_NOT_YET_LINK, because the link entity does not exist yet.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
import time
from typing import TYPE_CHECKING

from ... import constants, environment
from ...status import LLMException, LLMStatusCode
from ._utils import (
    check_dict,
    check_isinstance,
    check_uint32,
    check_uint64,
    handle_llm_status,
    raise_if_false,
    raising_as,
)
from .llm_types import RegisterMemStatus

if TYPE_CHECKING:
    from ...engine import Engine

logger = logging.getLogger("pdlink")

_DIAL_ATTEMPT_MS = 1000
_RETRY_PAUSE_S = 0.05
_MAX_COMM_NAME = 128
_MAX_COMMS = 512


def _param(msg: str) -> LLMException:
    return LLMException(msg, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def port_base() -> int:
    raw = environment.link_port_base()
    raise_if_false(raw.isdigit() and 0 < int(raw) < 65536 - 64, f"PDLINK_LINK_PORT_BASE is not a port: {raw!r}")
    return int(raw)


def parse_rank_table(rank_table: str) -> dict[int, tuple[str, int]]:
    """rank id -> (device_ip, device_id) from an HCCL rank table, version "1.0" or "1.2".

    Checks: valid JSON object; version; status "completed" when present; server_count equal
    to the server list's length when present; every device entry with a digit-string
    device_id and rank_id and an IPv4 device_ip; rank ids unique; for 1.2, super_pod_list
    entries naming servers that exist. Any problem is LLMException(LLM_PARAM_INVALID).
    """
    check_isinstance("rank_table", rank_table, str, allow_none=False)
    try:
        table = json.loads(rank_table)
    except ValueError as e:
        raise _param(f"rank_table is not valid JSON: {e}") from None
    raise_if_false(isinstance(table, dict), "rank_table must be a JSON object")
    version = table.get("version")
    raise_if_false(version in ("1.0", "1.2"), f"rank_table version must be '1.0' or '1.2', got {version!r}")
    if "status" in table:
        raise_if_false(table["status"] == "completed",
                       f"rank_table status must be 'completed', got {table['status']!r}")
    servers = table.get("server_list")
    raise_if_false(isinstance(servers, list) and servers, "rank_table needs a non-empty server_list")
    if "server_count" in table:
        raise_if_false(str(table["server_count"]) == str(len(servers)),
                       f"rank_table server_count {table['server_count']!r} != {len(servers)} servers")
    ranks: dict[int, tuple[str, int]] = {}
    server_ids = set()
    for server in servers:
        raise_if_false(isinstance(server, dict) and isinstance(server.get("device"), list),
                       "each server_list entry needs a device list")
        server_ids.add(str(server.get("server_id", "")))
        for dev in server["device"]:
            raise_if_false(isinstance(dev, dict), "each device entry must be an object")
            dev_id, rank, ip = str(dev.get("device_id", "")), str(dev.get("rank_id", "")), dev.get("device_ip")
            raise_if_false(dev_id.isdigit() and rank.isdigit(),
                           f"device entry needs digit-string device_id and rank_id: {dev}")
            try:
                ipaddress.IPv4Address(ip)
            except (ValueError, TypeError):
                raise _param(f"device entry has an invalid device_ip: {dev}") from None
            raise_if_false(int(rank) not in ranks, f"rank_id {rank} appears twice in rank_table")
            ranks[int(rank)] = (ip, int(dev_id))
    pods = table.get("super_pod_list")
    if pods is not None:
        raise_if_false(version == "1.2", "super_pod_list needs rank_table version 1.2")
        raise_if_false(isinstance(pods, list), "super_pod_list must be a list")
        for pod in pods:
            raise_if_false(isinstance(pod, dict) and isinstance(pod.get("server_list"), list),
                           "each super_pod_list entry needs a server_list")
            for s in pod["server_list"]:
                raise_if_false(isinstance(s, dict) and str(s.get("server_id", "")) in server_ids,
                               f"super_pod_list names an unknown server: {s}")
    return ranks


class _Comm:
    def __init__(self, comm_id: int, name: str, peers: dict[int, tuple[str, int]], dial: list[int], deadline: float,
                 link_seq: int):
        self.comm_id = comm_id
        self.name = name
        self.peers = peers            # peer cluster id -> endpoint (ip, port)
        self.dial = dial              # peers this member dials (lower ranks)
        self.deadline = deadline
        self.failed: str | None = None
        self.ok = False               # sticky, as in llm_datadist: once OK, always OK
        self.link_seq = link_seq      # the engine's link number when link() was called
        self.seen: set[int] = set()   # peers linked since (a link may come and go between polls)
        self.cancelled = threading.Event()
        self.thread: threading.Thread | None = None


class CommManager:
    """The link() communicators of one LLMDataDist. Thread-safe."""

    def __init__(self, engine: Engine, cluster_id: int, link_total_s: float):
        self._engine = engine
        self._cluster_id = cluster_id
        self._link_total_s = link_total_s
        self._comms: dict[int, _Comm] = {}
        self._next_id = 1
        self._lock = threading.Lock()

    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        check_isinstance("comm_name", comm_name, str, allow_none=False)
        raise_if_false(0 < len(comm_name) < _MAX_COMM_NAME, f"comm_name must have 1..{_MAX_COMM_NAME - 1} characters")
        check_dict("cluster_rank_info", cluster_rank_info, int, int)
        raise_if_false(2 <= len(cluster_rank_info) <= 4,
                       f"cluster_rank_info needs 2..4 entries, got {len(cluster_rank_info)}")
        for cid, rank in cluster_rank_info.items():
            check_uint64("cluster_rank_info key", cid)
            check_uint32("cluster_rank_info value", rank)
        ranks = list(cluster_rank_info.values())
        raise_if_false(ranks == sorted(ranks) and len(set(ranks)) == len(ranks),
                       f"cluster_rank_info ranks must be unique and ascending, got {ranks}")
        raise_if_false(self._cluster_id in cluster_rank_info,
                       f"cluster_rank_info does not contain this cluster id {self._cluster_id}")
        table = parse_rank_table(rank_table)
        for rank in ranks:
            raise_if_false(rank in table, f"rank {rank} of cluster_rank_info is not in rank_table")
        base = port_base()
        endpoints = {cid: (table[r][0], base + table[r][1]) for cid, r in cluster_rank_info.items()}
        my_rank = cluster_rank_info[self._cluster_id]
        with self._lock:
            raise_if_false(len(self._comms) < _MAX_COMMS, f"at most {_MAX_COMMS} communicators")
            raise_if_false(all(c.name != comm_name for c in self._comms.values()),
                           f"communicator {comm_name!r} is already linked")
        if any(r > my_rank for r in ranks):  # higher ranks dial us: be reachable
            ip, port = endpoints[self._cluster_id]
            with raising_as("link"):
                self._engine.add_listener((ip, port))
        peers = {cid: ep for cid, ep in endpoints.items() if cid != self._cluster_id}
        dial = [cid for cid in peers if cluster_rank_info[cid] < my_rank]
        with self._lock:
            comm = _Comm(self._next_id, comm_name, peers, dial, time.monotonic() + self._link_total_s,
                         self._engine.linked_since(constants.LATEST_LINK_MARK)[0])
            self._next_id += 1
            self._comms[comm.comm_id] = comm
        if dial:
            comm.thread = threading.Thread(target=self._dial, args=(comm,), name=f"pdlink-link-{comm.comm_id}",
                                           daemon=True)
            comm.thread.start()
        logger.info("link %r: comm %d, rank %d, dialling %s", comm_name, comm.comm_id, my_rank, dial)
        return comm.comm_id

    def _dial(self, comm: _Comm) -> None:
        pending = list(comm.dial)
        while pending and not comm.cancelled.is_set():
            left_ms = int((comm.deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                comm.failed = f"peers {pending} did not answer within the link time"
                logger.warning("link %r: %s", comm.name, comm.failed)
                return
            peers = [(cid, comm.peers[cid]) for cid in pending]
            results = self._engine.connect_each(peers, timeout_ms=max(1, min(_DIAL_ATTEMPT_MS, left_ms)))
            done = {LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK}
            pending = [cid for cid, result in zip(pending, results) if result.status not in done]
            if pending:
                comm.cancelled.wait(_RETRY_PAUSE_S)  # the peer may not have called link() yet

    def _get(self, comm_id: int, unknown: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID) -> _Comm:
        check_uint64("comm_id", comm_id)
        with self._lock:
            comm = self._comms.get(comm_id)
        if comm is None:
            raise LLMException(f"no communicator with comm_id {comm_id} (never linked, or unlinked)",
                               status_code=unknown)
        return comm

    def query(self, comm_id: int) -> RegisterMemStatus:
        """PREPARING, then OK once every member has been linked (sticky: it stays OK after the
        peers unlink, as upstream), or FAILED after the link time. An unknown (or unlinked) comm
        id is LLM_NOT_YET_LINK, as upstream's CommLinkManager answers."""
        comm = self._get(comm_id, LLMStatusCode.LLM_NOT_YET_LINK)
        if comm.ok:  # the peer may have pulled and unlinked between two polls
            return RegisterMemStatus.OK
        if comm.failed:
            return RegisterMemStatus.FAILED
        comm.link_seq, linked = self._engine.linked_since(comm.link_seq)
        comm.seen.update(cid for cid in linked if cid in comm.peers)  # bounded by the members, whoever links
        up = {link.peer_cluster_id for link in self._engine.links() if not link.broken}
        if all(cid in up or cid in comm.seen for cid in comm.peers):
            comm.ok = True
            return RegisterMemStatus.OK
        if time.monotonic() > comm.deadline:
            comm.failed = "link time exceeded"
            return RegisterMemStatus.FAILED
        return RegisterMemStatus.PREPARING

    def unlink(self, comm_id: int, timeout_ms: int = 3000) -> None:
        comm = self._get(comm_id)
        comm.cancelled.set()
        if comm.thread is not None:
            comm.thread.join()
        with self._lock:
            self._comms.pop(comm_id, None)
        # Both members call unlink(); whichever comes second finds the link already gone.
        for result in self._engine.disconnect_each(list(comm.peers), timeout_ms=timeout_ms):
            if result.status not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_NOT_YET_LINK,
                                     LLMStatusCode.LLM_NOTIFY_PROMPT_UNLINK_FAILED):
                handle_llm_status(result.status, "unlink", result.message)

    def close(self) -> None:
        with self._lock:
            comms = list(self._comms.values())
            self._comms.clear()
        for comm in comms:
            comm.cancelled.set()
            if comm.thread is not None:
                comm.thread.join()
