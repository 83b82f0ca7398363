"""``LLMDataDist``: one KV-transfer engine per process (llm_datadist llm_datadist_api.md §6).

CacheManager mode (v2) runs on pdlink's native engine: links are real TCP connections to the
peer's listener (``llm.listenIpInfo``), transfers are served by the peer's C++ threads, and
the role is a label that ``switch_role`` changes together with the listener.

KvCacheManager mode (v1, legacy; selected when ``llm.EnableCacheManager`` is not ``"1"`` and
there is no ``llm.LocalCommRes``) runs on the same engine with the v1 rules: a PROMPT listens
and publishes keys, a DECODER links and pulls (``pdlink.kv_cache_manager``). With several
device ids (single-process multi-device mode) there is one engine per device, all with this
instance's cluster id; every operation fans out to all of them.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ... import constants, environment
from ...environment import LIMIT_VARIABLES
from ...status import LLMException, LLMStatusCode
from ._utils import (
    check_dict,
    check_int32,
    check_isinstance,
    check_list_of,
    check_uint64,
    llm_api,
    llm_words,
    raise_if_false,
    raise_if_true,
    raising_as,
)
from .configs import LLMClusterInfo, LLMRole, role_to_option
from .llm_types import Placement, RegisterMemStatus

if TYPE_CHECKING:
    from ...engine import Engine, LinkResult

__all__ = ["LLMDataDist"]

logger = logging.getLogger("pdlink")

_MAX_CLUSTERS_PER_CALL = 16
# llm.TransferBackend's one value: links are one-way (the native engine's one_way_links).
_HIXL_BACKEND = "hixl"
_DEFAULT_SYNC_TIMEOUT_MS = 1000
_HOST_POOL_LIMIT = 20 * 1024**3  # llm_datadist documents host pools of at most 20 GB
# pdlink option: how links move bytes. "auto": direct memory access between processes of one host
# (cross-memory attach) when permitted, else TCP; "tcp" / "cma" force one.
TRANSPORT_OPTION = "pdlink.Transport"
# pdlink option: a shared secret every linked engine must prove it knows (challenge-response; the
# secret never crosses the wire). The environment variable PDLINK_LINK_SECRET works the same.
SECRET_OPTION = "pdlink.LinkSecret"
# pdlink option, with a link secret: "1" seals the transfers' payloads (tensor bytes) too, not only
# the frames around them; either side asking is enough (docs/security.md: its cost). "0" (default).
# The environment variable PDLINK_PAYLOAD_INTEGRITY works the same.
INTEGRITY_OPTION = "pdlink.PayloadIntegrity"
# pdlink option: where cache memory lives and how DEVICE bytes move. "cpu": host memory, links move
# it; "ascend": NPU memory through ACL, moved over HCCL (the libraries are loaded at run time, see
# docs/ascend.md); "auto": Ascend when its libraries load and report a device, else CPU. The
# environment variable PDLINK_BACKEND works the same.
BACKEND_OPTION = "pdlink.Backend"
# pdlink option, Ascend backend: "1" moves DEVICE bytes over HCCL with one-sided access
# (HcclBatchGet/Put) when both ends enable it and their runtimes have it; "0" (default):
# two-sided HcclBatchSendRecv. The environment variable PDLINK_HCCL_ONE_SIDED works the same.
ONE_SIDED_OPTION = "pdlink.HcclOneSided"
# pdlink option, with pdlink.Transport = "ucx": "1" states that every process that can reach this
# one over the network is trusted, which UCX assumes (docs/ucx.md, "Trust"); the ucx transport is
# refused without it. The environment variable PDLINK_UCX_TRUSTED_NETWORK works the same.
UCX_TRUST_OPTION = "pdlink.UcxTrustedNetwork"
# pdlink option: "[HOST:]PORT" serves every engine of this process on a Prometheus endpoint there
# (pdlink.Metrics, docs/metrics.md; HOST defaults to 127.0.0.1). Unset: none. The environment
# variable PDLINK_METRICS works the same.
METRICS_OPTION = "pdlink.Metrics"
_FLAG_KEYS = ("llm.EnableCacheManager", "llm.EnableRemoteCacheAccessible", "llm.EnableSwitchRole")
# pdlink options bounding what peers may make an engine spend (docs/security.md, "Limits"): option ->
# (environment variable read when it is absent, field of _core.EngineLimits). Unset: the engine's
# defaults, which live in C++ only.
_LIMIT_FIELDS = {
    "pdlink.MaxLinks": "max_links",
    "pdlink.MaxLinksPerSource": "max_links_per_source",
    "pdlink.MaxHandshakes": "max_handshakes",
    "pdlink.MaxHandshakesPerSource": "max_handshakes_per_source",
    "pdlink.HelloTimeoutMs": "hello_timeout_ms",
    "pdlink.PinTimeoutMs": "pin_timeout_ms",
    "pdlink.HandshakeTimeoutMs": "handshake_timeout_ms",
    "pdlink.MaxNotificationsPerLink": "max_notifications_per_link",
    "pdlink.MaxNotificationBytes": "max_notification_bytes",
    "pdlink.MaxNotificationBytesPerLink": "max_notification_bytes_per_link",
    "pdlink.MaxNotificationBytesPerSource": "max_notification_bytes_per_source",
    "pdlink.TcpStreams": "tcp_streams",
    "pdlink.MaxTcpLanes": "max_tcp_lanes",
    "pdlink.TcpChunkBytes": "tcp_chunk_bytes",
    "pdlink.SwitchDrainTimeoutMs": "switch_drain_timeout_ms",
    "pdlink.MaxMetricPeers": "max_metric_peers",
}
LIMIT_OPTIONS = {option: (LIMIT_VARIABLES[f].name, f) for option, f in _LIMIT_FIELDS.items()}
# v1 device pool when neither ge.flowGraphMemMaxSize nor llm.MemPoolConfig sizes it. The CPU
# backend maps pools lazily (anonymous mmap), so untouched pool pages cost no memory.
_V1_DEFAULT_POOL_BYTES = 1 << 30
_V1_DEFAULT_PAGE_SHIFT = 16


def _open_engine(cluster_id: int, role: LLMRole, cfg: dict[str, Any], device_id: int, listen_ip: str,
                 listen_port: int, host_pool: tuple[int, int] | None, one_way_links: bool) -> Engine:
    """The native engine of one device, from parsed options (``parse_engine_options`` or
    ``parse_v1_options``). The engine module loads numpy: imported here, on first init."""
    from ...engine import Engine, EngineOptions, Limits, MemoryPool

    options = EngineOptions(
        cluster_id=cluster_id, role=role, listen=(listen_ip, listen_port) if listen_ip else None,
        transport=cfg["transport"], secret=cfg["link_secret"], payload_integrity=cfg["payload_integrity"],
        backend=cfg["backend"], device_id=device_id, hccl_one_sided=cfg["hccl_one_sided"],
        ucx_trusted_network=cfg["ucx_trusted_network"],
        timeout_ms=cfg["sync_timeout_ms"], limits=Limits(**cfg["limits"]),
        device_pool=MemoryPool(cfg["device_pool_bytes"], cfg["device_page_shift"]),
        host_pool=MemoryPool(*host_pool) if host_pool else None,
        one_way_links=one_way_links)
    with raising_as("init"):
        engine = Engine(options)
    if cfg["metrics"]:
        from ...metrics import Metrics

        Metrics.at(cfg["metrics"])
    return engine


def _link_dicts(engine: Engine) -> list[dict[str, Any]]:
    return [link.as_dict() for link in engine.links()]


def _peers(peers: list[tuple[int | None, str, int]]) -> list[tuple[int | None, tuple[str, int]]]:
    return [(cid, (ip, port)) for cid, ip, port in peers]


def _int_ip_to_str(ip: int) -> str:
    """Inverse of LLMClusterInfo's ``int.from_bytes(inet_aton(ip), "little")``."""
    return socket.inet_ntoa(int(ip).to_bytes(4, "little"))


def _split_listen(value: str) -> tuple[str, int]:
    """``"ip:port"`` -> (ip, port); LLMException(PARAM_INVALID) when malformed."""
    check_isinstance("llm.listenIpInfo", value, str, allow_none=False)
    ip, sep, port = value.rpartition(":")
    raise_if_false(sep == ":" and port.isdigit(), f"llm.listenIpInfo must be 'ip:port', got {value!r}")
    try:
        ipaddress.IPv4Address(ip)
    except ValueError:
        raise LLMException(f"llm.listenIpInfo has an invalid IPv4 address: {value!r}",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
    raise_if_false(0 <= int(port) <= 65535, f"llm.listenIpInfo port out of range: {value!r}")
    return ip, int(port)


def _pool(options: dict[str, str], key: str) -> tuple[int, int]:
    """(bytes, page_shift) from a ``{"memory_size": N, "page_shift": S}`` option; (0, 16) if absent."""
    raw = options.get(key)
    if raw is None or raw == "":
        return 0, 16
    try:
        cfg = json.loads(raw)
    except (TypeError, ValueError):
        raise LLMException(f"{key} is not valid JSON: {raw!r}", status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
    raise_if_false(isinstance(cfg, dict), f"{key} must be a JSON object, got {raw!r}")
    size, shift = cfg.get("memory_size"), cfg.get("page_shift", 16)
    raise_if_false(isinstance(size, int) and not isinstance(size, bool) and size > 0,
                   f"{key}.memory_size must be a positive integer, got {size!r}")
    raise_if_false(isinstance(shift, int) and not isinstance(shift, bool) and 10 <= shift < 31,
                   f"{key}.page_shift must be an integer in [10, 31), got {shift!r}")
    return size, shift


def _parse_limits(options: dict[str, str]) -> dict[str, int]:
    """The limit options that are set, as EngineLimits fields; each a positive integer."""
    out = {}
    for option, (env, field) in LIMIT_OPTIONS.items():
        raw = options.get(option) or environment.limit(field)
        if raw is None or raw == "":
            continue
        raise_if_false(isinstance(raw, str) and raw.isdigit() and 0 < int(raw) <= 2**31 - 1,
                       f"{option} (or {env}) must be a positive integer, got {raw!r}")
        out[field] = int(raw)
    return out


def parse_engine_options(options: dict[str, str]) -> dict[str, Any]:
    """Validate llm_datadist options and derive the native engine's settings (llm_datadist_api.md §4.2).

    Flags must be exactly "0" or "1"; ``llm.SyncKvCacheWaitTime`` a positive integer (ms).
    Returns a dict with the engine's keyword arguments plus ``cache_manager`` and
    ``remote_cache_accessible`` booleans.
    """
    for key in _FLAG_KEYS:
        if key in options:
            raise_if_false(options[key] in ("0", "1"), f"option {key} must be '0' or '1', got {options[key]!r}")
    timeout = options.get("llm.SyncKvCacheWaitTime", str(_DEFAULT_SYNC_TIMEOUT_MS))
    raise_if_false(isinstance(timeout, str) and timeout.isdigit() and 0 < int(timeout) <= 2**31 - 1,
                   f"llm.SyncKvCacheWaitTime must be a positive integer (ms), got {timeout!r}")
    listen_ip, listen_port = "", 0
    if options.get("llm.listenIpInfo"):
        listen_ip, listen_port = _split_listen(options["llm.listenIpInfo"])
    dev_bytes, dev_shift = _pool(options, "llm.MemPoolConfig")
    host_bytes, host_shift = _pool(options, "llm.HostMemPoolConfig")
    secret = options.get(SECRET_OPTION) or environment.link_secret() or ""
    transport = options.get(TRANSPORT_OPTION) or environment.transport()
    transports = constants.TRANSPORTS
    raise_if_false(transport in transports,
                   f"{TRANSPORT_OPTION} (or PDLINK_TRANSPORT) must be one of {sorted(transports)}, got {transport!r}")
    raise_if_false(host_bytes <= _HOST_POOL_LIMIT, f"llm.HostMemPoolConfig.memory_size exceeds 20 GB: {host_bytes}")
    backend = options.get(BACKEND_OPTION) or environment.backend()
    backends = constants.BACKENDS
    raise_if_false(backend in backends,
                   f"{BACKEND_OPTION} (or PDLINK_BACKEND) must be one of {list(backends)}, got {backend!r}")
    # CacheManager mode runs one engine: on the first listed device (KvCacheManager mode checks the
    # whole list itself, parse_v1_options).
    device = options.get("ge.exec.deviceId", "0").split(";")[0]
    raise_if_false(device.isdigit(), f"ge.exec.deviceId must be a device id, got {options.get('ge.exec.deviceId')!r}")
    one_sided = options.get(ONE_SIDED_OPTION) or environment.hccl_one_sided()
    raise_if_false(one_sided in ("0", "1"),
                   f"{ONE_SIDED_OPTION} (or PDLINK_HCCL_ONE_SIDED) must be '0' or '1', got {one_sided!r}")
    trusted = options.get(UCX_TRUST_OPTION) or environment.ucx_trusted_network()
    raise_if_false(trusted in ("0", "1"),
                   f"{UCX_TRUST_OPTION} (or PDLINK_UCX_TRUSTED_NETWORK) must be '0' or '1', got {trusted!r}")
    integrity = options.get(INTEGRITY_OPTION) or environment.payload_integrity()
    raise_if_false(integrity in ("0", "1"),
                   f"{INTEGRITY_OPTION} (or PDLINK_PAYLOAD_INTEGRITY) must be '0' or '1', got {integrity!r}")
    raise_if_false(integrity == "0" or bool(secret),
                   f"{INTEGRITY_OPTION} needs a link secret ({SECRET_OPTION} or PDLINK_LINK_SECRET)")
    metrics = options.get(METRICS_OPTION) or None
    if metrics is not None:
        from ...metrics import parse_address

        try:
            parse_address(metrics)
        except ValueError as e:
            raise LLMException(f"{METRICS_OPTION}: {e}", status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
    return {
        "metrics": metrics,
        "hccl_one_sided": one_sided == "1",
        "ucx_trusted_network": trusted == "1",
        "backend": backend,
        "device_id": int(device),
        "cache_manager": options.get("llm.EnableCacheManager") == "1",
        "remote_cache_accessible": options.get("llm.EnableRemoteCacheAccessible") == "1",
        "listen_ip": listen_ip,
        "listen_port": listen_port,
        "sync_timeout_ms": int(timeout),
        "device_pool_bytes": dev_bytes,
        "device_page_shift": dev_shift,
        "host_pool_bytes": host_bytes,
        "host_page_shift": host_shift,
        "transport": transport,
        "link_secret": secret,
        "payload_integrity": integrity == "1",
        "one_way_links": options.get("llm.TransferBackend") == _HIXL_BACKEND,
        "limits": _parse_limits(options),
    }


def parse_v1_options(options: dict[str, str], role: LLMRole) -> dict[str, Any]:
    """Validate the options of KvCacheManager (v1) mode and derive one engine setting per device.

    * ``ge.exec.deviceId``: required; ``"0"`` or ``";"``-separated ids (multi-device mode);
    * ``llm.listenIpInfo``: PROMPT only and required there, one ``ip:port`` per device
      (``";"``-separated); a DECODER never listens in v1, so it is ignored for one;
    * device pool: ``ge.flowGraphMemMaxSize`` bytes when given, else ``llm.MemPoolConfig``,
      else 1 GiB; there is no host pool in v1.

    Every violation is ``LLMException(LLM_PARAM_INVALID)``. ``llm.ClusterInfo`` and the numa stub
    file that llm_datadist derives here are internal to its engine and are not produced.
    """
    rest = {k: v for k, v in options.items() if k not in ("llm.listenIpInfo", "ge.exec.deviceId")}
    cfg = parse_engine_options(rest)
    raw_devices = options.get("ge.exec.deviceId")
    raise_if_false(bool(raw_devices),
                   "KvCacheManager mode requires ge.exec.deviceId (set LLMConfig.device_id)")
    assert raw_devices is not None  # raise_if_false above
    parts = raw_devices.split(";")
    raise_if_false(all(p.isdigit() for p in parts),
                   f"ge.exec.deviceId must be a device id or ';'-separated ids, got {raw_devices!r}")
    devices = [int(p) for p in parts]
    raise_if_false(len(set(devices)) == len(devices), f"ge.exec.deviceId repeats a device: {raw_devices!r}")
    listens: list[tuple[str, int]] = [("", 0)] * len(devices)
    if role == LLMRole.PROMPT:
        listen = options.get("llm.listenIpInfo", "")
        raise_if_false(bool(listen), "a PROMPT in KvCacheManager mode requires llm.listenIpInfo "
                                     "(LLMConfig.listen_ip_info), one 'ip:port' per device")
        entries = listen.split(";")
        raise_if_false(len(entries) == len(devices),
                       f"llm.listenIpInfo needs one 'ip:port' per device ({len(devices)}), got {listen!r}")
        listens = [_split_listen(e) for e in entries]
    mem = options.get("ge.flowGraphMemMaxSize")
    if mem is not None:
        raise_if_false(mem.isdigit() and int(mem) > 0, f"ge.flowGraphMemMaxSize must be > 0 bytes, got {mem!r}")
        pool, shift = int(mem), _V1_DEFAULT_PAGE_SHIFT
    elif cfg["device_pool_bytes"] > 0:
        pool, shift = cfg["device_pool_bytes"], cfg["device_page_shift"]
    else:
        pool, shift = _V1_DEFAULT_POOL_BYTES, _V1_DEFAULT_PAGE_SHIFT
    return {
        "devices": devices,
        "listens": listens,
        "sync_timeout_ms": cfg["sync_timeout_ms"],
        "device_pool_bytes": pool,
        "device_page_shift": shift,
        "switch_role": options.get("llm.EnableSwitchRole") == "1",
        "transport": cfg["transport"],
        "link_secret": cfg["link_secret"],
        "payload_integrity": cfg["payload_integrity"],
        "backend": cfg["backend"],
        "hccl_one_sided": cfg["hccl_one_sided"],
        "ucx_trusted_network": cfg["ucx_trusted_network"],
        "limits": cfg["limits"],
        "metrics": cfg["metrics"],
    }


def _combine_device_results(count: int, per_device: list[list[LinkResult]]) -> list[LinkResult]:
    """One ``LinkResult`` per cluster from each device's results: the first failure wins (its message
    naming the device when there are several)."""
    from ...engine import LinkResult as make

    out = []
    for j in range(count):
        picked = make(LLMStatusCode.LLM_SUCCESS, "", constants.ANY_CLUSTER)
        for i, results in enumerate(per_device):
            if results:
                res = results[j] if j < len(results) else results[0]
            else:
                res = make(LLMStatusCode.LLM_FAILED, "no result", constants.ANY_CLUSTER)
            if not res.ok:
                picked = res if len(per_device) == 1 else make(res.status, f"device {i}: {res.message}",
                                                               res.peer_cluster_id, res.scope)
                break
        out.append(picked)
    return out


@llm_api
class LLMDataDist:
    """One llm_datadist engine. At most one may be initialised per process (llm_datadist_api.md §6).

    ``role`` is a label in CacheManager mode: any role may listen, link, pull and push.
    Threading: methods are safe to call from several threads, except ``init``/``finalize``,
    which must not run concurrently with anything else (as in llm_datadist).
    """

    llm_engine_instance: LLMDataDist | None = None
    _instance_lock = threading.Lock()

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check_isinstance("role", role, LLMRole, allow_none=False)
        check_uint64("cluster_id", cluster_id)
        self._role = role
        self._cluster_id = cluster_id
        self._engine: Any = None  # the (first) engine
        self._engines: list[Engine] = []  # one per device; several only in v1 multi-device mode
        self._cache_manager: Any = None  # CacheManager mode (v2)
        self._kv_cache_manager: Any = None  # KvCacheManager mode (v1)
        self._v1 = False
        self._switch_role_enabled = False
        self._one_way = False  # llm.TransferBackend = "hixl"
        self._sync_timeout_ms = _DEFAULT_SYNC_TIMEOUT_MS
        self._is_initialized = False
        self._is_call_linked = False
        self._comm_manager: Any = None
        self._options: dict[str, str] = {}

    # ------------------------------------------------------------------ properties

    @property
    def cluster_id(self) -> int:
        """This instance's cluster id."""
        return self._cluster_id

    @property
    def role(self) -> LLMRole:
        """Current role (pdlink extension; llm_datadist keeps it private)."""
        return self._role

    @property
    def listen_port(self) -> int:
        """Port the listener is bound to (0 when not listening). pdlink extension: with
        ``listen_ip_info="127.0.0.1:0"`` the OS picks a free port, which this reports.
        In v1 multi-device mode: the first device's port (see ``listen_ports``)."""
        return self._live_engine().listen_port

    @property
    def listen_ports(self) -> list[int]:
        """pdlink extension: the bound listen port of every device's engine (0: not listening)."""
        self._live_engine()
        return [e.listen_port for e in self._engines]

    def links(self) -> list[dict[str, Any]]:
        """pdlink extension: one dict per link (peer_cluster_id, peer_address, initiator,
        broken, broken_reason, transport: the path of HOST memory, authenticated,
        payload_integrity, device_paths: the paths of DEVICE memory, in the order tried, lanes:
        what the host path moves bytes over, e.g. UCX's ``"tcp/lo"``, confirmed: an accepted link
        whose peer this engine confirmed by dialling it); in v1
        multi-device mode each also has ``device_index``."""
        engine = self._live_engine()
        if len(self._engines) == 1:
            return _link_dicts(engine)
        return [dict(link, device_index=i) for i, e in enumerate(self._engines) for link in _link_dicts(e)]

    @property
    def cache_manager(self):
        """The ``CacheManager`` (CacheManager mode only)."""
        self._live_engine()
        raise_if_true(self._v1, "cache_manager is not available in KvCacheManager mode; use kv_cache_manager "
                                "(or init with LLMConfig.enable_cache_manager = True)")
        return self._cache_manager

    @property
    def kv_cache_manager(self):
        """The v1 ``KvCacheManager``; not available in CacheManager mode."""
        self._live_engine()
        if not self._v1:
            raise LLMException("kv_cache_manager is not available in CacheManager mode; use cache_manager",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        return self._kv_cache_manager

    def _live_engine(self):
        if not self._is_initialized:
            raise RuntimeError("llm datadist is not initialized")
        return self._engine

    # ------------------------------------------------------------------ lifecycle

    def init(self, options: dict[str, str]) -> None:
        """Start the engine with ``LLMConfig.generate_options()`` output (llm_datadist_api.md §6.1)."""
        if self._is_initialized:
            return
        check_dict("options", options, str, str)
        options = dict(options)
        mem = options.get("ge.flowGraphMemMaxSize")
        if mem is not None:
            raise_if_false(mem.isdigit(), f"ge.flowGraphMemMaxSize must be one digit string, got {mem!r}")
        options["llm.Role"] = role_to_option(self._role)
        if "llm.LocalCommRes" in options:
            options.setdefault("llm.EnableCacheManager", "1")
            options.setdefault("llm.EnableRemoteCacheAccessible", "1")
            raise_if_false(options["llm.EnableCacheManager"] == "1", "llm.LocalCommRes requires CacheManager mode")
        if "llm.TransferBackend" in options:  # as upstream, any other value fails init
            raise_if_false(options["llm.TransferBackend"] == _HIXL_BACKEND,
                           f"llm.TransferBackend must be {_HIXL_BACKEND!r} (leave it unset for the default "
                           f"backend), got {options['llm.TransferBackend']!r}")
            options.setdefault("llm.EnableRemoteCacheAccessible", "1")
            raise_if_false(options.get("llm.EnableCacheManager") == "1",
                           "llm.TransferBackend requires CacheManager mode")
            raise_if_false(options["llm.EnableRemoteCacheAccessible"] == "1",
                           "llm.TransferBackend requires llm.EnableRemoteCacheAccessible = 1")
            raise_if_false(bool(options.get("llm.listenIpInfo")), "llm.TransferBackend requires llm.listenIpInfo")
        v1 = options.get("llm.EnableCacheManager") != "1"
        if v1:
            cfg = parse_v1_options(options, self._role)
        else:
            cfg = parse_engine_options(options)
            cfg.pop("cache_manager")
            remote_accessible = cfg.pop("remote_cache_accessible")
        with LLMDataDist._instance_lock:
            live = LLMDataDist.llm_engine_instance
            if live is not None and live is not self:
                raise LLMException("Cannot init multiple LLMDataDists", status_code=LLMStatusCode.LLM_FAILED)
            from .cache_manager import CacheManager

            if v1:
                self._init_v1(cfg)
            else:
                engine = _open_engine(self._cluster_id, self._role, cfg, cfg["device_id"], cfg["listen_ip"],
                                      cfg["listen_port"], (cfg["host_pool_bytes"], cfg["host_page_shift"]),
                                      cfg["one_way_links"])
                self._engine = engine
                self._engines = [engine]
                self._v1 = False
                self._one_way = cfg["one_way_links"]
                self._sync_timeout_ms = cfg["sync_timeout_ms"]
                self._kv_cache_manager = None
                self._cache_manager = CacheManager(
                    self, engine, remote_accessible,
                    {Placement.DEVICE: cfg["device_pool_bytes"] > 0, Placement.HOST: cfg["host_pool_bytes"] > 0},
                )
            self._options = options
            self._is_initialized = True
            LLMDataDist.llm_engine_instance = self
        logger.info("LLMDataDist cluster %d initialised as %s in %s mode (listen ports %s)", self._cluster_id,
                    self._role, "KvCacheManager" if v1 else "CacheManager", [e.listen_port for e in self._engines])

    def _init_v1(self, cfg: dict[str, Any]) -> None:
        """KvCacheManager mode: one engine per device, all with this cluster id; a PROMPT's engine
        ``i`` listens on the ``i``-th ``llm.listenIpInfo`` entry. Called under the instance lock."""
        from .cache_manager import CacheManager
        from .kv_cache_manager import KvCacheManager

        engines: list[Any] = []
        try:
            for device, (ip, port) in zip(cfg["devices"], cfg["listens"]):
                engines.append(_open_engine(self._cluster_id, self._role, cfg, device, ip, port, None, False))
        except BaseException:
            for engine in engines:
                engine.close()
            raise
        # v1 has a device pool only, and pulls address caches by request key or by id.
        managers = [CacheManager(self, e, False, {Placement.DEVICE: True, Placement.HOST: False}) for e in engines]
        self._engine = engines[0]
        self._engines = engines
        self._v1 = True
        self._one_way = False
        self._switch_role_enabled = cfg["switch_role"]
        self._cache_manager = None
        self._sync_timeout_ms = cfg["sync_timeout_ms"]
        self._kv_cache_manager = KvCacheManager(self, managers, self._role)

    def finalize(self) -> None:
        """Unlink every peer, free pools and stop the engine. A no-op when not initialised."""
        if not self._is_initialized:
            return
        # transfer_cache_async tasks still running stop at their next push (the one in flight ends
        # with the links below), reporting what upstream's next layer gets from a finalized wrapper
        for tasks in self._async_tasks():
            tasks.stop(LLMStatusCode.LLM_PARAM_INVALID)
        if self._comm_manager is not None:
            self._comm_manager.close()
            self._comm_manager = None
        for engine in self._engines:
            engine.close()
        if self._cache_manager is not None:
            self._cache_manager._invalidate()
        if self._kv_cache_manager is not None:
            self._kv_cache_manager._invalidate()
        self._is_initialized = False
        self._is_call_linked = False
        with LLMDataDist._instance_lock:
            if LLMDataDist.llm_engine_instance is self:
                LLMDataDist.llm_engine_instance = None

    def _async_tasks(self) -> list[Any]:
        """The ``AsyncTasks`` of every CacheManager (v2's, or v1's one per device)."""
        if self._cache_manager is not None:
            return [self._cache_manager._async_tasks]
        if self._kv_cache_manager is not None:
            return [cm._async_tasks for cm in self._kv_cache_manager._cms]
        return []

    def _unlinking(self, ids: list[int], unlink: Callable[[], list[LinkResult]]) -> list[LinkResult]:
        """Runs ``unlink`` of clusters ``ids``: transfer_cache_async tasks pushing to them stop first
        (``LLM_NOT_YET_LINK``, upstream's code for a push to a cluster not linked), and go on for a
        cluster whose link stayed (its unlink failed)."""
        tasks = self._async_tasks()
        for t in tasks:
            t.stop(LLMStatusCode.LLM_NOT_YET_LINK, ids)
        results = unlink()
        linked = {link.peer_cluster_id for engine in self._engines for link in engine.links()}
        kept = [c for c in ids if c in linked]
        for t in tasks:
            t.resume(kept)
        return results

    # ------------------------------------------------------------------ links

    def _check_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int, linking: bool) -> None:
        """Argument checks that raise: upstream's Python layer. For ``link_clusters``: exactly one
        remote IP, and a local IP unless ``llm.LocalCommRes`` is set; ``unlink_clusters`` checks
        only ids (its IP rule is a per-cluster status, see there)."""
        check_list_of("clusters", clusters, LLMClusterInfo)
        check_int32("timeout", timeout)
        raise_if_false(timeout > 0, f"timeout must be > 0 ms, got {timeout}")
        local_comm_res = self._options.get("llm.LocalCommRes", "")
        for c in clusters:
            # [INF] remote_cluster_id=None is accepted when the remote ip names the peer: the id is
            # then learned in the handshake. Current llm_datadist raises TypeError, but the SGLang
            # fork's connector (llm_datadist_api.md §11.3) was written for a release that accepted it.
            if c.remote_cluster_id is not None or len(c.remote_ip_info_list) != 1:
                check_uint64("remote_cluster_id", c.remote_cluster_id)
            if linking:
                raise_if_false(len(c.remote_ip_info_list) == 1,
                               f"cluster {c.remote_cluster_id} needs exactly one remote_ip_info, "
                               f"got {len(c.remote_ip_info_list)}")
            if linking and not local_comm_res:
                raise_if_false(len(c.local_ip_info_list) >= 1,
                               f"cluster {c.remote_cluster_id} needs a local_ip_info (append_local_ip_info)")

    @staticmethod
    def _results(op: str, clusters: Sequence[LLMClusterInfo], results: list[LinkResult]
                 ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        codes = []
        overall = LLMStatusCode.LLM_SUCCESS
        for cluster, result in zip(clusters, results):
            codes.append(result.status)
            if not result.ok:
                overall = result.status
                logger.warning("%s: cluster %s: %s: %s", op, cluster.remote_cluster_id, result.status,
                               llm_words(result.message))
        if len(results) > len(codes):  # a call-level failure before any per-cluster work
            overall = results[0].status
            logger.warning("%s: %s: %s", op, overall, llm_words(results[0].message))
        return overall, codes

    def link_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000
                      ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Connect to each cluster's listener; returns ``(overall, [per-cluster status])``.

        Links are symmetric once made: either side may then pull or push. Peers are linked in
        parallel and each attempt is bounded by ``timeout`` ms.

        KvCacheManager mode: only a DECODER links (otherwise every slot is ``LLM_PARAM_INVALID``);
        in multi-device mode each cluster carries one ``remote_ip_info`` per device and device
        ``i`` links to the ``i``-th (a cluster is linked on all devices or on none).
        """
        engine = self._live_engine()
        if self._v1:
            return self._link_clusters_v1(clusters, timeout)
        self._check_clusters(clusters, timeout, linking=True)
        if len(clusters) > _MAX_CLUSTERS_PER_CALL:
            return LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, []
        peers = []
        for c in clusters:
            ip, port = c.remote_ip_info_list[0]
            peers.append((c.remote_cluster_id, _int_ip_to_str(ip), port))
        return self._results("link_clusters", clusters, engine.connect_each(_peers(peers), timeout_ms=timeout))

    def unlink_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000, force: bool = False
                        ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Tear links down; each cluster needs its ``remote_cluster_id`` only (no local IP).

        Non-force tells the peer, and (as upstream's engine) wants exactly one ``remote_ip_info``:
        without it that cluster's slot is ``LLM_PARAM_INVALID`` (returned, not raised) and its link
        stays. ``force=True`` drops only the local end (both sides must call it); the id is enough.
        With ``llm.TransferBackend = "hixl"`` ``force`` is ignored: this side's own one-way link
        goes without telling the peer, and a cluster without one is ``LLM_SUCCESS``.

        KvCacheManager mode: either role may call it (a PROMPT cleans up after a dead DECODER);
        only the cluster ids are used, on every device."""
        engine = self._live_engine()
        if self._v1:
            return self._unlink_clusters_v1(clusters, timeout, force)
        check_isinstance("force", force, bool, allow_none=False)
        self._check_clusters(clusters, timeout, linking=False)
        if len(clusters) > _MAX_CLUSTERS_PER_CALL:
            return LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, []
        by_address = {link.peer_address: link.peer_cluster_id for link in engine.links()}
        results: list[LinkResult | None] = []
        ids = []
        for c in clusters:
            if not (force or self._one_way) and len(c.remote_ip_info_list) != 1:
                from ...engine import LinkResult

                results.append(LinkResult(
                    LLMStatusCode.LLM_PARAM_INVALID,
                    f"a non-force unlink needs exactly one remote_ip_info, got {len(c.remote_ip_info_list)}"
                    " (or pass force=True)",
                    constants.ANY_CLUSTER if c.remote_cluster_id is None else c.remote_cluster_id))
                continue
            results.append(None)
            if c.remote_cluster_id is None:  # linked by address (see _check_clusters)
                ip, port = c.remote_ip_info_list[0]
                ids.append(by_address.get(f"{_int_ip_to_str(ip)}:{port}", constants.ANY_CLUSTER))
            else:
                ids.append(c.remote_cluster_id)
        done = iter(self._unlinking(ids, lambda: engine.disconnect_each(ids, timeout_ms=timeout, force=force))
                    if ids else [])
        return self._results("unlink_clusters", clusters, [r if r is not None else next(done) for r in results])

    def _comms(self):
        engine = self._live_engine()
        raise_if_false(self._cache_manager is not None and self._mode_is_cache_manager(),
                       "link/unlink/query_register_mem_status need CacheManager mode")
        raise_if_true(self._one_way, "link/unlink/query_register_mem_status are not available with "
                                     "llm.TransferBackend = 'hixl'; use link_clusters / unlink_clusters",
                      status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        if self._comm_manager is None:
            from .comm import CommManager

            total = int(self._options.get("llm.LinkTotalTime", "0") or 0)
            if total <= 0:
                env = os.environ.get("HCCL_CONNECT_TIMEOUT", "")
                total = int(env) if env.isdigit() and int(env) > 0 else 120
            self._comm_manager = CommManager(engine, self._cluster_id, float(total))
        return self._comm_manager

    def _mode_is_cache_manager(self) -> bool:
        return self._options.get("llm.EnableCacheManager") == "1"

    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        """Two-sided link of every member of ``cluster_rank_info`` (each member calls it with the
        same arguments). Returns a comm id at once; poll ``query_register_mem_status`` until OK.
        See pdlink.comm for how the rank table's addresses are used."""
        comm_id = self._comms().link(comm_name, cluster_rank_info, rank_table)
        self._is_call_linked = True
        return comm_id

    def unlink(self, comm_id: int) -> None:
        """Tear down the links of ``link(...)``'s communicator ``comm_id``."""
        self._comms().unlink(comm_id)

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """PREPARING until every link of the communicator has been up, then OK for good (also
        once the peers unlinked, as upstream); FAILED after the link time (``llm.LinkTotalTime``)
        passes without it. ``LLM_NOT_YET_LINK`` for an unknown or unlinked comm id;
        ``LLM_FEATURE_NOT_ENABLED`` (as ``link``/``unlink``) with ``llm.TransferBackend = "hixl"``."""
        return self._comms().query(comm_id)

    # ------------------------------------------------------------------ links, v1

    def _check_clusters_v1(self, clusters: Sequence[LLMClusterInfo], timeout: int, need_remote_ip: bool) -> None:
        check_list_of("clusters", clusters, LLMClusterInfo)
        check_int32("timeout", timeout)
        raise_if_false(timeout > 0, f"timeout must be > 0 ms, got {timeout}")
        n = len(self._engines)
        for c in clusters:
            check_uint64("remote_cluster_id", c.remote_cluster_id)
            if need_remote_ip:
                raise_if_false(len(c.remote_ip_info_list) == n,
                               f"cluster {c.remote_cluster_id} needs one remote_ip_info per device ({n}), "
                               f"got {len(c.remote_ip_info_list)}")

    def _link_clusters_v1(self, clusters: Sequence[LLMClusterInfo], timeout: int
                          ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        from .kv_cache_manager import fan_out

        self._check_clusters_v1(clusters, timeout, need_remote_ip=True)
        if self._role != LLMRole.DECODER:
            logger.error("link_clusters is not supported by %s in KvCacheManager mode: it requires LLMRole.DECODER",
                         self._role)
            return LLMStatusCode.LLM_PARAM_INVALID, [LLMStatusCode.LLM_PARAM_INVALID] * len(clusters)
        if len(clusters) > _MAX_CLUSTERS_PER_CALL:
            return LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, []

        def link(i: int) -> list[LinkResult]:
            peers = [(c.remote_cluster_id, _int_ip_to_str(c.remote_ip_info_list[i][0]), c.remote_ip_info_list[i][1])
                     for c in clusters]
            return self._engines[i].connect_each(_peers(peers), timeout_ms=timeout)

        per_device = fan_out(len(self._engines), link)
        combined = _combine_device_results(len(clusters), per_device)
        if len(self._engines) > 1:  # a cluster is linked on every device or on none
            for j, c in enumerate(clusters):
                if combined[j].ok:
                    continue
                for i, results in enumerate(per_device):
                    if j < len(results) and results[j].ok:
                        self._engines[i].disconnect_each([check_uint64("remote_cluster_id", c.remote_cluster_id)],
                                                         timeout_ms=timeout)
        return self._results("link_clusters", clusters, combined)

    def _unlink_clusters_v1(self, clusters: Sequence[LLMClusterInfo], timeout: int, force: bool
                            ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        from .kv_cache_manager import fan_out

        check_isinstance("force", force, bool, allow_none=False)
        self._check_clusters_v1(clusters, timeout, need_remote_ip=False)
        if len(clusters) > _MAX_CLUSTERS_PER_CALL:
            return LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, []
        ids = [check_uint64("remote_cluster_id", c.remote_cluster_id) for c in clusters]
        per_device: list[list[LinkResult]] = []

        def unlink() -> list[LinkResult]:
            per_device.extend(fan_out(len(self._engines),
                                      lambda i: self._engines[i].disconnect_each(ids, timeout_ms=timeout, force=force)))
            return []

        self._unlinking(ids, unlink)
        return self._results("unlink_clusters", clusters, _combine_device_results(len(clusters), per_device))

    def check_link_status(self, remote_cluster_id: int) -> None:
        """KvCacheManager mode, DECODER only: one round trip to ``remote_cluster_id`` on every
        device, bounded by ``llm.SyncKvCacheWaitTime``. Raises ``LLMException`` on failure
        (``LLM_NOT_YET_LINK`` when not linked; ``LLM_LINK_FAILED`` / ``LLM_TIMEOUT`` for a dead
        or silent peer)."""
        from .kv_cache_manager import fan_out

        self._live_engine()
        raise_if_false(self._v1, "check_link_status is not supported in CacheManager mode")
        check_uint64("remote_cluster_id", remote_cluster_id)
        raise_if_false(self._role == LLMRole.DECODER,
                       f"check_link_status is not supported by {self._role}: it requires LLMRole.DECODER")
        def ping(i: int) -> None:
            with raising_as("ping"):
                self._engines[i].ping(remote_cluster_id, timeout_ms=self._sync_timeout_ms)

        fan_out(len(self._engines), ping)

    # ------------------------------------------------------------------ roles

    def switch_role(self, role: LLMRole, switch_options: dict[str, str] | None = None) -> None:
        """Change role; ``llm.listenIpInfo`` in ``switch_options`` starts or moves the listener,
        its absence stops it. Raises ``LLMException(LLM_EXIST_LINK)`` while links exist.

        With ``llm.TransferBackend = "hixl"`` (as upstream) only the role label changes: links
        and listener stay; a different ``llm.listenIpInfo`` is ``LLM_FEATURE_NOT_ENABLED``.

        KvCacheManager mode: the new role must differ (``LLM_PARAM_INVALID``); switching to
        PROMPT needs ``llm.listenIpInfo`` (``LLM_PARAM_INVALID``) and starts listening there,
        other roles stop listening; ``LLM_FEATURE_NOT_ENABLED`` unless ``llm.EnableSwitchRole``
        was ``"1"`` at init, and in multi-device mode. Caches stay valid."""
        engine = self._live_engine()
        if self._v1:
            self._switch_role_v1(role, switch_options)
            return
        check_isinstance("role", role, LLMRole, allow_none=False)
        check_dict("switch_options", switch_options, str, str, allow_none=True)
        ip, port = "", 0
        if switch_options and switch_options.get("llm.listenIpInfo"):
            ip, port = _split_listen(switch_options["llm.listenIpInfo"])
        with raising_as("switch_role"):  # LLM_EXIST_LINK while any link remains, as upstream
            engine.switch_role(role, (ip, port) if ip else None, require_no_links=True)
        logger.info("cluster %d switched role %s -> %s", self._cluster_id, self._role, role)
        self._role = role


    def _switch_role_v1(self, role: LLMRole, switch_options: dict[str, str] | None) -> None:
        check_isinstance("role", role, LLMRole, allow_none=False)
        check_dict("switch_options", switch_options, str, str, allow_none=True)
        raise_if_true(role == self._role, f"switch_role: the role is already {role}")
        ip, port = "", 0
        if role == LLMRole.PROMPT:
            raise_if_false(switch_options is not None and "llm.listenIpInfo" in switch_options,
                           "switch_role to LLMRole.PROMPT requires llm.listenIpInfo in switch_options")
            assert switch_options is not None  # raise_if_false above
            ip, port = _split_listen(switch_options["llm.listenIpInfo"])
        raise_if_false(self._switch_role_enabled,
                       "switch_role needs LLMConfig.enable_switch_role = True at init (KvCacheManager mode)",
                       status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        raise_if_true(len(self._engines) > 1, "switch_role is not supported in single-process multi-device mode",
                      status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        with raising_as("switch_role"):  # LLM_EXIST_LINK while any link remains
            self._engine.switch_role(role, (ip, port) if ip else None, require_no_links=True)
        self._kv_cache_manager._switch_role(role)
        logger.info("cluster %d switched role %s -> %s", self._cluster_id, self._role, role)
        self._role = role


def _finalize_at_exit() -> None:
    inst = LLMDataDist.llm_engine_instance
    if inst is None:
        return
    try:
        inst.finalize()
    except LLMException as e:  # logged and swallowed, as llm_datadist does
        logger.error("finalize at exit failed: %s", e)


atexit.register(_finalize_at_exit)
