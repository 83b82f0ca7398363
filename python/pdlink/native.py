"""The native engine, made from typed settings: the one place that turns them into a
``pdlink._core.EngineConfig`` and opens the engine's backend.

Names, not numbers, cross this boundary: a role, transport or placement is given by its name
(``"PROMPT"``, ``"tcp"``, ``"DEVICE"``; or an enum whose ``name`` is that), and its value is read
from the native module, which binds the C++ enums once. Loads ``pdlink._core`` on first use.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["core", "open_engine", "role_of", "transport_of", "placement_of", "transport_names", "backend_names"]


_core_module: Any = None


def core() -> Any:
    """The native module (imported on first use, so that ``import pdlink`` stays light), its
    errors registered: a failed ``Status`` raises the ``pdlink.status`` class of its code."""
    global _core_module
    if _core_module is None:
        from . import _core
        from .engine import TransferCancelled
        from .status import LLMStatusCode, native_errors

        # A transfer stopped at a cancel point (by its token or a drain timeout) raises
        # TransferCancelled, synchronous calls included.
        _core._register_errors({**native_errors(),
                                _core.CANCELLED_ERROR_KEY: (TransferCancelled, LLMStatusCode.LLM_FAILED)})
        _core.set_ucx_wheel_dir(_ucx_wheel_dir())
        _core_module = _core
    return _core_module


def _ucx_wheel_dir() -> str:
    """The lib/ folder of the ``libucx`` package (``pip install "pdlink[ucx]"``), found without
    importing it; "" when it is not installed."""
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.origin:
        return ""
    return os.path.join(os.path.dirname(spec.origin), "lib")


def _member(enum_type: Any, what: str, value: str | enum.Enum) -> Any:
    name = value.name if isinstance(value, enum.Enum) else str(value)
    try:
        return enum_type.__members__[name.upper()]
    except KeyError:
        names = sorted(n.lower() for n in enum_type.__members__)
        raise ValueError(f"unknown {what} {name!r}; one of {names}") from None


def role_of(value: str | enum.Enum) -> Any:
    """``_core.Role`` by name (``LLMRole.PROMPT`` or ``"PROMPT"``)."""
    return _member(core().Role, "role", value)


def transport_names() -> tuple[str, ...]:
    """The transport names engines take (``"auto"``, ``"tcp"``, ...): ``_core.Transport``'s members."""
    return tuple(name.lower() for name in core().Transport.__members__)


def backend_names() -> tuple[str, ...]:
    """The backend names engines take (``"auto"``, ``"cpu"``, ...): ``_core.BACKENDS``."""
    return tuple(core().BACKENDS)


def transport_of(value: str | enum.Enum) -> Any:
    """``_core.Transport`` by name (``"auto"``, ``"tcp"``, ``"cma"``)."""
    return _member(core().Transport, "transport", value)


def placement_of(value: str | enum.Enum) -> Any:
    """``_core.Placement`` by name (``Placement.DEVICE`` or ``"HOST"``)."""
    return _member(core().Placement, "placement", value)


def open_engine(*, backend: str, device_id: int, cluster_id: int, role: str | enum.Enum, listen_ip: str = "",
                listen_port: int = 0, sync_timeout_ms: int = 1000,
                device_pool: tuple[int, int | None] = (0, None), host_pool: tuple[int, int | None] = (0, None),
                transport: str = "auto", link_secret: str = "",
                payload_integrity: bool = False, hccl_one_sided: bool = False, one_way_links: bool = False,
                ucx_trusted_network: bool = False,
                limits: dict[str, int] | None = None) -> Any:
    """An initialised ``_core.Engine`` on backend ``backend`` (``"auto"``, ``"cpu"``, ``"ascend"``)
    and device ``device_id``. Pools are ``(bytes, page_shift)``, 0 bytes for none, page shift None for the
    engine's default; ``limits``
    overrides fields of ``_core.EngineLimits`` (the engine's defaults otherwise). Raises
    LLMException with the engine's status code when it cannot start, ValueError for a limit that
    is not positive."""
    c = core()
    config = c.EngineConfig()
    config.cluster_id = cluster_id
    config.role = role_of(role)
    config.listen_ip = listen_ip
    config.listen_port = listen_port
    config.sync_timeout_ms = sync_timeout_ms
    config.device_pool = _pool_config(c, *device_pool)
    config.host_pool = _pool_config(c, *host_pool)
    config.transport = transport_of(transport)
    config.link_secret = link_secret
    config.payload_integrity = payload_integrity
    config.hccl_one_sided = hccl_one_sided
    config.one_way_links = one_way_links
    config.ucx_trusted_network = ucx_trusted_network
    engine_limits = c.EngineLimits()
    for field, value in (limits or {}).items():
        setattr(engine_limits, field, value)
    config.limits = engine_limits
    engine = c.Engine(c.open_backend(backend, device_id))
    engine.initialize(config)
    return engine


def _pool_config(c: Any, size: int, page_shift: int | None) -> Any:
    return c.PoolConfig(size) if page_shift is None else c.PoolConfig(size, page_shift)
