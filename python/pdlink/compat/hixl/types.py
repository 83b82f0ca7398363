"""hixl's constants, enums and data classes (docs/hixl.md; the reference is hixl_api.md §3-6).

The real module is a pybind11 binding, so a wrong argument type raises ``TypeError`` before any
engine code runs; the data classes here check their fields the same way: unsigned fields take ints
(``bool`` and numpy integers too) within range, strings take ``str`` or ``bytes``.
"""

from __future__ import annotations

import enum
import operator
from typing import Any

# Status codes (plain ints; the C++ type is uint32).
SUCCESS = 0
PARAM_INVALID = 103900
TIMEOUT = 103901
NOT_CONNECTED = 103902
ALREADY_CONNECTED = 103903
NOTIFY_FAILED = 103904  # reserved: never returned
UNSUPPORTED = 103905
FAILED = 503900
RESOURCE_EXHAUSTED = 203900

# Option keys of Hixl.initialize.
OPTION_ENABLE_USE_FABRIC_MEM = "EnableUseFabricMem"
OPTION_RDMA_TRAFFIC_CLASS = "RdmaTrafficClass"
OPTION_RDMA_SERVICE_LEVEL = "RdmaServiceLevel"
OPTION_BUFFER_POOL = "BufferPool"
OPTION_GLOBAL_RESOURCE_CONFIG = "GlobalResourceConfig"
OPTION_AUTO_CONNECT = "AutoConnect"
OPTION_LOCAL_COMM_RES = "LocalCommRes"

# get_capability's answers.
FEATURE_SUPPORTED = 1
FEATURE_NOT_SUPPORTED = 0


class _UnscopedEnum(enum.IntEnum):
    """An unscoped C enum as pybind11 binds it: equal to its int, printed as ``Type.NAME``."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class _ScopedEnum(enum.Enum):
    """A C++ ``enum class`` as pybind11 binds it: ``int(x)`` and ``x.value`` work, but a member is
    not equal to its int (``TransferStatus.FAILED == 3`` is False)."""

    def __int__(self) -> int:
        return int(self.value)

    def __index__(self) -> int:
        return int(self.value)


class MemType(_UnscopedEnum):
    MEM_DEVICE = 0
    MEM_HOST = 1


class TransferOp(_UnscopedEnum):
    READ = 0  # remote -> local
    WRITE = 1  # local -> remote


class FeatureType(_UnscopedEnum):
    AUTO_CONNECT = 0
    CLIENT_SERVER_COMM = 1

    @classmethod
    def _missing_(cls, value: object) -> FeatureType | None:
        # pybind11 builds a member from any int32 (a feature a newer library knows), so
        # get_capability can answer FEATURE_NOT_SUPPORTED for it.
        if isinstance(value, int) and not isinstance(value, bool) and -2**31 <= value < 2**31:
            member = int.__new__(cls, value)
            member._name_ = f"???({value})"
            member._value_ = value
            return member
        return None


class TransferStatus(_ScopedEnum):
    WAITING = 0
    COMPLETED = 1
    TIMEOUT = 2  # never produced: the caller owns the deadline of an async transfer
    FAILED = 3


class AsyncConnectStatus(_ScopedEnum):
    NOT_CONNECT = 0
    CONNECT_PENDING = 1
    CONNECTING = 2
    CONNECTED = 3
    CONNECT_FAILED = 4
    DISCONNECT_PENDING = 5
    DISCONNECTING = 6


MEM_DEVICE, MEM_HOST = MemType.MEM_DEVICE, MemType.MEM_HOST
READ, WRITE = TransferOp.READ, TransferOp.WRITE
AUTO_CONNECT, CLIENT_SERVER_COMM = FeatureType.AUTO_CONNECT, FeatureType.CLIENT_SERVER_COMM
NOT_CONNECT = AsyncConnectStatus.NOT_CONNECT
CONNECT_PENDING = AsyncConnectStatus.CONNECT_PENDING
CONNECTING = AsyncConnectStatus.CONNECTING
CONNECTED = AsyncConnectStatus.CONNECTED
CONNECT_FAILED = AsyncConnectStatus.CONNECT_FAILED
DISCONNECT_PENDING = AsyncConnectStatus.DISCONNECT_PENDING
DISCONNECTING = AsyncConnectStatus.DISCONNECTING


# ---------------------------------------------------------------------------- argument conversion


def _ranged(value: Any, lo: int, hi: int, kind: str, what: str) -> int:
    """``value`` as an int in [lo, hi), as pybind11 converts it (ints, bools, numpy integers; not
    floats); TypeError otherwise."""
    if not isinstance(value, float):
        try:
            n = operator.index(value)
        except TypeError:
            pass
        else:
            if lo <= n < hi:
                return n
    raise TypeError(f"incompatible function arguments: {what} must be {kind}, got {value!r}")


def uint(value: Any, bits: int, what: str) -> int:
    """``value`` as an unsigned ``bits``-bit int; TypeError otherwise."""
    return _ranged(value, 0, 1 << bits, f"an unsigned {bits}-bit int", what)


def int32(value: Any, what: str) -> int:
    """``value`` as an int32 (the type of every timeout); TypeError otherwise."""
    return _ranged(value, -2**31, 2**31, "an int32", what)


def text(value: Any, what: str) -> str:
    """``value`` as a str (bytes are decoded as UTF-8); TypeError otherwise."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="surrogateescape")
    raise TypeError(f"incompatible function arguments: {what} must be a str, got {type(value).__name__}")


def flag(value: Any, what: str) -> bool:
    """``value`` as a bool: a bool or a number (``1`` works, ``"x"`` does not)."""
    if isinstance(value, bool):
        return value
    try:
        return operator.index(value) != 0
    except TypeError:
        pass
    if isinstance(value, float):
        return value != 0.0
    raise TypeError(f"incompatible function arguments: {what} must be a bool, got {value!r}")


def member(value: Any, kind: type[enum.Enum], what: str) -> Any:
    """``value`` if it is a member of ``kind``: a plain int is refused, as pybind11 does."""
    if not isinstance(value, kind):
        raise TypeError(f"incompatible function arguments: {what} must be hixl.{kind.__name__}, "
                        f"got {type(value).__name__}")
    return value


def _u64(value: Any, what: str) -> int:
    return uint(value, 64, what)


def _u32(value: Any, what: str) -> int:
    return uint(value, 32, what)


class _Checked:
    """Read/write attributes converted on every assignment (pybind11's ``def_readwrite``); reads
    are plain slot reads, so a transfer reads its descriptors at C speed."""

    __slots__: tuple[str, ...] = ()
    _convert: dict[str, Any] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        convert = self._convert.get(name)
        if convert is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (or it is read-only)")
        object.__setattr__(self, name, convert(value, f"{type(self).__name__}.{name}"))


class MemDesc(_Checked):
    """Memory to register: ``addr`` and ``len`` bytes. ``local_only``: for this engine's own
    transfers only (peers may not write it; docs/compatibility.md)."""

    __slots__ = ("addr", "len", "local_only")
    _convert = {"addr": _u64, "len": _u64, "local_only": flag}

    def __init__(self, addr: int, len: int) -> None:  # noqa: A002 - hixl's keyword name
        self.addr, self.len, self.local_only = addr, len, False


class TransferOpDesc(_Checked):
    """One descriptor of a transfer: ``len`` bytes at ``local_addr`` <-> ``remote_addr``."""

    __slots__ = ("local_addr", "remote_addr", "len")
    _convert = {"local_addr": _u64, "remote_addr": _u64, "len": _u64}

    def __init__(self, local_addr: int, remote_addr: int, len: int) -> None:  # noqa: A002
        self.local_addr, self.remote_addr, self.len = local_addr, remote_addr, len


class TransferArgs(_Checked):
    """Extra arguments of ``transfer_async``: ``user_data``, echoed by ``get_all_transfer_status``."""

    __slots__ = ("user_data",)
    _convert = {"user_data": _u64}

    def __init__(self) -> None:
        self.user_data = 0


class GetTransferStatusArgs(_Checked):
    """What ``get_all_transfer_status`` reports: at most ``max_query_count`` results, without the
    still-running ones when ``skip_waiting``."""

    __slots__ = ("max_query_count", "skip_waiting")
    _convert = {"max_query_count": _u32, "skip_waiting": flag}

    def __init__(self, max_query_count: int = 0xFFFFFFFF, skip_waiting: bool = False) -> None:
        self.max_query_count, self.skip_waiting = max_query_count, skip_waiting


class TransferResult(_Checked):
    """One async request's state (``get_all_transfer_status``); ``status`` is read-only."""

    __slots__ = ("req", "user_data", "_status")
    _convert = {"req": _u64, "user_data": _u64}
    _status: TransferStatus

    def __init__(self) -> None:
        self.req, self.user_data = 0, 0
        object.__setattr__(self, "_status", TransferStatus.WAITING)

    @property
    def status(self) -> TransferStatus:
        return self._status


def transfer_result(req: int, user_data: int, status: TransferStatus) -> TransferResult:
    """A TransferResult as ``get_all_transfer_status`` reports it (its status is read-only)."""
    result = TransferResult()
    result.req, result.user_data = req, user_data
    object.__setattr__(result, "_status", status)
    return result


class NotifyDesc(_Checked):
    """A notification: ``name`` and ``notify_msg`` (at most 1024 characters each when sent)."""

    __slots__ = ("name", "notify_msg")
    _convert = {"name": text, "notify_msg": text}

    def __init__(self, name: str, notify_msg: str) -> None:
        self.name, self.notify_msg = name, notify_msg
