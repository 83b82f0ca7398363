"""Rules for the body of ``POST /v1/role/{prefill|decode|flex}`` (MindIE's V1 role request).

Accepted: the seed's minimal body (``local.server_ip``, ``local.device[].device_ip`` and
``device_logical_id``; optional ``peers`` of the same shape) and the full body MindIE's controller
sends (``id``, ``host_ip``, ``p_percentage``, ``super_pod_id``, ``instance_idx_in_pod``,
``num_instances_per_pod``, ``is_single_container`` and per device ``device_id``, ``rank_id``,
``super_device_id``). Unknown fields are ignored, as MindIE does.

Rules (each violation is a ``BodyError``, answered 422):

* the body is a JSON object; ``local`` is an object; ``peers``, when present and not null, is an
  array of at most ``MAX_PEERS`` objects;
* every node (``local`` and each peer) has ``server_ip``, a valid IP other than ``0.0.0.0`` / ``::``,
  and a non-empty ``device`` array of at most ``MAX_DEVICES`` objects; an IP is printable ASCII
  (an IPv6 zone id included);
* every device has ``device_logical_id`` (a numeric string) and ``device_ip`` (an IP); ``device_id``,
  ``rank_id`` and ``super_device_id``, when present, are numeric strings; within one node neither
  ``device_logical_id`` nor ``device_id`` repeats;
* ``id`` (an unsigned integer) and ``host_ip`` (an IP) appear together or not at all;
* ``p_percentage`` is an integer in [0, 100]; ``instance_idx_in_pod`` and ``num_instances_per_pod``
  non-negative integers; ``is_single_container`` a boolean; ``super_pod_id`` a string or a
  non-negative integer;
* each peer has as many devices as ``local``;
* peers have distinct instance ids, none equal to the local one (see ``cluster_id``);
* ``expected_epoch`` (pdlink's addition, top level), when present and not null, is an unsigned
  integer below 2**63: the post is then fenced by the instance's role epoch (``node.py``).

A numeric string is 1 to 10 ASCII digits with a value below 2**32.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from .roles import ROLES

__all__ = ["ROLES", "BodyError", "Device", "NodeInfo", "RoleRequest", "parse_role_request", "cluster_id",
           "MAX_PEERS", "MAX_DEVICES", "MAX_EPOCH"]

MAX_PEERS = 256
MAX_DEVICES = 64


class BodyError(ValueError):
    """The body breaks the request rules (HTTP 422)."""


@dataclass(frozen=True)
class Device:
    device_logical_id: str
    device_ip: str
    device_id: str | None = None
    rank_id: str | None = None
    super_device_id: str | None = None

    @property
    def port_id(self) -> int:
        """The id that selects this device's KV listen port: ``device_id`` (unique per host) when
        given, else ``device_logical_id``."""
        return int(self.device_id if self.device_id is not None else self.device_logical_id)


@dataclass(frozen=True)
class NodeInfo:
    server_ip: str
    devices: tuple[Device, ...]
    id: int | None = None
    host_ip: str | None = None
    super_pod_id: str | None = None

    @property
    def cluster_id(self) -> int:
        return cluster_id(self)


@dataclass(frozen=True)
class RoleRequest:
    role: str
    local: NodeInfo
    peers: tuple[NodeInfo, ...]
    p_percentage: int | None = None
    instance_idx_in_pod: int | None = None
    num_instances_per_pod: int | None = None
    is_single_container: bool | None = None
    expected_epoch: int | None = None  # None: MindIE's unfenced post (coalesces as before)


MAX_EPOCH = 2**63 - 1


def cluster_id(node: NodeInfo) -> int:
    """The pdlink cluster id of an instance: its ``id`` when given; else derived from
    ``server_ip`` (an IPv4 address as its 32-bit value, an IPv6 address as its low 63 bits).
    Every device engine of an instance uses this id."""
    if node.id is not None:
        return node.id
    value = int(ipaddress.ip_address(node.server_ip))
    return value if value < 2**32 else value & (2**63 - 1)


def _any_cluster() -> int:
    """The native ``ANY_CLUSTER``, never a real instance id (loads the native module on first use)."""
    from .. import constants

    return constants.ANY_CLUSTER


def _ip(value: Any, where: str, allow_unspecified: bool = False) -> str:
    if not isinstance(value, str):
        raise BodyError(f"{where} must be an IP address string, got {value!r}")
    if not (value.isascii() and value.isprintable()):
        # ipaddress takes any text as an IPv6 zone id ("fe80::1%<anything>"), a lone surrogate too,
        # which no answer could carry back (UTF-8 cannot encode it)
        raise BodyError(f"{where} is not a valid IP address: {value!r}")
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        raise BodyError(f"{where} is not a valid IP address: {value!r}") from None
    if ip.is_unspecified and not allow_unspecified:
        raise BodyError(f"{where} must not be the unspecified address {value!r}")
    return str(ip)


def _numeric(value: Any, where: str) -> str:
    if not isinstance(value, str) or not (1 <= len(value) <= 10) or not value.isascii() or not value.isdigit() \
            or int(value) >= 2**32:
        raise BodyError(f"{where} must be a numeric string (digits, value < 2^32), got {value!r}")
    return value


def _uint(value: Any, where: str, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= hi:
        raise BodyError(f"{where} must be an unsigned integer <= {hi}, got {value!r}")
    return value


def _device(raw: Any, where: str) -> Device:
    if not isinstance(raw, dict):
        raise BodyError(f"{where} must be an object")
    if "device_logical_id" not in raw:
        raise BodyError(f"{where}.device_logical_id is required")
    if "device_ip" not in raw:
        raise BodyError(f"{where}.device_ip is required")
    opt = {}
    for key in ("device_id", "rank_id", "super_device_id"):
        if raw.get(key) is not None:
            opt[key] = _numeric(raw[key], f"{where}.{key}")
    return Device(_numeric(raw["device_logical_id"], f"{where}.device_logical_id"),
                  _ip(raw["device_ip"], f"{where}.device_ip"), **opt)


def _node(raw: Any, where: str) -> NodeInfo:
    if not isinstance(raw, dict):
        raise BodyError(f"{where} must be an object")
    if "server_ip" not in raw:
        raise BodyError(f"{where}.server_ip is required")
    server_ip = _ip(raw["server_ip"], f"{where}.server_ip")
    has_id, has_host = raw.get("id") is not None, raw.get("host_ip") is not None
    if has_id != has_host:
        raise BodyError(f"{where}.id and {where}.host_ip must be given together or not at all")
    node_id = _uint(raw["id"], f"{where}.id", _any_cluster() - 1) if has_id else None
    host_ip = _ip(raw["host_ip"], f"{where}.host_ip") if has_host else None
    super_pod = raw.get("super_pod_id")
    if super_pod is not None:
        if isinstance(super_pod, int) and not isinstance(super_pod, bool) and super_pod >= 0:
            super_pod = str(super_pod)
        elif not isinstance(super_pod, str) or len(super_pod) > 128:
            raise BodyError(f"{where}.super_pod_id must be a string or a non-negative integer, got {super_pod!r}")
    for key in ("instance_idx_in_pod", "num_instances_per_pod"):
        if raw.get(key) is not None:
            _uint(raw[key], f"{where}.{key}", 2**31 - 1)
    if raw.get("is_single_container") is not None and not isinstance(raw["is_single_container"], bool):
        raise BodyError(f"{where}.is_single_container must be true or false, got {raw['is_single_container']!r}")
    devices_raw = raw.get("device")
    if not isinstance(devices_raw, list) or not devices_raw:
        raise BodyError(f"{where}.device must be a non-empty array of devices")
    if len(devices_raw) > MAX_DEVICES:
        raise BodyError(f"{where}.device has {len(devices_raw)} entries, more than {MAX_DEVICES}")
    devices = tuple(_device(d, f"{where}.device[{i}]") for i, d in enumerate(devices_raw))
    for attr in ("device_logical_id", "device_id"):
        values = [getattr(d, attr) for d in devices if getattr(d, attr) is not None]
        if len(set(values)) != len(values):
            raise BodyError(f"{where}.device repeats a {attr}: {values}")
    return NodeInfo(server_ip, devices, node_id, host_ip, super_pod)


def parse_role_request(role: str, body: Any) -> RoleRequest:
    """Validate a decoded JSON body for ``role`` (one of ``ROLES``); ``BodyError`` when it breaks a rule."""
    if not isinstance(body, dict):
        raise BodyError("the request body must be a JSON object")
    if "local" not in body:
        raise BodyError("local is required")
    local = _node(body["local"], "local")
    raw_local = body["local"]
    p_percentage = None
    if raw_local.get("p_percentage") is not None:
        p_percentage = _uint(raw_local["p_percentage"], "local.p_percentage", 100)
    peers_raw = body.get("peers")
    peers: list[NodeInfo] = []
    if peers_raw is not None:
        if not isinstance(peers_raw, list):
            raise BodyError("peers must be an array")
        if len(peers_raw) > MAX_PEERS:
            raise BodyError(f"peers has {len(peers_raw)} entries, more than {MAX_PEERS}")
        for i, p in enumerate(peers_raw):
            peer = _node(p, f"peers[{i}]")
            if len(peer.devices) != len(local.devices):
                raise BodyError(f"peers[{i}] has {len(peer.devices)} device(s); it must have as many as the local "
                                f"node ({len(local.devices)})")
            peers.append(peer)
    expected_epoch = None
    if body.get("expected_epoch") is not None:
        expected_epoch = _uint(body["expected_epoch"], "expected_epoch", MAX_EPOCH)
    me = cluster_id(local)
    seen: dict[int, int] = {}
    for i, peer in enumerate(peers):
        cid = cluster_id(peer)
        if cid == me:
            raise BodyError(f"peers[{i}] has the local instance's id {cid}")
        if cid in seen:
            raise BodyError(f"peers[{i}] and peers[{seen[cid]}] name the same instance (id {cid})")
        seen[cid] = i
    return RoleRequest(
        role=role, local=local, peers=tuple(peers), p_percentage=p_percentage,
        instance_idx_in_pod=raw_local.get("instance_idx_in_pod"),
        num_instances_per_pod=raw_local.get("num_instances_per_pod"),
        is_single_container=raw_local.get("is_single_container"), expected_epoch=expected_epoch,
    )
