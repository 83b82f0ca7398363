"""The body contract of ``POST /v1/role/{role}``, written from docs/server.md ("422 rules", from
MindIE's ``DmiRole`` validator as ``docs/reference/mindie_rest_api.md`` §3.1 describes it), not from
the server's code: the REST fuzz (server/test_server_fuzz.py) grades the server's answers with it, so a
rule the server gets wrong shows up as a disagreement instead of being copied into the oracle.

``read(doc)`` returns the facts an answer depends on (``Assignment``), or raises ``Broken`` with
the rule the body breaks.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

MAX_PEERS = 256
MAX_DEVICES = 64
MAX_SUPER_POD_ID = 128  # characters
MAX_POD_INDEX = 2**31 - 1
MAX_ID = 2**64 - 2  # 2**64 - 1 is nobody's id
NUMERIC_DIGITS = 10


class Broken(Exception):
    """The body breaks a rule (the server must answer 422)."""


@dataclass(frozen=True)
class Node:
    server_ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    instance: int          # the instance id: ``id``, else derived from ``server_ip``
    port_ids: tuple[int, ...]  # per device: ``device_id`` when given, else ``device_logical_id``


@dataclass(frozen=True)
class Assignment:
    local: Node
    peers: tuple[Node, ...]


def _given(obj: dict[str, Any], key: str) -> bool:
    """A field that is null counts as absent (as controllers write unset fields)."""
    return obj.get(key) is not None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _address(v: Any, what: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IPv4 or IPv6 address in printable ASCII (a zone id allowed), not the unspecified one."""
    if not isinstance(v, str) or not v.isascii() or not v.isprintable():
        raise Broken(f"{what}: not an address string")
    try:
        ip = ipaddress.ip_address(v)
    except ValueError:
        raise Broken(f"{what}: not an address") from None
    if ip.is_unspecified:
        raise Broken(f"{what}: the unspecified address")
    return ip


def _numeric(v: Any, what: str) -> int:
    if not (isinstance(v, str) and 1 <= len(v) <= NUMERIC_DIGITS and v.isascii() and v.isdigit() and int(v) < 2**32):
        raise Broken(f"{what}: not a numeric string")
    return int(v)


def _instance(node: dict[str, Any], ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> int:
    if _given(node, "id"):
        return int(node["id"])
    return int(ip) if ip.version == 4 else int(ip) & (2**63 - 1)


def _node(v: Any, what: str) -> tuple[Node, int]:
    """A node and its device count."""
    if not isinstance(v, dict):
        raise Broken(f"{what}: not an object")
    if "server_ip" not in v:
        raise Broken(f"{what}: no server_ip")
    ip = _address(v["server_ip"], f"{what}.server_ip")
    if _given(v, "id") != _given(v, "host_ip"):
        raise Broken(f"{what}: id without host_ip or host_ip without id")
    if _given(v, "id") and not (_is_int(v["id"]) and 0 <= v["id"] <= MAX_ID):
        raise Broken(f"{what}.id")
    if _given(v, "host_ip"):
        _address(v["host_ip"], f"{what}.host_ip")
    if _given(v, "super_pod_id"):
        pod = v["super_pod_id"]
        if not ((isinstance(pod, str) and len(pod) <= MAX_SUPER_POD_ID) or (_is_int(pod) and pod >= 0)):
            raise Broken(f"{what}.super_pod_id")
    for key in ("instance_idx_in_pod", "num_instances_per_pod"):
        if _given(v, key) and not (_is_int(v[key]) and 0 <= v[key] <= MAX_POD_INDEX):
            raise Broken(f"{what}.{key}")
    if _given(v, "is_single_container") and not isinstance(v["is_single_container"], bool):
        raise Broken(f"{what}.is_single_container")
    devices = v.get("device")
    if not (isinstance(devices, list) and 1 <= len(devices) <= MAX_DEVICES):
        raise Broken(f"{what}.device: not 1 to {MAX_DEVICES} devices")
    logical: list[int] = []
    physical: list[int] = []
    ports = []
    for i, d in enumerate(devices):
        where = f"{what}.device[{i}]"
        if not isinstance(d, dict) or "device_logical_id" not in d or "device_ip" not in d:
            raise Broken(f"{where}: not a device")
        lid = _numeric(d["device_logical_id"], f"{where}.device_logical_id")
        _address(d["device_ip"], f"{where}.device_ip")
        optional = {k: _numeric(d[k], f"{where}.{k}") for k in ("device_id", "rank_id", "super_device_id")
                    if _given(d, k)}
        if lid in logical or ("device_id" in optional and optional["device_id"] in physical):
            raise Broken(f"{where}: a repeated device")
        logical.append(lid)
        if "device_id" in optional:
            physical.append(optional["device_id"])
        ports.append(optional.get("device_id", lid))
    return Node(ip, _instance(v, ip), tuple(ports)), len(devices)


def read(doc: Any) -> Assignment:
    if not isinstance(doc, dict) or "local" not in doc:
        raise Broken("not an object with a local node")
    local, count = _node(doc["local"], "local")
    if _given(doc["local"], "p_percentage"):
        p = doc["local"]["p_percentage"]
        if not (_is_int(p) and 0 <= p <= 100):
            raise Broken("local.p_percentage")
    peers_doc = doc.get("peers")
    peers: list[Node] = []
    if peers_doc is not None:
        if not (isinstance(peers_doc, list) and len(peers_doc) <= MAX_PEERS):
            raise Broken(f"peers: not an array of at most {MAX_PEERS}")
        for i, p in enumerate(peers_doc):
            peer, n = _node(p, f"peers[{i}]")
            if n != count:
                raise Broken(f"peers[{i}]: another device count than local")
            if peer.instance == local.instance or any(peer.instance == q.instance for q in peers):
                raise Broken(f"peers[{i}]: not a distinct other instance")
            peers.append(peer)
    return Assignment(local, tuple(peers))
