"""The one place tests reach below pdlink's public names.

Tests import public names from ``pdlink`` and ``llm_datadist`` (and ``llm_datadist``'s own
submodules, which are part of the API it mirrors). Everything else they need, submodules and
private attributes alike, comes from here, so moving a file inside ``python/pdlink`` means editing
this module, not the tests.
"""

from __future__ import annotations

from typing import Any

from pdlink import _core
from pdlink._sysinfo import direct_access_permitted
from pdlink.client import ClientError, ManagementClient, NodeSpec, NotReady, Response, RoleRejected, role_body
from pdlink.compat.llm_datadist import _utils as validation_utils
from pdlink.compat.llm_datadist import data_type as data_type_module
from pdlink.compat.llm_datadist._utils import handle_llm_status
from pdlink.compat.llm_datadist.comm import parse_rank_table
from pdlink.compat.llm_datadist.configs import ip_to_int, role_to_option
from pdlink.compat.llm_datadist.data_type import itemsize
from pdlink.compat.llm_datadist.llm_datadist import LIMIT_OPTIONS, parse_engine_options
from pdlink.compat.llm_datadist.llm_types import PushType, register_mem_status_from_int
from pdlink.compat.llm_datadist.transfer import transfer_cache_async
from pdlink.device import DeviceMemory, backend_info, open_backend
from pdlink.native import core as native_core
from pdlink.native import open_engine
from pdlink.server import config as server_config
from pdlink.server.defaults import DEFAULT_CONFIG_JSON
from pdlink.server.parsing import structure_error
from pdlink.server.tls import client_context, server_context
from pdlink.server.validation import ROLES, BodyError, cluster_id, parse_role_request
from pdlink.status import as_llm_exception, error_class, raise_if_false, raise_if_true

__all__ = [
    "backend_info", "backend_name", "BodyError", "cache_count", "cache_manager", "client_context", "ClientError",
    "cluster_id", "core", "data_type_module", "DEFAULT_CONFIG_JSON", "device_cache_ids", "DeviceMemory",
    "as_llm_exception", "async_tasks", "direct_access_permitted", "engine", "error_class", "handle_llm_status",
    "hixl_engine", "hixl_module", "hixl_requests", "invalidate",
    "ucx_info", "LIMIT_OPTIONS", "ip_to_int", "itemsize", "native_engine",
    "ManagementClient", "manager_role", "engines", "NodeSpec", "NotReady", "open_backend", "open_engine",
    "parse_engine_options", "parse_rank_table", "parse_role_request", "pools", "PushType", "raise_if_false",
    "raise_if_true", "register_mem_status_from_int", "Response", "role_body", "role_to_option", "RoleRejected",
    "ROLES", "server_config", "server_context", "structure_error", "transfer_cache_async", "validation_utils",
]

core = _core  # the native module
native_core()  # loaded as pdlink loads it: its errors registered (failed calls raise pdlink.status's classes)


def ucx_info() -> dict[str, Any]:
    """What pdlink's UCX loader finds (loaded, error, library, version), the libucx wheel included."""
    return dict(native_core().ucx_info())


def cache_manager(engine: Any, remote_accessible: bool = True) -> Any:
    """pdlink's CacheManager over a ``pdlink.Engine`` (several engines in one process, which one
    LLMDataDist per process does not allow; the load tests)."""
    from types import SimpleNamespace

    from pdlink.compat.llm_datadist.cache_manager import CacheManager

    return CacheManager(SimpleNamespace(_is_call_linked=False), engine, remote_accessible, {})


def hixl_module() -> Any:
    """The module of pdlink's ``hixl.Hixl`` (its limits, ``MAX_PENDING_TRANSFERS`` say, are read
    there at each call)."""
    from pdlink.compat.hixl import hixl as module

    return module


def hixl_requests(h: Any) -> tuple[int, int]:
    """How many async requests a ``hixl.Hixl`` keeps (not yet reported finished), and how many of
    those still run."""
    with h._state:
        return len(h._requests), sum(not r.pending.done() for r in h._requests.values())


def hixl_engine(h: Any) -> Any:
    """The ``pdlink.Engine`` under a ``hixl.Hixl`` (None once finalized)."""
    return h._engine


def async_tasks(cm: Any) -> int:
    """How many ``transfer_cache_async`` jobs a CacheManager holds (running ones)."""
    return len(cm._async_tasks)


def native_engine(engine: Any) -> Any:
    """The ``pdlink._core.Engine`` under a ``pdlink.Engine``."""
    return engine._native


def engine(dd: Any) -> Any:
    """The ``pdlink.Engine`` under an ``LLMDataDist`` (the first device's in v1 multi-device mode)."""
    return dd._engine


def engines(dd: Any) -> list[Any]:
    """The ``pdlink.Engine`` of each device under a v1 (KvCacheManager mode) ``LLMDataDist``."""
    return list(dd._engines)


def manager_role(km: Any) -> int:
    """The role a ``KvCacheManager`` enforces (what ``switch_role`` updates)."""
    return int(km._role)


def device_cache_ids(km: Any, cache: Any) -> list[int]:
    """The ids of the per-device caches behind a ``KvCacheManager``'s cache."""
    return [int(d.cache_id) for d in km._live[cache.cache_id][1]]


def invalidate(km: Any) -> None:
    """What ``LLMDataDist.finalize`` does to its ``KvCacheManager`` (for a manager built without one)."""
    km._invalidate()


def cache_count(dd: Any) -> int:
    """Caches the engine holds (registered, allocated, or kept alive by request keys)."""
    return int(dd._engine.kv.count)


def backend_name(dd: Any) -> str:
    return str(dd._engine.backend)


def pools(dd: Any) -> list[dict[str, Any]]:
    """The engine's memory pools: placement, base, capacity, used."""
    return list(dd._engine.kv.pools())
