"""``LLMRole``, ``LLMClusterInfo`` and ``LlmConfig`` / ``LLMConfig`` (llm_datadist_api.md §2.1, §4, §5).

Public names:
    LLMRole, LLMClusterInfo, LlmConfig, LLMConfig (alias of LlmConfig),
    role_to_option, ip_to_int
"""

from __future__ import annotations

import json
import logging
import socket

from ..._enum import NamedIntEnum
from ...status import raise_if_false
from ._utils import (
    UINT32_MAX,
    check_dict,
    check_int32,
    check_isinstance,
    check_list_of,
    check_uint16,
    check_uint32,
    check_uint64,
)

__all__ = [
    "LLMRole",
    "LLMClusterInfo",
    "LlmConfig",
    "LLMConfig",
    "role_to_option",
    "ip_to_int",
]

logger = logging.getLogger("pdlink")


class LLMRole(NamedIntEnum):
    """Role of an LLMDataDist instance. ``str(LLMRole.PROMPT) == "LLMRole.PROMPT"``."""

    PROMPT = 1
    DECODER = 2
    MIX = 3


_ROLE_OPTION_VALUES = {
    LLMRole.PROMPT: "Prompt",
    LLMRole.DECODER: "Decoder",
    LLMRole.MIX: "Mix",
}


def role_to_option(role: LLMRole | int) -> str:
    """Value of option ``llm.Role`` for ``role``: ``"Prompt"``, ``"Decoder"`` or ``"Mix"``.

    Accepts an ``LLMRole`` or its int value. ``TypeError`` for other types,
    ``LLMException(LLM_PARAM_INVALID)`` for an int that is not a role.
    """
    check_isinstance("role", role, [LLMRole, int], allow_none=False)
    raise_if_false(role in _ROLE_OPTION_VALUES, f"role {role!r} is not a valid LLMRole.")
    return _ROLE_OPTION_VALUES[LLMRole(role)]


def ip_to_int(ip: str | int) -> int:
    """Convert a dotted IPv4 string to the int the engine expects; ints pass through.

    The conversion is ``int.from_bytes(socket.inet_aton(ip), "little")``, so
    ``"1.2.3.4"`` gives ``67305985``. An unparsable string raises
    ``RuntimeError("Can not parse ip str:<ip>")``.
    """
    if isinstance(ip, str):
        try:
            packed = socket.inet_aton(ip)
        except (OSError, ValueError):
            # OSError: malformed address; ValueError: embedded NUL / non-ASCII text.
            raise RuntimeError(f"Can not parse ip str:{ip}") from None
        return int.from_bytes(packed, "little")
    return ip


class LLMClusterInfo:
    """Description of one remote cluster for ``link_clusters`` / ``unlink_clusters`` (llm_datadist_api.md §5).

    Takes no constructor arguments. ``remote_role_type`` is informational only.
    """

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | int | None = None
        self._local_ip_info_list: list[tuple[int, int]] = []
        self._remote_ip_info_list: list[tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        """Remote cluster id (uint64); ``None`` until set."""
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, remote_cluster_id: int) -> None:
        check_uint64("remote_cluster_id", remote_cluster_id)
        self._remote_cluster_id = remote_cluster_id

    @property
    def remote_role_type(self) -> LLMRole | int | None:
        """Remote role (``LLMRole`` or int); ``None`` until set. Not sent to the engine."""
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, remote_role_type: LLMRole | int) -> None:
        check_isinstance("remote_role_type", remote_role_type, [LLMRole, int])
        self._remote_role_type = remote_role_type

    @property
    def local_ip_info_list(self) -> list[tuple[int, int]]:
        """List of ``(ip_int, port)`` tuples added by ``append_local_ip_info``."""
        return self._local_ip_info_list

    @property
    def remote_ip_info_list(self) -> list[tuple[int, int]]:
        """List of ``(ip_int, port)`` tuples added by ``append_remote_ip_info``."""
        return self._remote_ip_info_list

    @staticmethod
    def _checked_ip_port(ip: str | int, port: int) -> tuple[int, int]:
        check_isinstance("ip", ip, [str, int], allow_none=False)
        check_uint16("port", port)
        ip_int = ip_to_int(ip)
        # [INF] an int ip must fit an IPv4 address (uint32); the reference does not check.
        check_uint32("ip", ip_int)
        return ip_int, port

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        """Append a local ``(ip, port)``; ``ip`` is a dotted IPv4 str or an int, ``port`` a uint16."""
        self._local_ip_info_list.append(self._checked_ip_port(ip, port))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """Append a remote ``(ip, port)``; ``ip`` is a dotted IPv4 str or an int, ``port`` a uint16."""
        self._remote_ip_info_list.append(self._checked_ip_port(ip, port))

    def __repr__(self) -> str:
        return (
            f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, "
            f"remote_role_type={self._remote_role_type}, "
            f"local_ip_info_list={self._local_ip_info_list}, "
            f"remote_ip_info_list={self._remote_ip_info_list})"
        )


class LlmConfig:
    """Engine configuration builder (llm_datadist_api.md §4.1). ``LLMConfig`` is the same class.

    Set properties, then call ``generate_options()`` (same as ``gen_options()``) to get the
    option dict. The dict is the same object on every call (``options``); each call adds or
    overwrites keys in it, it never removes keys.

    [INF] Assigning ``None`` to a property (other than ``mem_utilization``) resets it to its
    unset state; the reference mostly fails on ``None`` with an unrelated error.
    """

    def __init__(self) -> None:
        self._options: dict[str, str] = {}
        self._device_id: int | list[int] | tuple[int, ...] | None = None
        self._sync_kv_timeout: int | str | None = None
        self._listen_ip_info: str = ""
        self._deploy_res_path: str = ""
        self._ge_options: dict[str, str] = {}
        self._enable_switch_role: bool = False
        self._link_total_time: int | None = None
        self._link_retry_count: int | None = None
        self._cluster_info: str = ""
        self._output_max_size: int | None = None
        self._mem_utilization: float = 0.95
        self._buf_pool_cfg: str = ""
        self._mem_pool_cfg: str = ""
        self._host_mem_pool_cfg: str = ""
        self._enable_cache_manager: bool | None = None
        self._enable_remote_cache_accessible: bool | None = None
        self._rdma_traffic_class: int | None = None
        self._rdma_service_level: int | None = None
        self._local_comm_res: str | None = None
        self._transfer_backend: str | None = None
        self._global_resource_config: str | None = None

    # ------------------------------------------------------------------ options

    def generate_options(self) -> dict[str, str]:
        """Build and return the option dict (the same object as ``options``).

        Emission order: ge_options; device ids; SyncKvCacheWaitTime; deployResPath;
        BufPoolCfg, MemPoolConfig, HostMemPoolConfig, EnableCacheManager,
        EnableRemoteCacheAccessible; listenIpInfo, LinkTotalTime, LinkRetryCount,
        RdmaTrafficClass, RdmaServiceLevel, LocalCommRes, TransferBackend,
        GlobalResourceConfig; ClusterInfo, OutputMaxSize, EnableSwitchRole, MemoryUtilization.
        """
        return self.gen_options()

    def gen_options(self) -> dict[str, str]:
        """Same as ``generate_options()``."""
        opts = self._options
        if self._ge_options:
            opts.update(self._ge_options)
        self._add_device_options(opts)
        if self._sync_kv_timeout is not None:
            opts["llm.SyncKvCacheWaitTime"] = str(self._sync_kv_timeout)
        if self._deploy_res_path:
            opts["llm.deployResPath"] = str(self._deploy_res_path)
        self._add_memory_options(opts)
        self._add_connect_options(opts)
        if self._cluster_info:
            opts["llm.ClusterInfo"] = str(self._cluster_info)
        if self._output_max_size is not None:
            opts["llm.OutputMaxSize"] = str(self._output_max_size)
        if self._enable_switch_role:
            opts["llm.EnableSwitchRole"] = "1"
        if self._mem_utilization is not None:
            opts["llm.MemoryUtilization"] = str(self._mem_utilization)
        return opts

    def _add_device_options(self, opts: dict[str, str]) -> None:
        dev = self._device_id
        if dev is None:
            return
        if isinstance(dev, int):
            opts["ge.exec.deviceId"] = str(dev)
            opts["ge.session_device_id"] = str(dev)
        else:
            # For a list the reference inserts session_device_id before exec.deviceId;
            # that insertion order is kept.
            opts["ge.session_device_id"] = str(dev[0])
            opts["ge.exec.deviceId"] = ";".join(str(d) for d in dev)

    def _add_memory_options(self, opts: dict[str, str]) -> None:
        if self._buf_pool_cfg:
            opts["llm.BufPoolCfg"] = str(self._buf_pool_cfg)
        if self._mem_pool_cfg:
            opts["llm.MemPoolConfig"] = str(self._mem_pool_cfg)
        if self._host_mem_pool_cfg:
            opts["llm.HostMemPoolConfig"] = str(self._host_mem_pool_cfg)
        if self._enable_cache_manager is not None:
            opts["llm.EnableCacheManager"] = "1" if self._enable_cache_manager else "0"
        if self._enable_remote_cache_accessible is not None:
            opts["llm.EnableRemoteCacheAccessible"] = "1" if self._enable_remote_cache_accessible else "0"

    def _add_connect_options(self, opts: dict[str, str]) -> None:
        if self._listen_ip_info:
            opts["llm.listenIpInfo"] = str(self._listen_ip_info)
        if self._link_total_time is not None:
            opts["llm.LinkTotalTime"] = str(self._link_total_time)
        if self._link_retry_count is not None:
            opts["llm.LinkRetryCount"] = str(self._link_retry_count)
        if self._rdma_traffic_class is not None:
            opts["llm.RdmaTrafficClass"] = str(self._rdma_traffic_class)
        if self._rdma_service_level is not None:
            opts["llm.RdmaServiceLevel"] = str(self._rdma_service_level)
        # These three are emitted once set, even when set to "".
        if self._local_comm_res is not None:
            opts["llm.LocalCommRes"] = str(self._local_comm_res)
        if self._transfer_backend is not None:
            opts["llm.TransferBackend"] = str(self._transfer_backend)
        if self._global_resource_config is not None:
            opts["llm.GlobalResourceConfig"] = str(self._global_resource_config)

    @property
    def options(self) -> dict[str, str]:
        """The option dict filled by ``generate_options()`` (read-only property)."""
        return self._options

    # ------------------------------------------------------------------ device / timeouts

    @property
    def device_id(self) -> int | list[int] | tuple[int, ...] | None:
        """Device id: an int >= 0 (int32) or a list/tuple of such ints; ``None`` if unset."""
        return self._device_id

    @device_id.setter
    def device_id(self, device_id: int | list[int] | tuple[int, ...] | None) -> None:
        check_isinstance("device_id", device_id, [list, tuple, int])
        if isinstance(device_id, (list, tuple)):
            check_list_of("device_id", device_id, int)
            # [INF] an empty list has no first id for ge.session_device_id; reject it here.
            raise_if_false(len(device_id) > 0, "device_id list should not be empty.")
            for dev in device_id:
                raise_if_false(dev >= 0, "device_id should be greater than or equal to zero.")
                check_int32("device_id", dev)
        elif device_id is not None:
            raise_if_false(device_id >= 0, "device_id should be greater than or equal to zero.")
            check_int32("device_id", device_id)
        self._device_id = device_id

    @property
    def sync_kv_timeout(self) -> int | str | None:
        """Pull/push timeout in ms: an int or digit str, > 0 and int32; ``None`` if unset."""
        return self._sync_kv_timeout

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, sync_kv_timeout: int | str | None) -> None:
        check_isinstance("sync_kv_timeout", sync_kv_timeout, [int, str])
        if sync_kv_timeout is not None:
            if isinstance(sync_kv_timeout, str):
                raise_if_false(
                    sync_kv_timeout.isascii() and sync_kv_timeout.isdigit(),
                    "sync_kv_timeout must be digit.",
                )
            value = int(sync_kv_timeout)
            raise_if_false(value > 0, "sync_kv_timeout should be greater than zero.")
            check_int32("sync_kv_timeout", value)
        self._sync_kv_timeout = sync_kv_timeout

    @property
    def link_total_time(self) -> int:
        """Link timeout in seconds, int in [0, 2**32-1]; getter returns 0 when unset."""
        return 0 if self._link_total_time is None else self._link_total_time

    @link_total_time.setter
    def link_total_time(self, link_total_time: int | None) -> None:
        check_isinstance("link_total_time", link_total_time, int)
        if link_total_time is not None:
            raise_if_false(
                0 <= link_total_time <= UINT32_MAX,
                f"link_total_time should be an integer between [0, 2^32-1], given value is {link_total_time}",
            )
        self._link_total_time = link_total_time

    @property
    def link_retry_count(self) -> int:
        """Link retry count, int in [1, 100]; getter returns 1 when unset."""
        return 1 if self._link_retry_count is None else self._link_retry_count

    @link_retry_count.setter
    def link_retry_count(self, link_retry_count: int | None) -> None:
        check_isinstance("link_retry_count", link_retry_count, int)
        if link_retry_count is not None:
            raise_if_false(
                1 <= link_retry_count <= 100,
                f"link_retry_count should be an integer between [1, 100], given value is {link_retry_count}",
            )
        self._link_retry_count = link_retry_count

    # ------------------------------------------------------------------ plain strings

    @property
    def listen_ip_info(self) -> str:
        """``"ip:port"`` to listen on (v1: ``;``-separated per device); ``""`` if unset."""
        return self._listen_ip_info

    @listen_ip_info.setter
    def listen_ip_info(self, listen_ip_info: str | None) -> None:
        check_isinstance("listen_ip_info", listen_ip_info, str)
        self._listen_ip_info = "" if listen_ip_info is None else listen_ip_info

    @property
    def deploy_res_path(self) -> str:
        """Deploy resource path (v1 only); ``""`` if unset."""
        return self._deploy_res_path

    @deploy_res_path.setter
    def deploy_res_path(self, deploy_res_path: str | None) -> None:
        check_isinstance("deploy_res_path", deploy_res_path, str)
        self._deploy_res_path = "" if deploy_res_path is None else deploy_res_path

    @property
    def buf_pool_cfg(self) -> str:
        """Buffer pool JSON config (v1); ``""`` if unset."""
        return self._buf_pool_cfg

    @buf_pool_cfg.setter
    def buf_pool_cfg(self, buf_pool_cfg: str | None) -> None:
        check_isinstance("buf_pool_cfg", buf_pool_cfg, str)
        self._buf_pool_cfg = "" if buf_pool_cfg is None else buf_pool_cfg

    @property
    def mem_pool_cfg(self) -> str:
        """Device memory pool JSON config (``{"memory_size": ..., "page_shift": ...}``); ``""`` if unset."""
        return self._mem_pool_cfg

    @mem_pool_cfg.setter
    def mem_pool_cfg(self, mem_pool_cfg: str | None) -> None:
        check_isinstance("mem_pool_cfg", mem_pool_cfg, str)
        self._mem_pool_cfg = "" if mem_pool_cfg is None else mem_pool_cfg

    @property
    def host_mem_pool_cfg(self) -> str:
        """Host memory pool JSON config; ``""`` if unset."""
        return self._host_mem_pool_cfg

    @host_mem_pool_cfg.setter
    def host_mem_pool_cfg(self, host_mem_pool_cfg: str | None) -> None:
        check_isinstance("host_mem_pool_cfg", host_mem_pool_cfg, str)
        self._host_mem_pool_cfg = "" if host_mem_pool_cfg is None else host_mem_pool_cfg

    @property
    def cluster_info(self) -> str:
        """Cluster info JSON str (v1 internal); ``listen_ip_info[].ip`` strings become ints."""
        return self._cluster_info

    @cluster_info.setter
    def cluster_info(self, cluster_info: str | None) -> None:
        check_isinstance("cluster_info", cluster_info, str)
        if cluster_info is None:
            self._cluster_info = ""
            return
        # Invalid JSON propagates json.JSONDecodeError (a ValueError), as in the reference.
        parsed = json.loads(cluster_info)
        # [INF] the top level must be a JSON object.
        raise_if_false(isinstance(parsed, dict), "cluster_info should be a JSON object.")
        ip_infos = parsed.get("listen_ip_info")
        if isinstance(ip_infos, list):
            for ip_info in ip_infos:
                if isinstance(ip_info, dict) and "ip" in ip_info:
                    ip_info["ip"] = ip_to_int(ip_info["ip"])
        self._cluster_info = json.dumps(parsed)

    @property
    def local_comm_res(self) -> str:
        """Local communication resource (rank-table-like JSON or ``""``); getter gives ``""`` if unset.

        Once set (even to ``""``) it is emitted as ``llm.LocalCommRes``.
        """
        return "" if self._local_comm_res is None else self._local_comm_res

    @local_comm_res.setter
    def local_comm_res(self, local_comm_res: str | None) -> None:
        check_isinstance("local_comm_res", local_comm_res, str)
        self._local_comm_res = local_comm_res

    @property
    def transfer_backend(self) -> str:
        """Transfer backend name (e.g. ``"hixl"``); getter gives ``""`` if unset."""
        return "" if self._transfer_backend is None else self._transfer_backend

    @transfer_backend.setter
    def transfer_backend(self, transfer_backend: str | None) -> None:
        check_isinstance("transfer_backend", transfer_backend, str)
        self._transfer_backend = transfer_backend

    @property
    def global_resource_config(self) -> str:
        """Global resource JSON config; getter gives ``""`` if unset."""
        return "" if self._global_resource_config is None else self._global_resource_config

    @global_resource_config.setter
    def global_resource_config(self, global_resource_config: str | None) -> None:
        check_isinstance("global_resource_config", global_resource_config, str)
        self._global_resource_config = global_resource_config

    # ------------------------------------------------------------------ other

    @property
    def ge_options(self) -> dict[str, str]:
        """Extra options copied verbatim first into the option dict; ``{}`` if unset."""
        return self._ge_options

    @ge_options.setter
    def ge_options(self, ge_options: dict[str, str] | None) -> None:
        check_dict("ge_options", ge_options, str, str, allow_none=True)
        self._ge_options = {} if ge_options is None else ge_options

    @property
    def enable_switch_role(self) -> bool:
        """Emit ``llm.EnableSwitchRole = "1"`` when True (v1 switch_role); default False."""
        return self._enable_switch_role

    @enable_switch_role.setter
    def enable_switch_role(self, enable_switch_role: bool | None) -> None:
        check_isinstance("enable_switch_role", enable_switch_role, bool)
        self._enable_switch_role = bool(enable_switch_role)

    @property
    def enable_cache_manager(self) -> bool:
        """Select CacheManager (v2) mode; getter gives False if unset."""
        return False if self._enable_cache_manager is None else self._enable_cache_manager

    @enable_cache_manager.setter
    def enable_cache_manager(self, enable_cache_manager: bool | None) -> None:
        check_isinstance("enable_cache_manager", enable_cache_manager, bool)
        self._enable_cache_manager = enable_cache_manager

    @property
    def enable_remote_cache_accessible(self) -> bool:
        """Enable remote-accessible caches (push); getter gives False if unset."""
        return False if self._enable_remote_cache_accessible is None else self._enable_remote_cache_accessible

    @enable_remote_cache_accessible.setter
    def enable_remote_cache_accessible(self, enable_remote_cache_accessible: bool | None) -> None:
        check_isinstance("enable_remote_cache_accessible", enable_remote_cache_accessible, bool)
        self._enable_remote_cache_accessible = enable_remote_cache_accessible

    @property
    def output_max_size(self) -> int | None:
        """Legacy output max size (int); ``None`` if unset."""
        return self._output_max_size

    @output_max_size.setter
    def output_max_size(self, output_max_size: int | None) -> None:
        check_isinstance("output_max_size", output_max_size, int)
        self._output_max_size = output_max_size

    @property
    def mem_utilization(self) -> float:
        """Memory utilization (v1), float in [0, 1], default 0.95; always emitted."""
        return self._mem_utilization

    @mem_utilization.setter
    def mem_utilization(self, mem_utilization: float) -> None:
        # [INF] None is rejected (TypeError): the option is always emitted.
        check_isinstance("mem_utilization", mem_utilization, float, allow_none=False)
        raise_if_false(
            0.0 <= mem_utilization <= 1.0,
            f"mem_utilization must be in range [0,1], current:{mem_utilization}",
        )
        self._mem_utilization = mem_utilization

    @property
    def rdma_traffic_class(self) -> int | None:
        """RDMA traffic class (uint32; docs: [0, 255], multiple of 4); ``None`` if unset."""
        return self._rdma_traffic_class

    @rdma_traffic_class.setter
    def rdma_traffic_class(self, rdma_traffic_class: int | None) -> None:
        if rdma_traffic_class is not None:
            check_uint32("rdma_traffic_class", rdma_traffic_class)
        self._rdma_traffic_class = rdma_traffic_class

    @property
    def rdma_service_level(self) -> int | None:
        """RDMA service level (uint32; docs: [0, 7]); ``None`` if unset."""
        return self._rdma_service_level

    @rdma_service_level.setter
    def rdma_service_level(self, rdma_service_level: int | None) -> None:
        if rdma_service_level is not None:
            check_uint32("rdma_service_level", rdma_service_level)
        self._rdma_service_level = rdma_service_level


LLMConfig = LlmConfig
