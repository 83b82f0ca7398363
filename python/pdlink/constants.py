"""The engine's constants, by public name: what the layers on ``pdlink.Engine`` (llm_datadist,
hixl, the server) and programs need to know of it without reaching into its native module.

Each is read from the native module on first use (module ``__getattr__``), so that importing this
module does not load it; ``pdlink.ANY_CLUSTER`` and the others below are the same values.

- ``ANY_CLUSTER``: a peer cluster id to be learned from the handshake; never a real cluster id.
- ``INVALID_ID``: an unset request id, prefix id or registration key.
- ``LATEST_LINK_MARK``: ``Engine.linked_since(LATEST_LINK_MARK)`` lists no peer, only the latest mark.
- ``LIMITS``: the bounds on what one peer may make an engine spend (``max_raw_span``,
  ``max_notify_name_bytes``, ...; csrc/core/limits.h), a read-only mapping.
- ``BACKENDS``: the backend names engines take (``"auto"``, ``"cpu"``, ``"ascend"``).
- ``TRANSPORTS``: the transport names engines take (``"auto"``, ``"tcp"``, ``"cma"``, ``"ucx"``).
- ``PROTOCOL_VERSION``: the wire protocol version this engine speaks.
- ``LATENCY_BOUNDS``: the upper bounds, in seconds, of telemetry's latency histogram buckets (+Inf
  follows; docs/metrics.md).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .native import backend_names, core, transport_names

__all__ = ["ANY_CLUSTER", "BACKENDS", "INVALID_ID", "LATENCY_BOUNDS", "LATEST_LINK_MARK", "LIMITS", "PROTOCOL_VERSION",
           "TRANSPORTS"]

if TYPE_CHECKING:  # what the module __getattr__ below returns
    ANY_CLUSTER: int
    BACKENDS: tuple[str, ...]
    INVALID_ID: int
    LATENCY_BOUNDS: tuple[float, ...]
    LATEST_LINK_MARK: int
    LIMITS: Mapping[str, int]
    PROTOCOL_VERSION: int
    TRANSPORTS: tuple[str, ...]

_INTS = ("ANY_CLUSTER", "INVALID_ID", "LATEST_LINK_MARK", "PROTOCOL_VERSION")


def __getattr__(name: str) -> Any:
    value: Any
    if name in _INTS:
        value = int(getattr(core(), name))
    elif name == "LIMITS":
        value = types.MappingProxyType(dict(core().LIMITS))
    elif name == "LATENCY_BOUNDS":
        value = tuple(core().LATENCY_BOUNDS)
    elif name == "BACKENDS":
        value = backend_names()
    elif name == "TRANSPORTS":
        value = transport_names()
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # read once
    return value
