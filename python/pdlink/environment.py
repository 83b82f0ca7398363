"""Every ``PDLINK_*`` environment variable pdlink's Python layer reads: its meaning, its default,
and one function per read (stdlib only; importing it loads nothing).

An option given in code (``EngineOptions``, an llm_datadist option, the server's configuration)
wins over the variable, and the variable over the default: each reader below returns the
variable's text, or its default when it is unset or empty (None where there is none), and the
caller puts its own option first and checks the value.

The C++ core reads its own few (what it loads and how loudly it logs: ``PDLINK_LOG_LEVEL``,
``PDLINK_ASCEND_LIB_DIR``, ``PDLINK_UCX_LIB_DIR``, ...), from its one table (csrc/core/environment.h);
``native_variables()`` lists them from the native module, and ``pdlink env`` prints both kinds with
what is set now.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Variable", "VARIABLES", "LIMIT_VARIABLES", "native_variables", "read", "transport", "link_secret",
           "backend", "hccl_one_sided", "ucx_trusted_network", "payload_integrity", "link_port_base", "limit"]


@dataclass(frozen=True)
class Variable:
    """One environment variable."""

    name: str
    meaning: str
    default: str | None  # the value when it is unset (or empty, unless empty_is_value; None: no value)
    empty_is_value: bool = False  # an empty setting is a value of its own ("" lists nothing)


TRANSPORT = Variable("PDLINK_TRANSPORT", "the link transport: auto, tcp, cma or ucx", "auto")
LINK_SECRET = Variable("PDLINK_LINK_SECRET", "the secret every link proves it knows (docs/security.md); "
                       "unset: links are not authenticated", None)
BACKEND = Variable("PDLINK_BACKEND", "the memory backend: auto, cpu or ascend", "auto")
HCCL_ONE_SIDED = Variable("PDLINK_HCCL_ONE_SIDED", "'1': HCCL one-sided reads and writes (docs/ascend.md)", "0")
UCX_TRUSTED_NETWORK = Variable("PDLINK_UCX_TRUSTED_NETWORK",
                               "'1': every process that can reach this one is trusted (docs/ucx.md)", "0")
PAYLOAD_INTEGRITY = Variable("PDLINK_PAYLOAD_INTEGRITY", "'1': every transfer's bytes are authenticated too "
                             "(llm_datadist; needs a link secret)", "0")
LINK_PORT_BASE = Variable("PDLINK_LINK_PORT_BASE", "llm_datadist's comm API: a rank listens at this base plus "
                          "its device id", "26800")

METRICS = Variable("PDLINK_METRICS", "'[HOST:]PORT': serve every engine of this process on a Prometheus "
                   "endpoint there (pdlink.Metrics; HOST defaults to 127.0.0.1); unset: none", None)

# The bounds on what peers may make an engine spend (llm_datadist's pdlink.* limit options;
# docs/security.md, "Limits"), by _core.EngineLimits field. Unset: the engine's own defaults.
LIMIT_VARIABLES: dict[str, Variable] = {
    field: Variable(f"PDLINK_{field.upper()}", f"EngineLimits.{field} (llm_datadist); unset: the engine's "
                    "default", None)
    for field in ("max_links", "max_links_per_source", "max_handshakes", "max_handshakes_per_source",
                  "hello_timeout_ms", "pin_timeout_ms", "handshake_timeout_ms", "max_notifications_per_link",
                  "max_notification_bytes", "max_notification_bytes_per_link", "max_notification_bytes_per_source",
                  "tcp_streams", "max_tcp_lanes", "tcp_chunk_bytes", "switch_drain_timeout_ms", "max_metric_peers")
}

VARIABLES: tuple[Variable, ...] = (TRANSPORT, LINK_SECRET, BACKEND, HCCL_ONE_SIDED, UCX_TRUSTED_NETWORK,
                                   PAYLOAD_INTEGRITY, LINK_PORT_BASE, METRICS, *LIMIT_VARIABLES.values())
"""Every variable this module reads."""


def read(variable: Variable, env: Mapping[str, str] | None = None) -> str | None:
    """``variable``'s text in ``env`` (default: the process environment); its default when it is
    unset or (unless ``empty_is_value``) empty."""
    value = (os.environ if env is None else env).get(variable.name)
    if value is None or (value == "" and not variable.empty_is_value):
        return variable.default
    return value


def native_variables() -> tuple[Variable, ...]:
    """The variables the C++ core reads itself (``pdlink._core.NATIVE_VARIABLES``, from
    csrc/core/environment.h); loads the native module."""
    from .native import core

    return tuple(Variable(name, meaning, default, empty_is_value)
                 for name, meaning, default, empty_is_value in core().NATIVE_VARIABLES)


def _set(variable: Variable, env: Mapping[str, str] | None) -> str:
    value = read(variable, env)
    assert value is not None  # a variable with a default
    return value


def transport(env: Mapping[str, str] | None = None) -> str:
    """``PDLINK_TRANSPORT``, or its default."""
    return _set(TRANSPORT, env)


def link_secret(env: Mapping[str, str] | None = None) -> str | None:
    """``PDLINK_LINK_SECRET``, or None."""
    return read(LINK_SECRET, env)


def backend(env: Mapping[str, str] | None = None) -> str:
    """``PDLINK_BACKEND``, or its default."""
    return _set(BACKEND, env)


def hccl_one_sided(env: Mapping[str, str] | None = None) -> str:
    """``PDLINK_HCCL_ONE_SIDED``, or its default."""
    return _set(HCCL_ONE_SIDED, env)


def ucx_trusted_network(env: Mapping[str, str] | None = None) -> str:
    """``PDLINK_UCX_TRUSTED_NETWORK``, or its default."""
    return _set(UCX_TRUSTED_NETWORK, env)


def payload_integrity(env: Mapping[str, str] | None = None) -> str:
    """``PDLINK_PAYLOAD_INTEGRITY``, or its default."""
    return _set(PAYLOAD_INTEGRITY, env)


def link_port_base(env: Mapping[str, str] | None = None) -> str:
    """``PDLINK_LINK_PORT_BASE``, or its default."""
    return _set(LINK_PORT_BASE, env)


def limit(field: str, env: Mapping[str, str] | None = None) -> str | None:
    """The variable of ``_core.EngineLimits`` field ``field`` (a key of ``LIMIT_VARIABLES``), or None."""
    return read(LIMIT_VARIABLES[field], env)
