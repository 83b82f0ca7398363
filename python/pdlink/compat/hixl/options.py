"""``Hixl.initialize``'s engine identity and options, checked as CANN's hixl checks them
(hixl_api.md §7.2, §8.1, §9). The Ascend-only options are validated and then have no effect
(docs/hixl.md, "Options")."""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass
from typing import Any

from .types import PARAM_INVALID, UNSUPPORTED


class OptionError(Exception):
    """A refused identity or option: ``code`` is what ``initialize`` returns."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Identity:
    """An engine id, ``"ip:port"``, ``"ip"``, ``"[ipv6]:port"`` or ``"[ipv6]"``."""

    host: str  # the literal address, without brackets
    port: int  # 0: no port (a client-only engine)

    @property
    def address(self) -> tuple[str, int]:
        """What pdlink listens on or dials: ``(ip, port)``."""
        return (self.host, self.port)


def parse_identity(engine: str) -> Identity:
    """Raises ``OptionError`` (PARAM_INVALID) for anything but a literal IP and an optional port."""
    if engine.startswith("["):
        host, close, rest = engine[1:].partition("]")
        version = 6
    else:
        if engine.count(":") > 1:
            raise OptionError(PARAM_INVALID, f"engine id {engine!r}: write an IPv6 address as '[ip]:port'")
        host, sep, port = engine.partition(":")
        close, rest, version = "]", sep + port, 4
    if not close or (rest and not rest.startswith(":")):
        raise OptionError(PARAM_INVALID, f"engine id {engine!r} is not 'ip', 'ip:port', '[ipv6]' or '[ipv6]:port'")
    try:
        parsed = ipaddress.ip_address(host)
    except ValueError:
        raise OptionError(PARAM_INVALID, f"engine id {engine!r}: {host!r} is not a literal IP address") from None
    if parsed.version != version:
        raise OptionError(PARAM_INVALID, f"engine id {engine!r}: {host!r} is not an IPv{version} address")
    port = rest[1:]
    if rest and (not port.isdigit() or int(port) > 65535):
        raise OptionError(PARAM_INVALID, f"engine id {engine!r}: the port must be a number in [0, 65535]")
    return Identity(str(parsed), int(port) if rest else 0)


@dataclass(frozen=True)
class Options:
    """What pdlink uses of the options (the rest is validated only)."""

    auto_connect: bool = False
    connect_threads: int = 2
    connect_queue: int = 128


_ALIASES = {"adxl.RdmaTrafficClass": "RdmaTrafficClass", "adxl.RdmaServiceLevel": "RdmaServiceLevel",
            "adxl.LocalCommRes": "LocalCommRes", "adxl.BufferPool": "BufferPool"}
_KEYS = {"EnableUseFabricMem", "RdmaTrafficClass", "RdmaServiceLevel", "BufferPool", "GlobalResourceConfig",
         "AutoConnect", "LocalCommRes"}


def _invalid(message: str) -> OptionError:
    return OptionError(PARAM_INVALID, message)


def _int_text(value: str, what: str, lo: int, hi: int) -> int:
    if not value.strip().isdigit():
        raise _invalid(f"{what} must be an integer, got {value!r}")
    n = int(value)
    if not lo <= n <= hi:
        raise _invalid(f"{what} must be in [{lo}, {hi}], got {n}")
    return n


def _number(value: Any, what: str) -> float:
    """A GlobalResourceConfig number: a JSON number or a numeric string."""
    if isinstance(value, bool):
        raise _invalid(f"{what} must be a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise _invalid(f"{what} must be a number, got {value!r}")


def _integer(value: Any, what: str, lo: int, hi: int) -> int:
    n = _number(value, what)
    if n != int(n) or not lo <= n <= hi:
        raise _invalid(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
    return int(n)


def _json(value: str, what: str) -> Any:
    try:
        return json.loads(value)
    except ValueError as e:
        raise _invalid(f"{what} is not valid JSON: {e}") from None


def _global_config(value: str, options: dict[str, Any]) -> None:
    config = _json(value, "GlobalResourceConfig")
    if not isinstance(config, dict):
        raise _invalid("GlobalResourceConfig must be a JSON object")
    if "connect_pool.thread_num" in config:
        options["connect_threads"] = _integer(config["connect_pool.thread_num"], "connect_pool.thread_num", 1, 64)
    if "connect_pool.task_queue_capacity" in config:
        options["connect_queue"] = _integer(config["connect_pool.task_queue_capacity"],
                                            "connect_pool.task_queue_capacity", 1, 65535)
    high, low = config.get("channel_pool.high_waterline"), config.get("channel_pool.low_waterline")
    if (high is None) != (low is None):
        raise _invalid("channel_pool.high_waterline and channel_pool.low_waterline go together")
    if "channel_pool.max_channel" in config:
        if high is None:
            raise _invalid("channel_pool.max_channel needs both waterlines")
        _integer(config["channel_pool.max_channel"], "channel_pool.max_channel", 1, 512)
    if high is not None:
        h, lo = _number(high, "channel_pool.high_waterline"), _number(low, "channel_pool.low_waterline")
        if not (0 < lo < h < 1):
            raise _invalid(f"the channel pool waterlines must satisfy 0 < low < high < 1, got {low!r}, {high!r}")
        most = _integer(config.get("channel_pool.max_channel", 512), "channel_pool.max_channel", 1, 512)
        if max(1, int(most * h)) - max(1, int(most * lo)) < 1:
            raise _invalid("the channel pool's high and low marks must differ by at least one link")
    desc = config.get("comm_resource_config.protocol_desc")
    if desc is not None and not (isinstance(desc, str) or (isinstance(desc, list)
                                                           and all(isinstance(d, str) for d in desc))):
        raise _invalid("comm_resource_config.protocol_desc must be a string or a list of strings")
    for key, lo, hi in (("comm_resource_config.listen_port", 1, 65535), ("comm_resource_config.qos", 0, 7),
                        ("comm_resource_config.max_active_channels", 1, 2**32 - 1),
                        ("fabric_memory.task_stream_num", 1, 8)):
        if key in config:
            _integer(config[key], key, lo, hi)
    for key, lo in (("fabric_memory.max_capacity", 1), ("fabric_memory.start_address", 0)):
        if key in config:
            _integer(config[key], key, lo, 1024)
    path = config.get("local_comm_res_path")
    if path is not None:
        if not isinstance(path, str) or not path or not os.path.isfile(path):
            raise _invalid(f"local_comm_res_path must name a regular file, got {path!r}")
        if not 1 <= os.path.getsize(path) <= 1 << 20:
            raise _invalid("the local_comm_res_path file must hold 1 B to 1 MiB")


def parse_options(raw: dict[str, str]) -> Options:
    """Raises ``OptionError``: PARAM_INVALID for an unknown key or a malformed value, UNSUPPORTED for
    FabricMem (A3 only)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = _ALIASES.get(key, key)
        if name not in _KEYS:
            raise _invalid(f"unsupported option {key!r}")
        if name == "AutoConnect":
            if value not in ("0", "1"):
                raise _invalid(f"AutoConnect must be '0' or '1', got {value!r}")
            out["auto_connect"] = value == "1"
        elif name == "EnableUseFabricMem":
            if value not in ("0", "1"):
                raise _invalid(f"EnableUseFabricMem must be '0' or '1', got {value!r}")
            if value == "1":
                raise OptionError(UNSUPPORTED, "FabricMem (EnableUseFabricMem=1) exists only on Ascend A3")
        elif name == "BufferPool":
            count, sep, size = value.partition(":")
            if not sep or not count.isdigit() or not size.isdigit():
                raise _invalid(f"BufferPool must be 'N:M' (N buffers of M MB), got {value!r}")
            n, m = int(count), int(size)
            if (n == 0) != (m == 0) or n * m * (1 << 20) >= 1 << 64:
                raise _invalid(f"BufferPool {value!r}: both numbers positive (or '0:0'), and not overflowing")
        elif name == "RdmaTrafficClass":
            if _int_text(value, key, 0, 255) % 4:
                raise _invalid(f"{key} must be a multiple of 4, got {value}")
        elif name == "RdmaServiceLevel":
            _int_text(value, key, 0, 7)
        elif name == "LocalCommRes":
            if value:
                _json(value, key)
        else:
            _global_config(value, out)
    return Options(**out)
