"""pdlink's drop-in ``hixl`` package (the contract: ../shared/spec/hixl_api.md, section 12, with the
hixl_cs personality): the module surface, constants, enums and data classes; the argument-type
mistakes that raise TypeError (spec section 6); the codes and empty companions of every method
before initialize and after finalize; option and engine-string validation; registration rules; and,
between real peer processes (tests/peers/hixl_peer.py), the official example's READ of 8 MiB, WRITE
flows, the call sequences of Ray, vllm-ascend EPLB and Mooncake TENT (spec 11.3-11.5),
notifications, strict address validation (nothing moves), async requests (and what becomes of one
held in flight at a relay when its remote is disconnected, its engine finalized or its timeout
passes; the bound on requests nobody polls), a frozen peer and a dead one. Every transfer checks
the whole destination (moved bytes equal the source, everything else and the guard bytes
unchanged) and the source unchanged.
"""

from __future__ import annotations

import functools
import gc
import importlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest

import hixl
from backend_env import VARIANTS, Variant
from comm_util import free_port, rank_table
from conftest import only
from peer import Peer
from peers import hixl_peer
from poll import hang_guard, wait_until
from relay import DOWN, UP, Relay
from verify import Copy, Snapshot, assert_same

R = TypeVar("R")
H: Any = hixl  # for the calls that pass deliberately wrong types (mypy would refuse them)
NOBODY = "127.0.0.1:1"  # an engine id nobody has: no link to it, ever
# the cells where every transfer goes through the peer's serving thread (a frozen peer answers nothing)
SERVING = only(*(v.id for v in VARIANTS if v.serving_loop))

STATUS_CODES = {"SUCCESS": 0, "PARAM_INVALID": 103900, "TIMEOUT": 103901, "NOT_CONNECTED": 103902,
                "ALREADY_CONNECTED": 103903, "NOTIFY_FAILED": 103904, "UNSUPPORTED": 103905, "FAILED": 503900,
                "RESOURCE_EXHAUSTED": 203900}
OPTION_KEYS = {"OPTION_ENABLE_USE_FABRIC_MEM": "EnableUseFabricMem", "OPTION_RDMA_TRAFFIC_CLASS": "RdmaTrafficClass",
               "OPTION_RDMA_SERVICE_LEVEL": "RdmaServiceLevel", "OPTION_BUFFER_POOL": "BufferPool",
               "OPTION_GLOBAL_RESOURCE_CONFIG": "GlobalResourceConfig", "OPTION_AUTO_CONNECT": "AutoConnect",
               "OPTION_LOCAL_COMM_RES": "LocalCommRes"}
ENUMS = {
    "MemType": {"MEM_DEVICE": 0, "MEM_HOST": 1},
    "TransferOp": {"READ": 0, "WRITE": 1},
    "TransferStatus": {"WAITING": 0, "COMPLETED": 1, "TIMEOUT": 2, "FAILED": 3},
    "AsyncConnectStatus": {"NOT_CONNECT": 0, "CONNECT_PENDING": 1, "CONNECTING": 2, "CONNECTED": 3,
                           "CONNECT_FAILED": 4, "DISCONNECT_PENDING": 5, "DISCONNECTING": 6},
    "FeatureType": {"AUTO_CONNECT": 0, "CLIENT_SERVER_COMM": 1},
}
UNSCOPED = ("MemType", "TransferOp", "FeatureType")  # compare equal to ints
SCOPED = ("TransferStatus", "AsyncConnectStatus")  # do not
EXPORTED = ("MemType", "TransferOp", "AsyncConnectStatus", "FeatureType")  # members at module level too
ALL = [
    "SUCCESS", "PARAM_INVALID", "TIMEOUT", "NOT_CONNECTED", "ALREADY_CONNECTED", "NOTIFY_FAILED", "UNSUPPORTED",
    "FAILED", "RESOURCE_EXHAUSTED",
    "OPTION_ENABLE_USE_FABRIC_MEM", "OPTION_RDMA_TRAFFIC_CLASS", "OPTION_RDMA_SERVICE_LEVEL", "OPTION_BUFFER_POOL",
    "OPTION_GLOBAL_RESOURCE_CONFIG", "OPTION_AUTO_CONNECT", "OPTION_LOCAL_COMM_RES",
    "FEATURE_SUPPORTED", "FEATURE_NOT_SUPPORTED",
    "MemType", "MEM_DEVICE", "MEM_HOST", "TransferOp", "READ", "WRITE", "TransferStatus", "AsyncConnectStatus",
    "NOT_CONNECT", "CONNECT_PENDING", "CONNECTING", "CONNECTED", "CONNECT_FAILED", "DISCONNECT_PENDING",
    "DISCONNECTING", "FeatureType", "AUTO_CONNECT", "CLIENT_SERVER_COMM",
    "MemDesc", "TransferOpDesc", "TransferArgs", "GetTransferStatusArgs", "TransferResult", "NotifyDesc", "Hixl",
    "get_capability",
]
AUTO = {"AutoConnect": "1"}
EXAMPLE_OPTIONS = {"AutoConnect": "1",
                   "GlobalResourceConfig": json.dumps({"comm_resource_config.protocol_desc": ["roce:device"]})}


# ============================================================================ single process: surface


def test_all_is_exactly_the_reference_list_in_order() -> None:
    assert list(hixl.__all__) == ALL
    missing = [name for name in ALL if not hasattr(hixl, name)]
    assert not missing, missing


def test_hixl_hixl_is_an_alias_module_with_the_same_objects() -> None:
    alias = importlib.import_module("hixl.hixl")
    different = [name for name in ALL if getattr(alias, name, None) is not getattr(hixl, name)]
    assert not different, different


@pytest.mark.parametrize("name", list(STATUS_CODES))
def test_status_codes_are_plain_ints(name: str) -> None:
    value = getattr(hixl, name)
    assert type(value) is int
    assert value == STATUS_CODES[name]


@pytest.mark.parametrize("name", list(OPTION_KEYS))
def test_option_keys(name: str) -> None:
    value = getattr(hixl, name)
    assert type(value) is str
    assert value == OPTION_KEYS[name]


def test_capability_values() -> None:
    assert (hixl.FEATURE_SUPPORTED, hixl.FEATURE_NOT_SUPPORTED) == (1, 0)
    assert type(hixl.FEATURE_SUPPORTED) is int and type(hixl.FEATURE_NOT_SUPPORTED) is int


@pytest.mark.parametrize("enum_name", list(ENUMS))
def test_enum_members_names_and_values(enum_name: str) -> None:
    enum = getattr(hixl, enum_name)
    members = ENUMS[enum_name]
    assert list(enum.__members__) == list(members)
    for name, value in members.items():
        member = getattr(enum, name)
        assert member.name == name
        assert member.value == value
        assert int(member) == value
        assert enum(value) == member
        assert {member: name}[member] == name  # hashable
        if enum_name in EXPORTED:
            assert getattr(hixl, name) is member
        if enum_name in UNSCOPED:
            assert member == value
        else:
            assert not (member == value)
            assert member != value


def test_transfer_states_are_not_at_module_level() -> None:
    # hixl.TIMEOUT and hixl.FAILED are the status codes; WAITING and COMPLETED are nowhere at top level
    assert hixl.TIMEOUT == 103901 and type(hixl.TIMEOUT) is int
    assert hixl.FAILED == 503900 and type(hixl.FAILED) is int
    assert not hasattr(hixl, "WAITING")
    assert not hasattr(hixl, "COMPLETED")
    assert hixl.TransferStatus.TIMEOUT is not hixl.TIMEOUT
    assert int(hixl.TransferStatus.FAILED) == 3


def test_unscoped_enums_equal_ints_as_the_official_tests_use_them() -> None:
    assert hixl.MEM_HOST == 1 and hixl.MEM_DEVICE == 0
    assert hixl.READ == 0 and hixl.WRITE == 1
    assert hixl.AUTO_CONNECT == 0 and hixl.CLIENT_SERVER_COMM == 1
    assert hixl.MemType(1) == hixl.MEM_HOST
    assert not (hixl.TransferStatus.FAILED == 3)
    assert not (hixl.AsyncConnectStatus.CONNECTED == 3)
    assert int(hixl.AsyncConnectStatus.CONNECTED) == 3


def test_mem_desc() -> None:
    d = hixl.MemDesc(addr=0x1000, len=64)
    assert (d.addr, d.len, d.local_only) == (0x1000, 64, False)
    d.addr, d.len, d.local_only = 0x2000, 128, True
    assert (d.addr, d.len, d.local_only) == (0x2000, 128, True)
    assert (hixl.MemDesc(2**64 - 1, 2**64 - 1).addr, hixl.MemDesc(5, 6).len) == (2**64 - 1, 6)
    with pytest.raises(TypeError):
        H.MemDesc()
    with pytest.raises(TypeError):
        H.MemDesc(0x1000)


def test_transfer_op_desc() -> None:
    d = hixl.TransferOpDesc(local_addr=1, remote_addr=2, len=3)
    assert (d.local_addr, d.remote_addr, d.len) == (1, 2, 3)
    d.local_addr, d.remote_addr, d.len = 4, 5, 6
    assert (d.local_addr, d.remote_addr, d.len) == (4, 5, 6)
    with pytest.raises(TypeError):
        H.TransferOpDesc(1, 2)


def test_transfer_args() -> None:
    a = hixl.TransferArgs()
    assert a.user_data == 0
    a.user_data = 2**64 - 1  # pointer-sized
    assert a.user_data == 2**64 - 1


def test_get_transfer_status_args() -> None:
    a = hixl.GetTransferStatusArgs()
    assert (a.max_query_count, a.skip_waiting) == (0xFFFFFFFF, False)
    b = hixl.GetTransferStatusArgs(max_query_count=5, skip_waiting=True)
    assert (b.max_query_count, b.skip_waiting) == (5, True)
    b.max_query_count, b.skip_waiting = 0, False
    assert (b.max_query_count, b.skip_waiting) == (0, False)
    assert hixl.GetTransferStatusArgs(7).max_query_count == 7


def test_transfer_result() -> None:
    r = hixl.TransferResult()
    assert (r.req, r.user_data, r.status) == (0, 0, hixl.TransferStatus.WAITING)
    r.req, r.user_data = 9, 10
    assert (r.req, r.user_data) == (9, 10)
    with pytest.raises(AttributeError):
        H.TransferResult().status = hixl.TransferStatus.COMPLETED


def test_notify_desc() -> None:
    n = hixl.NotifyDesc(name="layer0", notify_msg="done")
    assert (n.name, n.notify_msg) == ("layer0", "done")
    n.name, n.notify_msg = "a", "b"
    assert (n.name, n.notify_msg) == ("a", "b")
    with pytest.raises(TypeError):
        H.NotifyDesc("only-a-name")


# ============================================================================ single process: TypeError table


@pytest.fixture
def engine() -> Iterator[Any]:
    """A client-only engine in this process (nothing listens), finalized at teardown."""
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", {}) == hixl.SUCCESS
    yield e
    e.finalize()


def _descs() -> list[Any]:
    return [hixl.TransferOpDesc(0x10000, 0x20000, 8)]


TYPE_ERRORS: list[tuple[str, Callable[[Any], object]]] = [
    # str, float or None where an int is expected
    ("MemDesc-str-addr", lambda e: H.MemDesc("4096", 8)),
    ("MemDesc-float-len", lambda e: H.MemDesc(4096, 8.0)),
    ("MemDesc-None-addr", lambda e: H.MemDesc(None, 8)),
    ("TransferOpDesc-str-len", lambda e: H.TransferOpDesc(1, 2, "3")),
    ("TransferOpDesc-float-local", lambda e: H.TransferOpDesc(1.0, 2, 3)),
    ("TransferOpDesc-None-remote", lambda e: H.TransferOpDesc(1, None, 3)),
    ("GetTransferStatusArgs-str", lambda e: H.GetTransferStatusArgs("5")),
    ("deregister_mem-str", lambda e: e.deregister_mem("1")),
    ("deregister_mem-float", lambda e: e.deregister_mem(1.0)),
    ("deregister_mem-None", lambda e: e.deregister_mem(None)),
    ("get_transfer_status-None", lambda e: e.get_transfer_status(None)),
    ("get_transfer_status-str", lambda e: e.get_transfer_status("1")),
    ("connect-float-timeout", lambda e: e.connect(NOBODY, 1000.0)),
    ("connect-None-timeout", lambda e: e.connect(NOBODY, None)),
    ("disconnect-str-timeout", lambda e: e.disconnect(NOBODY, "1000")),
    ("transfer_sync-str-timeout", lambda e: e.transfer_sync(NOBODY, H.READ, _descs(), "1000")),
    ("send_notify-float-timeout", lambda e: e.send_notify(NOBODY, H.NotifyDesc("n", "m"), 1.5)),
    # negative ints for unsigned fields
    ("MemDesc-negative-addr", lambda e: H.MemDesc(-1, 8)),
    ("MemDesc-negative-len", lambda e: H.MemDesc(4096, -8)),
    ("TransferOpDesc-negative-local", lambda e: H.TransferOpDesc(-1, 2, 3)),
    ("TransferOpDesc-negative-remote", lambda e: H.TransferOpDesc(1, -2, 3)),
    ("TransferOpDesc-negative-len", lambda e: H.TransferOpDesc(1, 2, -3)),
    ("GetTransferStatusArgs-negative", lambda e: H.GetTransferStatusArgs(-1)),
    ("deregister_mem-negative", lambda e: e.deregister_mem(-1)),
    ("get_transfer_status-negative", lambda e: e.get_transfer_status(-1)),
    # ints too large
    ("MemDesc-addr-2**64", lambda e: H.MemDesc(2**64, 8)),
    ("MemDesc-len-2**64", lambda e: H.MemDesc(4096, 2**64)),
    ("TransferOpDesc-remote-2**64", lambda e: H.TransferOpDesc(1, 2**64, 3)),
    ("GetTransferStatusArgs-2**32", lambda e: H.GetTransferStatusArgs(2**32)),
    ("deregister_mem-2**64", lambda e: e.deregister_mem(2**64)),
    ("connect-timeout-2**31", lambda e: e.connect(NOBODY, 2**31)),
    ("transfer_sync-timeout-2**31", lambda e: e.transfer_sync(NOBODY, H.READ, _descs(), 2**31)),
    ("send_notify-timeout-2**31", lambda e: e.send_notify(NOBODY, H.NotifyDesc("n", "m"), 2**31)),
    # a plain int where an enum is expected
    ("transfer_sync-int-op", lambda e: e.transfer_sync(NOBODY, 0, _descs())),
    ("transfer_async-int-op", lambda e: e.transfer_async(NOBODY, 1, _descs())),
    ("register_mem-int-type", lambda e: e.register_mem(H.MemDesc(4096, 8), 1)),
    ("get_capability-int", lambda e: H.get_capability(0)),
    # tuples, dicts or bare descriptors instead of a list of TransferOpDesc
    ("op_descs-tuple-item", lambda e: e.transfer_sync(NOBODY, H.READ, [(0x10000, 0x20000, 8)])),
    ("op_descs-dict-item", lambda e: e.transfer_sync(
        NOBODY, H.READ, [{"local_addr": 0x10000, "remote_addr": 0x20000, "len": 8}])),
    ("op_descs-bare-desc", lambda e: e.transfer_sync(NOBODY, H.READ, _descs()[0])),
    ("op_descs-None", lambda e: e.transfer_sync(NOBODY, H.READ, None)),
    ("transfer_async-op_descs-None", lambda e: e.transfer_async(NOBODY, H.READ, None)),
    ("transfer_async-tuple-item", lambda e: e.transfer_async(NOBODY, H.WRITE, [(0x10000, 0x20000, 8)])),
    ("register_mem-tuple-desc", lambda e: e.register_mem((4096, 8), H.MEM_HOST)),
    # remote_engine / local_engine None or int
    ("connect-None-remote", lambda e: e.connect(None)),
    ("connect-int-remote", lambda e: e.connect(5)),
    ("disconnect-None-remote", lambda e: e.disconnect(None)),
    ("connect_async-int-remote", lambda e: e.connect_async(5)),
    ("disconnect_async-None-remote", lambda e: e.disconnect_async(None)),
    ("get_async_connect_status-int-remote", lambda e: e.get_async_connect_status(5)),
    ("transfer_sync-None-remote", lambda e: e.transfer_sync(None, H.READ, _descs())),
    ("transfer_async-int-remote", lambda e: e.transfer_async(7, H.READ, _descs())),
    ("send_notify-None-remote", lambda e: e.send_notify(None, H.NotifyDesc("n", "m"))),
    ("initialize-None-local", lambda e: H.Hixl().initialize(None)),
    ("initialize-int-local", lambda e: H.Hixl().initialize(5)),
    # options None, or with non-str keys or values
    ("initialize-None-options", lambda e: H.Hixl().initialize("127.0.0.1:0", None)),
    ("initialize-int-option-value", lambda e: H.Hixl().initialize("127.0.0.1:0", {"AutoConnect": 1})),
    ("initialize-int-option-key", lambda e: H.Hixl().initialize("127.0.0.1:0", {1: "1"})),
    # NotifyDesc fields and the notify argument
    ("NotifyDesc-int-name", lambda e: H.NotifyDesc(1, "m")),
    ("NotifyDesc-None-msg", lambda e: H.NotifyDesc("n", None)),
    ("send_notify-str-notify", lambda e: e.send_notify(NOBODY, "hello")),
    # a wrong keyword name
    ("connect-timeout-keyword", lambda e: e.connect(NOBODY, timeout=1000)),
    ("transfer_sync-timeout-keyword", lambda e: e.transfer_sync(NOBODY, H.READ, _descs(), timeout=1000)),
    ("send_notify-timeout-keyword", lambda e: e.send_notify(NOBODY, H.NotifyDesc("n", "m"), timeout=1000)),
    ("Hixl-an-argument", lambda e: H.Hixl("127.0.0.1:0")),
]


@pytest.mark.parametrize("call", [c for _, c in TYPE_ERRORS], ids=[i for i, _ in TYPE_ERRORS])
def test_type_mistakes_raise_type_error(engine: Any, call: Callable[[Any], object]) -> None:
    with pytest.raises(TypeError):
        call(engine)
    # and the engine is unharmed
    assert engine.get_notifies() == (hixl.SUCCESS, [])


def test_lenient_conversions(engine: Any) -> None:
    """bool and numpy integers for ints, numbers for skip_waiting, bytes for strings, a tuple of
    descriptors: accepted, as pybind11 accepts them (spec section 6)."""
    d = H.MemDesc(True, np.uint64(8))
    assert (d.addr, d.len) == (1, 8)
    t = H.TransferOpDesc(np.uint32(1), np.int64(2), np.uint16(3))
    assert (t.local_addr, t.remote_addr, t.len) == (1, 2, 3)
    assert bool(H.GetTransferStatusArgs(np.uint32(5), 1).skip_waiting) is True
    assert engine.get_async_connect_status(b"127.0.0.1:1") == (hixl.SUCCESS, hixl.AsyncConnectStatus.NOT_CONNECT)
    assert engine.transfer_sync(NOBODY, hixl.READ, tuple(_descs())) == hixl.NOT_CONNECTED


# ============================================================================ single process: lifecycle


def _register_one(e: Any, keep: list[np.ndarray]) -> int:
    buf = np.zeros(4096, np.uint8)
    keep.append(buf)
    ret, handle = e.register_mem(hixl.MemDesc(buf.ctypes.data, buf.size), hixl.MEM_HOST)
    assert (ret, handle != 0) == (hixl.SUCCESS, True)
    return int(handle)


def _unusable_calls(e: Any, handle: int, addr: int) -> list[tuple[str, object, object]]:
    """Every method but initialize and finalize, with what an engine that is not initialized (or is
    finalized) returns for it: FAILED with the empty companions (spec section 7)."""
    F = hixl.FAILED
    notify = hixl.NotifyDesc("n", "m")
    return [
        ("register_mem", e.register_mem(hixl.MemDesc(addr, 64), hixl.MEM_HOST), (F, 0)),
        ("deregister_mem", e.deregister_mem(handle), F),
        ("connect", e.connect(NOBODY, 1000), F),
        ("disconnect", e.disconnect(NOBODY, 1000), F),
        ("connect_async", e.connect_async(NOBODY, 1000), F),
        ("disconnect_async", e.disconnect_async(NOBODY, 1000), F),
        ("get_async_connect_status", e.get_async_connect_status(NOBODY), (F, hixl.AsyncConnectStatus.NOT_CONNECT)),
        ("get_all_async_connect_status", e.get_all_async_connect_status(), (F, {})),
        ("transfer_sync", e.transfer_sync(NOBODY, hixl.READ, _descs(), 1000), F),
        ("transfer_async", e.transfer_async(NOBODY, hixl.WRITE, _descs()), (F, 0)),
        ("transfer_async-args", e.transfer_async(NOBODY, hixl.WRITE, _descs(), hixl.TransferArgs()), (F, 0)),
        ("get_transfer_status", e.get_transfer_status(1), (F, hixl.TransferStatus.FAILED)),
        ("get_transfer_status-0", e.get_transfer_status(0), (F, hixl.TransferStatus.FAILED)),
        ("get_all_transfer_status", e.get_all_transfer_status(), (F, [])),
        ("get_all_transfer_status-args", e.get_all_transfer_status(hixl.GetTransferStatusArgs()), (F, [])),
        ("send_notify", e.send_notify(NOBODY, notify, 1000), F),
        ("get_notifies", e.get_notifies(), (F, [])),
    ]


def _assert_unusable(e: Any, handle: int, addr: int) -> None:
    wrong = [(name, got, want) for name, got, want in _unusable_calls(e, handle, addr)
             if got != want or type(got) is not type(want)]
    assert not wrong, wrong


def test_after_finalize_everything_is_failed_with_empty_companions() -> None:
    keep: list[np.ndarray] = []
    e: Any = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", dict(AUTO)) == hixl.SUCCESS
    handle = _register_one(e, keep)
    assert e.finalize() is None
    assert e.finalize() is None  # idempotent
    spare = np.zeros(64, np.uint8)
    _assert_unusable(e, handle, spare.ctypes.data)


def test_before_initialize_everything_is_failed_with_empty_companions() -> None:
    e: Any = hixl.Hixl()
    spare = np.zeros(64, np.uint8)
    _assert_unusable(e, 12345, spare.ctypes.data)
    assert e.finalize() is None  # finalize of an engine never initialized: nothing to do


def test_initialize_twice_is_success_and_a_failed_initialize_can_be_retried() -> None:
    e: Any = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", {"NoSuchOption": "1"}) == hixl.PARAM_INVALID
    assert e.get_notifies() == (hixl.FAILED, [])  # still not initialized
    assert e.initialize("127.0.0.1:0", dict(AUTO)) == hixl.SUCCESS
    assert e.initialize("127.0.0.1:0", dict(AUTO)) == hixl.SUCCESS
    assert e.initialize("127.0.0.1:0") == hixl.SUCCESS
    assert e.get_notifies() == (hixl.SUCCESS, [])
    assert e.finalize() is None


def test_fresh_engine_answers() -> None:
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", dict(AUTO)) == hixl.SUCCESS
    try:
        assert e.get_notifies() == (hixl.SUCCESS, [])
        assert e.get_all_transfer_status() == (hixl.SUCCESS, [])
        assert e.get_all_transfer_status(hixl.GetTransferStatusArgs(max_query_count=0)) == (hixl.SUCCESS, [])
        assert e.get_all_async_connect_status() == (hixl.SUCCESS, {})
        assert e.get_async_connect_status(NOBODY) == (hixl.SUCCESS, hixl.AsyncConnectStatus.NOT_CONNECT)
        assert e.get_transfer_status(0) == (hixl.FAILED, hixl.TransferStatus.FAILED)
        assert e.get_transfer_status(123456) == (hixl.PARAM_INVALID, hixl.TransferStatus.FAILED)
    finally:
        e.finalize()


def test_the_destructor_finalizes() -> None:
    """An engine dropped while initialized is finalized: its listen port is free again."""
    e = hixl.Hixl()
    engine_id = ""
    for _ in range(20):
        engine_id = f"127.0.0.1:{free_port()}"
        if e.initialize(engine_id, {}) == hixl.SUCCESS:
            break
    assert e.get_notifies() == (hixl.SUCCESS, [])
    del e
    gc.collect()
    again = hixl.Hixl()
    try:
        assert again.initialize(engine_id, {}) == hixl.SUCCESS
    finally:
        again.finalize()


# ============================================================================ single process: options


def _gr(fields: dict[str, Any]) -> str:
    return json.dumps(fields)


WATERLINES = {"channel_pool.high_waterline": 0.8, "channel_pool.low_waterline": 0.2}
OPTION_CASES: list[tuple[str, dict[str, str], int]] = [
    ("none", {}, hixl.SUCCESS),
    # AutoConnect
    ("AutoConnect-0", {"AutoConnect": "0"}, hixl.SUCCESS),
    ("AutoConnect-1", {"AutoConnect": "1"}, hixl.SUCCESS),
    ("AutoConnect-empty", {"AutoConnect": ""}, hixl.PARAM_INVALID),
    ("AutoConnect-x", {"AutoConnect": "x"}, hixl.PARAM_INVALID),
    ("AutoConnect-2", {"AutoConnect": "2"}, hixl.PARAM_INVALID),
    ("AutoConnect--1", {"AutoConnect": "-1"}, hixl.PARAM_INVALID),
    # BufferPool (and its adxl. spelling): N:M, or 0:0
    ("BufferPool-0:0", {"BufferPool": "0:0"}, hixl.SUCCESS),
    ("BufferPool-4:8", {"BufferPool": "4:8"}, hixl.SUCCESS),
    ("adxl.BufferPool-0:0", {"adxl.BufferPool": "0:0"}, hixl.SUCCESS),
    ("BufferPool-4", {"BufferPool": "4"}, hixl.PARAM_INVALID),
    ("BufferPool-4:", {"BufferPool": "4:"}, hixl.PARAM_INVALID),
    ("BufferPool-0:8", {"BufferPool": "0:8"}, hixl.PARAM_INVALID),
    ("BufferPool-4:0", {"BufferPool": "4:0"}, hixl.PARAM_INVALID),
    ("BufferPool-a:b", {"BufferPool": "a:b"}, hixl.PARAM_INVALID),
    ("BufferPool-4:8:1", {"BufferPool": "4:8:1"}, hixl.PARAM_INVALID),
    ("BufferPool-overflow", {"BufferPool": "99999999999999999999:8"}, hixl.PARAM_INVALID),
    ("adxl.BufferPool-x", {"adxl.BufferPool": "x"}, hixl.PARAM_INVALID),
    # EnableUseFabricMem
    ("EnableUseFabricMem-0", {"EnableUseFabricMem": "0"}, hixl.SUCCESS),
    ("EnableUseFabricMem-1", {"EnableUseFabricMem": "1"}, hixl.UNSUPPORTED),
    ("EnableUseFabricMem-2", {"EnableUseFabricMem": "2"}, hixl.PARAM_INVALID),
    ("EnableUseFabricMem-empty", {"EnableUseFabricMem": ""}, hixl.PARAM_INVALID),
    # RdmaTrafficClass: [0, 255], a multiple of 4
    ("RdmaTrafficClass-0", {"RdmaTrafficClass": "0"}, hixl.SUCCESS),
    ("RdmaTrafficClass-132", {"RdmaTrafficClass": "132"}, hixl.SUCCESS),
    ("RdmaTrafficClass-252", {"RdmaTrafficClass": "252"}, hixl.SUCCESS),
    ("adxl.RdmaTrafficClass-4", {"adxl.RdmaTrafficClass": "4"}, hixl.SUCCESS),
    ("RdmaTrafficClass-256", {"RdmaTrafficClass": "256"}, hixl.PARAM_INVALID),
    ("RdmaTrafficClass-255", {"RdmaTrafficClass": "255"}, hixl.PARAM_INVALID),
    ("RdmaTrafficClass-3", {"RdmaTrafficClass": "3"}, hixl.PARAM_INVALID),
    ("RdmaTrafficClass--4", {"RdmaTrafficClass": "-4"}, hixl.PARAM_INVALID),
    ("RdmaTrafficClass-x", {"RdmaTrafficClass": "x"}, hixl.PARAM_INVALID),
    ("adxl.RdmaTrafficClass-2", {"adxl.RdmaTrafficClass": "2"}, hixl.PARAM_INVALID),
    # RdmaServiceLevel: [0, 7]
    ("RdmaServiceLevel-0", {"RdmaServiceLevel": "0"}, hixl.SUCCESS),
    ("RdmaServiceLevel-7", {"RdmaServiceLevel": "7"}, hixl.SUCCESS),
    ("adxl.RdmaServiceLevel-4", {"adxl.RdmaServiceLevel": "4"}, hixl.SUCCESS),
    ("RdmaServiceLevel-8", {"RdmaServiceLevel": "8"}, hixl.PARAM_INVALID),
    ("RdmaServiceLevel--1", {"RdmaServiceLevel": "-1"}, hixl.PARAM_INVALID),
    ("RdmaServiceLevel-x", {"RdmaServiceLevel": "x"}, hixl.PARAM_INVALID),
    ("adxl.RdmaServiceLevel-9", {"adxl.RdmaServiceLevel": "9"}, hixl.PARAM_INVALID),
    # LocalCommRes: JSON (contents ignored), empty = auto-generate
    ("LocalCommRes-empty", {"LocalCommRes": ""}, hixl.SUCCESS),
    ("LocalCommRes-1.3", {"LocalCommRes": json.dumps({"version": "1.3"})}, hixl.SUCCESS),
    ("LocalCommRes-rank-table-1.2", {"LocalCommRes": rank_table("1.2")}, hixl.SUCCESS),
    ("adxl.LocalCommRes-1.0", {"adxl.LocalCommRes": rank_table("1.0", super_pod=False)}, hixl.SUCCESS),
    ("LocalCommRes-not-json", {"LocalCommRes": "{not json"}, hixl.PARAM_INVALID),
    ("adxl.LocalCommRes-not-json", {"adxl.LocalCommRes": "rank table"}, hixl.PARAM_INVALID),
    # GlobalResourceConfig: a JSON object whose fields are in range
    ("GRC-empty-object", {"GlobalResourceConfig": "{}"}, hixl.SUCCESS),
    ("GRC-protocol-list", {"GlobalResourceConfig": _gr({"comm_resource_config.protocol_desc": ["roce:device"]})},
     hixl.SUCCESS),
    ("GRC-protocol-str", {"GlobalResourceConfig": _gr({"comm_resource_config.protocol_desc": "hccs:device"})},
     hixl.SUCCESS),
    ("GRC-thread_num-1", {"GlobalResourceConfig": _gr({"connect_pool.thread_num": 1})}, hixl.SUCCESS),
    ("GRC-thread_num-64", {"GlobalResourceConfig": _gr({"connect_pool.thread_num": 64})}, hixl.SUCCESS),
    ("GRC-thread_num-str-4", {"GlobalResourceConfig": _gr({"connect_pool.thread_num": "4"})}, hixl.SUCCESS),
    ("GRC-queue-1", {"GlobalResourceConfig": _gr({"connect_pool.task_queue_capacity": 1})}, hixl.SUCCESS),
    ("GRC-queue-65535", {"GlobalResourceConfig": _gr({"connect_pool.task_queue_capacity": 65535})}, hixl.SUCCESS),
    ("GRC-channel-pool", {"GlobalResourceConfig": _gr({"channel_pool.max_channel": 512, **WATERLINES})},
     hixl.SUCCESS),
    ("GRC-listen_port-16666", {"GlobalResourceConfig": _gr({"comm_resource_config.listen_port": 16666})},
     hixl.SUCCESS),
    ("GRC-listen_port-65535", {"GlobalResourceConfig": _gr({"comm_resource_config.listen_port": 65535})},
     hixl.SUCCESS),
    ("GRC-qos-7", {"GlobalResourceConfig": _gr({"comm_resource_config.qos": 7})}, hixl.SUCCESS),
    ("GRC-max_active-8192", {"GlobalResourceConfig": _gr({"comm_resource_config.max_active_channels": 8192})},
     hixl.SUCCESS),
    ("GRC-fabric", {"GlobalResourceConfig": _gr({"fabric_memory.max_capacity": 32, "fabric_memory.start_address": 40,
                                                 "fabric_memory.task_stream_num": 8,
                                                 "fabric_memory.enable_aicpu_unfold": True})}, hixl.SUCCESS),
    ("GRC-not-json", {"GlobalResourceConfig": "not json"}, hixl.PARAM_INVALID),
    ("GRC-array", {"GlobalResourceConfig": "[1, 2]"}, hixl.PARAM_INVALID),
    ("GRC-string", {"GlobalResourceConfig": '"x"'}, hixl.PARAM_INVALID),
    ("GRC-number", {"GlobalResourceConfig": "1"}, hixl.PARAM_INVALID),
    ("GRC-thread_num-0", {"GlobalResourceConfig": _gr({"connect_pool.thread_num": 0})}, hixl.PARAM_INVALID),
    ("GRC-thread_num-65", {"GlobalResourceConfig": _gr({"connect_pool.thread_num": 65})}, hixl.PARAM_INVALID),
    ("GRC-thread_num-x", {"GlobalResourceConfig": _gr({"connect_pool.thread_num": "x"})}, hixl.PARAM_INVALID),
    ("GRC-queue-0", {"GlobalResourceConfig": _gr({"connect_pool.task_queue_capacity": 0})}, hixl.PARAM_INVALID),
    ("GRC-queue-65536", {"GlobalResourceConfig": _gr({"connect_pool.task_queue_capacity": 65536})},
     hixl.PARAM_INVALID),
    ("GRC-max_channel-alone", {"GlobalResourceConfig": _gr({"channel_pool.max_channel": 512})}, hixl.PARAM_INVALID),
    ("GRC-max_channel-0", {"GlobalResourceConfig": _gr({"channel_pool.max_channel": 0, **WATERLINES})},
     hixl.PARAM_INVALID),
    ("GRC-max_channel-513", {"GlobalResourceConfig": _gr({"channel_pool.max_channel": 513, **WATERLINES})},
     hixl.PARAM_INVALID),
    ("GRC-one-waterline", {"GlobalResourceConfig": _gr({"channel_pool.max_channel": 512,
                                                        "channel_pool.high_waterline": 0.8})}, hixl.PARAM_INVALID),
    ("GRC-low-not-below-high", {"GlobalResourceConfig": _gr({"channel_pool.max_channel": 512,
                                                             "channel_pool.high_waterline": 0.5,
                                                             "channel_pool.low_waterline": 0.5})},
     hixl.PARAM_INVALID),
    ("GRC-waterline-1", {"GlobalResourceConfig": _gr({"channel_pool.max_channel": 512,
                                                      "channel_pool.high_waterline": 1.0,
                                                      "channel_pool.low_waterline": 0.2})}, hixl.PARAM_INVALID),
    ("GRC-waterline-0", {"GlobalResourceConfig": _gr({"channel_pool.max_channel": 512,
                                                      "channel_pool.high_waterline": 0.8,
                                                      "channel_pool.low_waterline": 0.0})}, hixl.PARAM_INVALID),
    ("GRC-marks-equal", {"GlobalResourceConfig": _gr({"channel_pool.max_channel": 2,
                                                      "channel_pool.high_waterline": 0.6,
                                                      "channel_pool.low_waterline": 0.5})}, hixl.PARAM_INVALID),
    ("GRC-listen_port-0", {"GlobalResourceConfig": _gr({"comm_resource_config.listen_port": 0})}, hixl.PARAM_INVALID),
    ("GRC-listen_port-65536", {"GlobalResourceConfig": _gr({"comm_resource_config.listen_port": 65536})},
     hixl.PARAM_INVALID),
    ("GRC-qos-8", {"GlobalResourceConfig": _gr({"comm_resource_config.qos": 8})}, hixl.PARAM_INVALID),
    ("GRC-max_active-0", {"GlobalResourceConfig": _gr({"comm_resource_config.max_active_channels": 0})},
     hixl.PARAM_INVALID),
    ("GRC-task_stream_num-9", {"GlobalResourceConfig": _gr({"fabric_memory.task_stream_num": 9})},
     hixl.PARAM_INVALID),
    ("GRC-max_capacity-0", {"GlobalResourceConfig": _gr({"fabric_memory.max_capacity": 0})}, hixl.PARAM_INVALID),
    ("GRC-local_comm_res_path-empty", {"GlobalResourceConfig": _gr({"local_comm_res_path": ""})}, hixl.PARAM_INVALID),
    ("GRC-local_comm_res_path-missing", {"GlobalResourceConfig": _gr({"local_comm_res_path": "/nonexistent/x.json"})},
     hixl.PARAM_INVALID),
    # unknown keys
    ("unknown-key", {"NoSuchOption": "1"}, hixl.PARAM_INVALID),
    ("unknown-case", {"autoconnect": "1"}, hixl.PARAM_INVALID),
    ("unknown-adxl-spelling", {"adxl.GlobalResourceConfig": "{}"}, hixl.PARAM_INVALID),
    ("unknown-beside-good", {"AutoConnect": "1", "Bogus": "x"}, hixl.PARAM_INVALID),
    # all of them at once, as a caller configured for A2/A3 passes them
    ("everything", {"AutoConnect": "1", "BufferPool": "4:8", "EnableUseFabricMem": "0", "RdmaTrafficClass": "132",
                    "RdmaServiceLevel": "4", "LocalCommRes": json.dumps({"version": "1.3"}),
                    "GlobalResourceConfig": _gr({"connect_pool.thread_num": 2,
                                                 "comm_resource_config.protocol_desc": ["roce:device"]})},
     hixl.SUCCESS),
]


@pytest.mark.parametrize("options, expected", [(o, x) for _, o, x in OPTION_CASES], ids=[i for i, _, _ in OPTION_CASES])
def test_initialize_options(options: dict[str, str], expected: int) -> None:
    e = hixl.Hixl()
    try:
        assert e.initialize("127.0.0.1:0", dict(options)) == expected
        # initialized exactly when it succeeded
        assert e.get_notifies() == ((hixl.SUCCESS if expected == hixl.SUCCESS else hixl.FAILED), [])
    finally:
        e.finalize()


@pytest.mark.parametrize("content, expected", [
    (rank_table("1.2"), hixl.SUCCESS), ("", hixl.PARAM_INVALID), ("x" * ((1 << 20) + 1), hixl.PARAM_INVALID)],
    ids=["a-rank-table", "empty-file", "over-1MiB"])
def test_local_comm_res_path(tmp_path: Any, content: str, expected: int) -> None:
    path = os.path.join(str(tmp_path), "comm_res.json")
    with open(path, "w") as f:
        f.write(content)
    e = hixl.Hixl()
    try:
        assert e.initialize("127.0.0.1:0", {"GlobalResourceConfig": _gr({"local_comm_res_path": path})}) == expected
    finally:
        e.finalize()


def test_local_comm_res_path_must_be_a_regular_file(tmp_path: Any) -> None:
    e = hixl.Hixl()
    try:
        assert e.initialize("127.0.0.1:0", {"GlobalResourceConfig": _gr({"local_comm_res_path": str(tmp_path)})}) == \
            hixl.PARAM_INVALID
    finally:
        e.finalize()


@pytest.mark.parametrize("local_engine, expected", [
    ("127.0.0.1:0", hixl.SUCCESS), ("127.0.0.1", hixl.SUCCESS),
    ("localhost:0", hixl.PARAM_INVALID), ("localhost", hixl.PARAM_INVALID), ("127.0.0.1:abc", hixl.PARAM_INVALID),
    ("999.1.1.1:0", hixl.PARAM_INVALID), ("::1", hixl.PARAM_INVALID), ("", hixl.PARAM_INVALID)])
def test_engine_strings(local_engine: str, expected: int) -> None:
    e = hixl.Hixl()
    try:
        assert e.initialize(local_engine, {}) == expected
    finally:
        e.finalize()


# ============================================================================ single process: capability


def test_get_capability_of_the_known_features() -> None:
    # a module function: no engine, no initialize
    assert hixl.get_capability(hixl.FeatureType.AUTO_CONNECT) == (hixl.SUCCESS, hixl.FEATURE_SUPPORTED)
    assert hixl.get_capability(hixl.CLIENT_SERVER_COMM) == (hixl.SUCCESS, hixl.FEATURE_SUPPORTED)


def test_get_capability_of_an_unknown_feature() -> None:
    assert H.get_capability(H.FeatureType(7)) == (hixl.SUCCESS, hixl.FEATURE_NOT_SUPPORTED)


def test_get_capability_of_a_negative_feature() -> None:
    assert H.get_capability(H.FeatureType(-1)) == (hixl.PARAM_INVALID, 0)


# ============================================================================ single process: registration


def _buffer(keep: list[np.ndarray], nbytes: int) -> int:
    """``nbytes`` of zeros, 64-byte aligned, with at least 64 bytes of the same allocation each side."""
    buf = np.zeros(nbytes + 256, np.uint8)
    keep.append(buf)
    return (int(buf.ctypes.data) + 63) // 64 * 64 + 64


def test_registration_rules(engine: Any) -> None:
    keep: list[np.ndarray] = []
    a, b = _buffer(keep, 8192), _buffer(keep, 8192)
    ret, h = engine.register_mem(hixl.MemDesc(a, 8192), hixl.MEM_HOST)
    assert ret == hixl.SUCCESS
    assert type(h) is int and h != 0
    # the same (addr, len) again: the same handle
    assert engine.register_mem(hixl.MemDesc(a, 8192), hixl.MEM_HOST) == (hixl.SUCCESS, h)
    # a partial overlap of the same type, a sub-range, a super-range: refused
    assert engine.register_mem(hixl.MemDesc(a + 4096, 8192), hixl.MEM_HOST) == (hixl.PARAM_INVALID, 0)
    assert engine.register_mem(hixl.MemDesc(a + 64, 64), hixl.MEM_HOST) == (hixl.PARAM_INVALID, 0)
    assert engine.register_mem(hixl.MemDesc(a - 64, 8192 + 128), hixl.MEM_HOST) == (hixl.PARAM_INVALID, 0)
    # another buffer as MEM_DEVICE (host memory on the CPU backend): its own handle
    ret, hd = engine.register_mem(hixl.MemDesc(b, 8192), hixl.MEM_DEVICE)
    assert ret == hixl.SUCCESS
    assert hd not in (0, h)
    assert engine.register_mem(hixl.MemDesc(b, 8192), hixl.MEM_DEVICE) == (hixl.SUCCESS, hd)
    assert engine.register_mem(hixl.MemDesc(b + 8, 16), hixl.MEM_DEVICE) == (hixl.PARAM_INVALID, 0)
    # length 0, address 0, a range past the end of the address space
    assert engine.register_mem(hixl.MemDesc(a, 0), hixl.MEM_HOST) == (hixl.PARAM_INVALID, 0)
    assert engine.register_mem(hixl.MemDesc(0, 4096), hixl.MEM_HOST) == (hixl.PARAM_INVALID, 0)
    assert engine.register_mem(hixl.MemDesc(2**64 - 4096, 8192), hixl.MEM_HOST) == (hixl.PARAM_INVALID, 0)
    # deregister: 0 is invalid; a valid handle, then the same again, then one never returned: SUCCESS
    assert engine.deregister_mem(0) == hixl.PARAM_INVALID
    assert engine.deregister_mem(h) == hixl.SUCCESS
    assert engine.deregister_mem(h) == hixl.SUCCESS
    assert engine.deregister_mem(0xDEAD0000) == hixl.SUCCESS
    # released: the overlapping range registers now
    ret, h2 = engine.register_mem(hixl.MemDesc(a + 4096, 4096), hixl.MEM_HOST)
    assert ret == hixl.SUCCESS
    assert h2 != 0
    assert engine.deregister_mem(h2) == hixl.SUCCESS
    assert engine.deregister_mem(hd) == hixl.SUCCESS


def test_adjacent_ranges_register_separately(engine: Any) -> None:
    keep: list[np.ndarray] = []
    a = _buffer(keep, 8192)
    r1, h1 = engine.register_mem(hixl.MemDesc(a, 4096), hixl.MEM_HOST)
    r2, h2 = engine.register_mem(hixl.MemDesc(a + 4096, 4096), hixl.MEM_HOST)
    assert (r1, r2) == (hixl.SUCCESS, hixl.SUCCESS)
    assert 0 not in (h1, h2) and h1 != h2
    assert engine.register_mem(hixl.MemDesc(a + 4000, 200), hixl.MEM_HOST) == (hixl.PARAM_INVALID, 0)
    assert (engine.deregister_mem(h1), engine.deregister_mem(h2)) == (hixl.SUCCESS, hixl.SUCCESS)


# ============================================================================ single process: codes without a link


def test_codes_without_a_link(engine: Any) -> None:
    keep: list[np.ndarray] = []
    a = _buffer(keep, 4096)
    ret, h = engine.register_mem(hixl.MemDesc(a, 4096), hixl.MEM_HOST)
    assert ret == hixl.SUCCESS
    good = [hixl.TransferOpDesc(a, 0x7000_0000, 64)]
    # no link: NOT_CONNECTED (req 0)
    assert engine.transfer_sync(NOBODY, hixl.READ, good, 1000) == hixl.NOT_CONNECTED
    assert engine.transfer_sync(NOBODY, hixl.WRITE, good) == hixl.NOT_CONNECTED
    assert engine.transfer_async(NOBODY, hixl.READ, good) == (hixl.NOT_CONNECTED, 0)
    assert engine.transfer_async(NOBODY, hixl.WRITE, good, hixl.TransferArgs()) == (hixl.NOT_CONNECTED, 0)
    assert engine.transfer_sync(NOBODY, hixl.READ, [], 1000) == hixl.NOT_CONNECTED  # the link is checked first (cs)
    # checked before the link: the timeout, then null addresses
    assert engine.transfer_sync(NOBODY, hixl.READ, good, 0) == hixl.PARAM_INVALID
    assert engine.transfer_sync(NOBODY, hixl.READ, good, -1) == hixl.PARAM_INVALID
    assert engine.transfer_sync(NOBODY, hixl.READ, [hixl.TransferOpDesc(0, 0x7000_0000, 64)]) == hixl.PARAM_INVALID
    assert engine.transfer_sync(NOBODY, hixl.WRITE, [hixl.TransferOpDesc(a, 0, 64)]) == hixl.PARAM_INVALID
    assert engine.transfer_async(NOBODY, hixl.READ, [hixl.TransferOpDesc(a, 0, 64)]) == (hixl.PARAM_INVALID, 0)
    # connect / disconnect
    assert engine.connect(NOBODY, 0) == hixl.PARAM_INVALID
    assert engine.connect(NOBODY, -5) == hixl.PARAM_INVALID
    assert engine.disconnect(NOBODY, 0) == hixl.PARAM_INVALID
    assert engine.disconnect(NOBODY) == hixl.NOT_CONNECTED
    assert engine.disconnect(NOBODY, 1000) == hixl.NOT_CONNECTED
    assert engine.disconnect("not an engine", 1000) == hixl.PARAM_INVALID
    assert engine.connect_async(NOBODY, 0) == hixl.PARAM_INVALID
    assert engine.disconnect_async(NOBODY, -1) == hixl.PARAM_INVALID
    # notifications: lengths and the timeout before the link
    assert engine.send_notify(NOBODY, hixl.NotifyDesc("n", "m")) == hixl.NOT_CONNECTED
    assert engine.send_notify(NOBODY, hixl.NotifyDesc("n" * 1024, "m" * 1024), 1000) == hixl.NOT_CONNECTED
    assert engine.send_notify(NOBODY, hixl.NotifyDesc("n" * 1025, "m"), 1000) == hixl.PARAM_INVALID
    assert engine.send_notify(NOBODY, hixl.NotifyDesc("n", "m" * 1025), 1000) == hixl.PARAM_INVALID
    assert engine.send_notify(NOBODY, hixl.NotifyDesc("n", "m"), 0) == hixl.PARAM_INVALID
    assert engine.deregister_mem(h) == hixl.SUCCESS


def test_send_notify_does_not_auto_connect() -> None:
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", dict(AUTO)) == hixl.SUCCESS
    try:
        assert e.send_notify(NOBODY, hixl.NotifyDesc("n", "m"), 1000) == hixl.NOT_CONNECTED
    finally:
        e.finalize()


# ============================================================================ two processes: helpers


Triple = tuple[int, int, int]  # (source offset, destination offset, length) within two buffers


def on_device(variant: Variant, mem_type: str) -> bool:
    """Whether a buffer registered as ``mem_type`` is device memory: MEM_DEVICE on a backend with
    device memory (the Ascend variants: the fake ACL's DEVICE memory, which hixl registers as
    DEVICE and the variant's device path moves); host memory otherwise (MEM_HOST, and both types
    on the CPU backend)."""
    return mem_type == "MEM_DEVICE" and variant.device_memory


def alloc(side: Peer, variant: Variant, name: str, size: int, mem_type: str = "MEM_HOST",
          seed: int | None = None, fill: int | None = None) -> int:
    """``hixl_peer.alloc`` of memory fit to be registered as ``mem_type`` on ``variant``
    (``on_device``); returns its address."""
    return int(side.call(hixl_peer.alloc, name, size, seed=seed, fill=fill, device=on_device(variant, mem_type)))


class Two:
    """A listening server and a client (client-only unless ``client_listens``), each a peer
    process running tests/peers/hixl_peer.py; no memory, no link yet."""

    def __init__(self, peers: Callable[..., Peer], variant: Variant, server_options: dict[str, str] | None = None,
                 client_options: dict[str, str] | None = None, client_listens: bool = False):
        self.variant = variant
        self.server = peers("hixl-server", env=variant.env())
        self.client = peers("hixl-client", env=variant.env())
        self.server_id = self.server.call(hixl_peer.start, server_options or {})
        self.client_id = self.client.call(hixl_peer.start, client_options or {}, listen=client_listens)

    def buffers(self, size: int = 16384, mem_type: str = "MEM_HOST") -> tuple[int, int]:
        """Server buffer "src" (a seeded pattern) and client buffer "dst" (another pattern), both
        registered whole as ``mem_type`` (device memory for MEM_DEVICE on the Ascend variants:
        ``on_device``); returns their addresses."""
        src = alloc(self.server, self.variant, "src", size, mem_type, seed=1)
        dst = alloc(self.client, self.variant, "dst", size, mem_type, seed=2)
        assert self.server.call(hixl_peer.register, "src", mem_type)[0] == hixl.SUCCESS
        assert self.client.call(hixl_peer.register, "dst", mem_type)[0] == hixl.SUCCESS
        return src, dst


def check_moves(action: Callable[[], R], moves: Sequence[tuple[Peer, str, Peer, str, Sequence[Triple]]],
                untouched: Sequence[tuple[Peer, str]] = ()) -> R:
    """Snapshots every buffer named, runs ``action``, snapshots again: each destination must equal
    its old bytes with exactly the moved ranges replaced by its sources' old bytes (everything else
    and the guards unchanged); every other buffer named (sources, ``untouched``) must be unchanged.
    ``moves``: (source peer, buffer, destination peer, buffer, [(src offset, dst offset, len)])."""
    named: dict[tuple[int, str], tuple[Peer, str]] = {}
    for sp, sn, dp, dn, _ in moves:
        named[(id(sp), sn)] = (sp, sn)
        named[(id(dp), dn)] = (dp, dn)
    for p, n in untouched:
        named[(id(p), n)] = (p, n)
    before = {k: p.call(hixl_peer.snapshot, n) for k, (p, n) in named.items()}
    result = action()
    expected: dict[tuple[int, str], Snapshot] = dict(before)
    for sp, sn, dp, dn, triples in moves:
        expected[(id(dp), dn)] = expected[(id(dp), dn)].with_bytes(
            before[(id(sp), sn)], [Copy(0, s, 0, d, n) for s, d, n in triples])
    for k, (p, n) in named.items():
        assert_same(p.call(hixl_peer.snapshot, n), expected[k], f"{p.name}'s {n}")
    return result


def read_descs(dst: int, src: int, triples: Sequence[Triple]) -> list[Triple]:
    """READ descriptors (local = destination, remote = source) for (src offset, dst offset, len)."""
    return [(dst + d, src + s, n) for s, d, n in triples]


def write_descs(src: int, dst: int, triples: Sequence[Triple]) -> list[Triple]:
    """WRITE descriptors (local = source, remote = destination) for (src offset, dst offset, len)."""
    return [(src + s, dst + d, n) for s, d, n in triples]


# ============================================================================ two processes: flows


def test_official_example_reads_8_mib_in_512_blocks(peers: Callable[..., Peer], variant: Variant) -> None:
    """Spec 11.1: both engines have ports and the example's options; the server's 8 MiB of 0xAA,
    registered as MEM_DEVICE, is read by the client in 512 descriptors of 16 KiB with a 30 s
    timeout; every byte checked; then disconnect, deregister, finalize, every code SUCCESS."""
    size, block = 8 << 20, 16 << 10
    two = Two(peers, variant, EXAMPLE_OPTIONS, EXAMPLE_OPTIONS, client_listens=True)
    src = alloc(two.server, variant, "buf", size, "MEM_DEVICE", fill=0xAA)
    ret, server_handle = two.server.call(hixl_peer.register, "buf", "MEM_DEVICE")
    assert ret == hixl.SUCCESS
    dst = alloc(two.client, variant, "buf", size, "MEM_DEVICE")
    ret, client_handle = two.client.call(hixl_peer.register, "buf", "MEM_DEVICE")
    assert ret == hixl.SUCCESS
    assert two.client.call(hixl_peer.connect, two.server_id, 5000) == hixl.SUCCESS
    triples = [(i * block, i * block, block) for i in range(size // block)]
    assert len(triples) == 512
    code = check_moves(lambda: two.client.call_within(hang_guard(30000), hixl_peer.transfer_sync, two.server_id,
                                                      "READ", read_descs(dst, src, triples), 30000),
                       [(two.server, "buf", two.client, "buf", triples)])
    assert code == hixl.SUCCESS
    got = two.client.call(hixl_peer.snapshot, "buf")
    assert bool(np.all(got.tensor(0) == 0xAA))
    assert two.client.call(hixl_peer.disconnect, two.server_id, 5000) == hixl.SUCCESS
    assert two.client.call(hixl_peer.deregister, client_handle) == hixl.SUCCESS
    assert two.client.call(hixl_peer.finalize) is None
    assert two.server.call(hixl_peer.deregister, server_handle) == hixl.SUCCESS
    assert two.server.call(hixl_peer.finalize) is None


# unaligned, out of order, one byte, a whole block, the last bytes: (src offset, dst offset, len)
SCATTER = [(4096, 8192, 4096), (0, 12400, 100), (16383, 0, 1), (5000, 5001, 777), (12288, 16384 - 333, 333)]


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_descriptor_lists_move_exact_bytes(peers: Callable[..., Peer], variant: Variant, op: str) -> None:
    two = Two(peers, variant)
    src, dst = two.buffers()  # server "src", client "dst"
    # a second server buffer registered as MEM_DEVICE: a mixed batch
    dev = alloc(two.server, variant, "dev", 8192, "MEM_DEVICE", seed=3)
    assert two.server.call(hixl_peer.register, "dev", "MEM_DEVICE")[0] == hixl.SUCCESS
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    if op == "READ":  # server -> client
        descs = read_descs(dst, src, SCATTER) + [(dst + 13000, dev + 8000, 192)]
        moves = [(two.server, "src", two.client, "dst", SCATTER),
                 (two.server, "dev", two.client, "dst", [(8000, 13000, 192)])]
    else:  # client -> server
        descs = write_descs(dst, src, SCATTER) + [(dst + 100, dev + 7, 8185)]
        moves = [(two.client, "dst", two.server, "src", SCATTER),
                 (two.client, "dst", two.server, "dev", [(100, 7, 8185)])]
    code = check_moves(lambda: two.client.call(hixl_peer.transfer_sync, two.server_id, op, descs), moves)
    assert code == hixl.SUCCESS


def test_contiguous_registrations_count_as_one(peers: Callable[..., Peer], variant: Variant) -> None:
    """A descriptor across the boundary of two exactly adjacent registered regions, on either side."""
    two = Two(peers, variant)
    src = two.server.call(hixl_peer.alloc, "src", 16384, seed=1)
    dst = two.client.call(hixl_peer.alloc, "dst", 16384, seed=2)
    for side, name in ((two.server, "src"), (two.client, "dst")):
        assert side.call(hixl_peer.register, name, "MEM_HOST", 0, 8192)[0] == hixl.SUCCESS
        assert side.call(hixl_peer.register, name, "MEM_HOST", 8192, 8192)[0] == hixl.SUCCESS
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    triples = [(8000, 7000, 2000), (0, 16384 - 9000, 9000)]
    code = check_moves(lambda: two.client.call(hixl_peer.transfer_sync, two.server_id, "READ",
                                               read_descs(dst, src, triples)),
                       [(two.server, "src", two.client, "dst", triples)])
    assert code == hixl.SUCCESS


def test_ranges_outside_registered_memory_are_refused_and_nothing_moves(peers: Callable[..., Peer],
                                                                        variant: Variant) -> None:
    """hixl_cs validation: any local or remote range not inside registered memory, a zero length,
    a null address or an empty list is PARAM_INVALID, nothing is copied (not even the valid
    descriptors of the batch), and the link stays usable (AutoConnect off)."""
    two = Two(peers, variant)
    size = 16384
    src, dst = two.buffers(size)
    unreg = two.server.call(hixl_peer.alloc, "unreg", 4096, seed=5)  # never registered
    loose = two.client.call(hixl_peer.alloc, "loose", 4096, seed=6)  # never registered
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    everything = [(two.server, "src"), (two.server, "unreg"), (two.client, "dst"), (two.client, "loose")]
    ok = (dst, src, 64)
    cases: list[tuple[str, str, list[Triple]]] = [
        ("remote past the end", "READ", [(dst, src + size - 8, 16)]),
        ("remote before the start", "READ", [(dst, src - 1, 16)]),
        ("remote unregistered", "READ", [(dst, unreg, 64)]),
        ("remote longer than the region", "READ", [(dst, src, size + 1)]),
        ("local past the end", "READ", [(dst + size - 8, src, 16)]),
        ("local before the start", "READ", [(dst - 1, src, 16)]),
        ("local unregistered", "READ", [(loose, src, 64)]),
        ("zero length", "READ", [(dst, src, 0)]),
        ("null local", "READ", [(0, src, 16)]),
        ("null remote", "READ", [(dst, 0, 16)]),
        ("one bad in a batch", "READ", [ok, (dst + 4096, src + 4096, 4096), (dst + 8192, src + size - 1, 2)]),
        ("empty", "READ", []),
        ("write: remote past the end", "WRITE", [(dst, src + size - 8, 16)]),
        ("write: remote unregistered", "WRITE", [(dst, unreg, 64)]),
        ("write: local unregistered", "WRITE", [(loose, src, 64)]),
        ("write: one bad in a batch", "WRITE", [ok, (dst + 64, src + 64, 64), (dst + size, src + 128, 1)]),
    ]
    wrong: list[tuple[str, str, object]] = []  # every case is tried; bytes that moved fail at once
    for what, op, descs in cases:
        code = check_moves(functools.partial(two.client.call, hixl_peer.transfer_sync, two.server_id, op, descs),
                           [], untouched=everything)
        if code != hixl.PARAM_INVALID:
            wrong.append((what, "transfer_sync", code))
        # a request that is accepted after all is waited for before the snapshots
        ret, req, settled = check_moves(functools.partial(two.client.call, hixl_peer.transfer_async_settled,
                                                          two.server_id, op, descs), [], untouched=everything)
        if (ret, req) != (hixl.PARAM_INVALID, 0):
            wrong.append((what, "transfer_async", (ret, req, settled)))
    assert not wrong, "\n".join(map(repr, wrong))
    # a timeout <= 0 with a link: PARAM_INVALID, nothing moves
    code = check_moves(lambda: two.client.call(hixl_peer.transfer_sync, two.server_id, "READ", [ok], 0), [],
                       untouched=everything)
    assert code == hixl.PARAM_INVALID
    # the link survived every refusal
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.ALREADY_CONNECTED
    triples = [(100, 200, 300)]
    code = check_moves(lambda: two.client.call(hixl_peer.transfer_sync, two.server_id, "READ",
                                               read_descs(dst, src, triples)),
                       [(two.server, "src", two.client, "dst", triples)], untouched=everything)
    assert code == hixl.SUCCESS


def test_deregister_while_linked_is_allowed_and_the_range_is_then_refused(peers: Callable[..., Peer],
                                                                          variant: Variant) -> None:
    two = Two(peers, variant)
    src = two.server.call(hixl_peer.alloc, "src", 8192, seed=1)
    dst = two.client.call(hixl_peer.alloc, "dst", 8192, seed=2)
    _, server_handle = two.server.call(hixl_peer.register, "src")
    _, client_handle = two.client.call(hixl_peer.register, "dst")
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    assert two.client.call(hixl_peer.deregister, client_handle) == hixl.SUCCESS  # lenient: links exist
    code = check_moves(lambda: two.client.call(hixl_peer.transfer_sync, two.server_id, "READ", [(dst, src, 64)]),
                       [], untouched=[(two.server, "src"), (two.client, "dst")])
    assert code == hixl.PARAM_INVALID
    assert two.server.call(hixl_peer.deregister, server_handle) == hixl.SUCCESS  # a client is linked to it
    assert two.client.call(hixl_peer.disconnect, two.server_id) == hixl.SUCCESS


def test_links_are_one_way(peers: Callable[..., Peer], variant: Variant) -> None:
    """Only the connecting side transfers and notifies; the other side serves; the reverse link
    is a link of its own."""
    two = Two(peers, variant, client_listens=True)
    src, dst = two.buffers()
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    everything = [(two.server, "src"), (two.client, "dst")]
    code = check_moves(lambda: two.server.call(hixl_peer.transfer_sync, two.client_id, "WRITE", [(src, dst, 64)]),
                       [], untouched=everything)
    assert code == hixl.NOT_CONNECTED
    assert two.server.call(hixl_peer.transfer_async, two.client_id, "READ", [(src, dst, 64)]) == \
        (hixl.NOT_CONNECTED, 0)
    assert two.server.call(hixl_peer.send_notify, two.client_id, "n", "m") == hixl.NOT_CONNECTED
    assert two.client.call(hixl_peer.notifies) == (hixl.SUCCESS, [])
    # the reverse link: the server connects to the client and reads from it
    assert two.server.call(hixl_peer.connect, two.client_id) == hixl.SUCCESS
    triples = [(0, 500, 1000)]  # client "dst" offset 0 -> server "src" offset 500
    code = check_moves(lambda: two.server.call(hixl_peer.transfer_sync, two.client_id, "READ",
                                               [(src + 500, dst, 1000)]),
                       [(two.client, "dst", two.server, "src", triples)])
    assert code == hixl.SUCCESS
    assert two.server.call(hixl_peer.send_notify, two.client_id, "back", "hello") == hixl.SUCCESS
    assert two.client.call(hixl_peer.notifies) == (hixl.SUCCESS, [("back", "hello")])
    assert two.server.call(hixl_peer.notifies) == (hixl.SUCCESS, [])
    # each side's link goes on its own
    assert two.server.call(hixl_peer.disconnect, two.client_id) == hixl.SUCCESS
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.ALREADY_CONNECTED


def test_connect_and_disconnect_codes(peers: Callable[..., Peer], variant: Variant) -> None:
    two = Two(peers, variant)
    src, dst = two.buffers()
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.ALREADY_CONNECTED
    assert two.client.call(hixl_peer.connect, two.server_id, 0) == hixl.PARAM_INVALID  # before ALREADY_CONNECTED
    assert two.server.call(hixl_peer.connect, two.server_id) == hixl.PARAM_INVALID  # itself
    assert two.client.call(hixl_peer.disconnect, two.server_id) == hixl.SUCCESS
    assert two.client.call(hixl_peer.disconnect, two.server_id) == hixl.NOT_CONNECTED
    everything = [(two.server, "src"), (two.client, "dst")]
    code = check_moves(lambda: two.client.call(hixl_peer.transfer_sync, two.server_id, "READ", [(dst, src, 64)]),
                       [], untouched=everything)
    assert code == hixl.NOT_CONNECTED
    # connect again: a working link
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    code = check_moves(lambda: two.client.call(hixl_peer.transfer_sync, two.server_id, "READ", [(dst, src, 64)]),
                       [(two.server, "src", two.client, "dst", [(0, 0, 64)])])
    assert code == hixl.SUCCESS
    # nobody listening: an error, not a hang
    dead = f"127.0.0.1:{two.client.call(hixl_peer.free_port)}"
    code = two.client.call_within(hang_guard(1000), hixl_peer.connect, dead, 1000)
    assert code in (hixl.TIMEOUT, hixl.FAILED, hixl.NOT_CONNECTED)


@pytest.mark.parametrize("client_id", ["127.0.0.1:0", "127.0.0.1"])
def test_client_only_engines_connect_and_transfer(peers: Callable[..., Peer], variant: Variant, client_id: str) -> None:
    server, client = peers("hixl-server", env=variant.env()), peers("hixl-client", env=variant.env())
    server_id = server.call(hixl_peer.start, {})
    assert client.call(hixl_peer.start, {}, listen=False, client_id=client_id) == client_id
    src = server.call(hixl_peer.alloc, "src", 8192, seed=1)
    assert server.call(hixl_peer.register, "src")[0] == hixl.SUCCESS
    dst = client.call(hixl_peer.alloc, "dst", 8192, seed=2)
    assert client.call(hixl_peer.register, "dst")[0] == hixl.SUCCESS
    assert client.call(hixl_peer.connect, server_id) == hixl.SUCCESS
    triples = [(10, 4000, 4000)]
    code = check_moves(lambda: client.call(hixl_peer.transfer_sync, server_id, "READ", read_descs(dst, src, triples)),
                       [(server, "src", client, "dst", triples)])
    assert code == hixl.SUCCESS
    assert client.call(hixl_peer.send_notify, server_id, "from", client_id) == hixl.SUCCESS
    assert server.call(hixl_peer.notifies) == (hixl.SUCCESS, [("from", client_id)])


def test_async_connect_status_machine(peers: Callable[..., Peer], variant: Variant) -> None:
    two = Two(peers, variant)
    src, dst = two.buffers()
    assert two.client.call(hixl_peer.connect_async, two.server_id) == hixl.SUCCESS
    seen = two.client.call(hixl_peer.wait_async_status, two.server_id, ["CONNECTED", "CONNECT_FAILED"])
    assert seen[-1] == "CONNECTED"
    assert set(seen) <= {"CONNECT_PENDING", "CONNECTING", "CONNECTED"}, seen
    assert two.client.call(hixl_peer.all_async_status) == (hixl.SUCCESS, {two.server_id: "CONNECTED"})
    code = check_moves(lambda: two.client.call(hixl_peer.transfer_sync, two.server_id, "READ", [(dst, src, 640)]),
                       [(two.server, "src", two.client, "dst", [(0, 0, 640)])])
    assert code == hixl.SUCCESS
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.ALREADY_CONNECTED
    assert two.client.call(hixl_peer.disconnect_async, two.server_id) == hixl.SUCCESS
    seen = two.client.call(hixl_peer.wait_async_status, two.server_id, ["NOT_CONNECT"])
    assert seen[-1] == "NOT_CONNECT"
    assert set(seen) <= {"DISCONNECT_PENDING", "DISCONNECTING", "NOT_CONNECT"}, seen
    assert two.client.call(hixl_peer.all_async_status) == (hixl.SUCCESS, {})
    assert two.client.call(hixl_peer.transfer_sync, two.server_id, "READ", [(dst, src, 64)]) == hixl.NOT_CONNECTED
    # nobody listening: CONNECT_FAILED
    dead = f"127.0.0.1:{two.client.call(hixl_peer.free_port)}"
    assert two.client.call(hixl_peer.connect_async, dead, 1000) == hixl.SUCCESS
    seen = two.client.call_within(hang_guard(1000), hixl_peer.wait_async_status, dead,
                                  ["CONNECTED", "CONNECT_FAILED"])
    assert seen[-1] == "CONNECT_FAILED"
    assert set(seen) <= {"CONNECT_PENDING", "CONNECTING", "CONNECT_FAILED"}, seen


def test_auto_connect(peers: Callable[..., Peer], variant: Variant) -> None:
    """Without AutoConnect a transfer needs a link (nothing moves); with it, transfers make the
    link themselves and send_notify does not; connect then finds the link made."""
    two = Two(peers, variant)
    src, dst = two.buffers()
    everything = [(two.server, "src"), (two.client, "dst")]
    code = check_moves(lambda: two.client.call(hixl_peer.transfer_sync, two.server_id, "READ", [(dst, src, 64)]),
                       [], untouched=everything)
    assert code == hixl.NOT_CONNECTED
    auto = peers("hixl-auto", env=variant.env())
    auto.call(hixl_peer.start, dict(AUTO), listen=False)
    mine = auto.call(hixl_peer.alloc, "dst", 16384, seed=7)
    assert auto.call(hixl_peer.register, "dst")[0] == hixl.SUCCESS
    assert auto.call(hixl_peer.send_notify, two.server_id, "n", "m") == hixl.NOT_CONNECTED
    triples = [(1000, 2000, 3000)]
    code = check_moves(lambda: auto.call(hixl_peer.transfer_sync, two.server_id, "READ",
                                         read_descs(mine, src, triples)),
                       [(two.server, "src", auto, "dst", triples)], untouched=[(two.client, "dst")])
    assert code == hixl.SUCCESS
    assert auto.call(hixl_peer.send_notify, two.server_id, "n", "m") == hixl.SUCCESS  # over the auto-made link
    assert two.server.call(hixl_peer.notifies) == (hixl.SUCCESS, [("n", "m")])
    assert auto.call(hixl_peer.connect, two.server_id) == hixl.ALREADY_CONNECTED


def test_async_requests_report_once(peers: Callable[..., Peer], variant: Variant) -> None:
    """get_transfer_status: COMPLETED once, then PARAM_INVALID; get_all_transfer_status: every
    finished request once, with its user_data, in submission order."""
    two = Two(peers, variant)
    src, dst = two.buffers()
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    triples = [(0, 8192, 4096)]

    def one() -> tuple[int, str, int]:
        ret, req = two.client.call(hixl_peer.transfer_async, two.server_id, "READ", read_descs(dst, src, triples))
        assert (ret, req != 0) == (hixl.SUCCESS, True)
        done = two.client.call(hixl_peer.wait_done, req)
        assert two.client.call(hixl_peer.status, req) == (hixl.PARAM_INVALID, "FAILED")  # reported already
        return done

    ret, state, _ = check_moves(one, [(two.server, "src", two.client, "dst", triples)])
    assert (ret, state) == (hixl.SUCCESS, "COMPLETED")
    # three requests with user_data, collected through get_all_transfer_status
    parts = [[(0, 0, 1000)], [(4096, 1000, 3000)], [(12000, 14000, 2384)]]

    def three() -> list[tuple[int, int, str]]:
        reqs = []
        for i, part in enumerate(parts):
            ret, req = two.client.call(hixl_peer.transfer_async, two.server_id, "READ", read_descs(dst, src, part),
                                       100 + i)
            assert ret == hixl.SUCCESS
            reqs.append(req)
        assert len(set(reqs)) == 3 and 0 not in reqs, reqs
        got = two.client.call(hixl_peer.collect_finished, 3)
        assert sorted(got) == sorted((req, 100 + i, "COMPLETED") for i, req in enumerate(reqs)), (got, reqs)
        assert two.client.call(hixl_peer.all_status) == (hixl.SUCCESS, [])  # each reported once
        assert two.client.call(hixl_peer.status, reqs[0]) == (hixl.PARAM_INVALID, "FAILED")
        return got

    check_moves(three, [(two.server, "src", two.client, "dst", [t for p in parts for t in p])])
    assert two.client.call(hixl_peer.all_status, 0, False) == (hixl.SUCCESS, [])
    assert two.client.call(hixl_peer.status, 0) == (hixl.FAILED, "FAILED")


def test_many_outstanding_requests(peers: Callable[..., Peer], variant: Variant) -> None:
    """64 requests submitted before any is polled: distinct ids, each finished once, all bytes there."""
    two = Two(peers, variant)
    src, dst = two.buffers(65536)
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    parts = [[(i * 1024, 65536 - (i + 1) * 1024, 1000)] for i in range(64)]

    def submit_and_collect() -> list[tuple[int, int, str]]:
        reqs = []
        for i, part in enumerate(parts):
            ret, req = two.client.call(hixl_peer.transfer_async, two.server_id, "WRITE", write_descs(dst, src, part),
                                       i + 1)
            assert ret == hixl.SUCCESS
            reqs.append(req)
        assert len(set(reqs)) == 64 and 0 not in reqs, reqs
        got = two.client.call(hixl_peer.collect_finished, 64)
        assert sorted(got) == sorted((req, i + 1, "COMPLETED") for i, req in enumerate(reqs))
        return got

    check_moves(submit_and_collect, [(two.client, "dst", two.server, "src", [t for p in parts for t in p])])


@SERVING
def test_waiting_requests_while_the_peer_is_frozen(peers: Callable[..., Peer], variant: Variant) -> None:
    """With the server frozen, requests stay WAITING: skip_waiting leaves them out, max_query_count
    caps the results (in submission order), nothing is freed; thawed, each completes once."""
    two = Two(peers, variant)
    src, dst = two.buffers()
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    parts = [[(0, 0, 512)], [(1024, 2048, 512)], [(4096, 8192, 4096)]]
    before = {name: side.call(hixl_peer.snapshot, name) for side, name in ((two.server, "src"), (two.client, "dst"))}
    two.server.freeze()
    try:
        reqs = []
        for i, part in enumerate(parts):
            ret, req = two.client.call(hixl_peer.transfer_async, two.server_id, "READ", read_descs(dst, src, part),
                                       7 + i)
            assert ret == hixl.SUCCESS
            reqs.append(req)
        assert two.client.call(hixl_peer.status, reqs[0]) == (hixl.SUCCESS, "WAITING")
        assert two.client.call(hixl_peer.all_status, None, True) == (hixl.SUCCESS, [])
        assert two.client.call(hixl_peer.all_status, 2, False) == (
            hixl.SUCCESS, [(reqs[0], 7, "WAITING"), (reqs[1], 8, "WAITING")])
        assert two.client.call(hixl_peer.all_status, 0, False) == (hixl.SUCCESS, [])
    finally:
        two.server.thaw()
    got = two.client.call(hixl_peer.collect_finished, 3)
    assert sorted(got) == sorted((req, 7 + i, "COMPLETED") for i, req in enumerate(reqs))
    expected = before["dst"].with_bytes(before["src"], [Copy(0, s, 0, d, n) for p in parts for s, d, n in p])
    assert_same(two.client.call(hixl_peer.snapshot, "dst"), expected, "the client's dst")
    assert_same(two.server.call(hixl_peer.snapshot, "src"), before["src"], "the server's src")


def test_transfers_from_several_threads(peers: Callable[..., Peer], variant: Variant) -> None:
    two = Two(peers, variant)
    src, dst = two.buffers(65536)
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    parts = [[(i * 8192, 65536 - (i + 1) * 8192, 8192), (i * 8192 + 100, i * 1000, 50)] for i in range(4)]
    codes = check_moves(lambda: two.client.call(hixl_peer.parallel_transfers, two.server_id, "READ",
                                                [read_descs(dst, src, p) for p in parts]),
                        [(two.server, "src", two.client, "dst", [t for p in parts for t in p])])
    assert codes == [hixl.SUCCESS] * 4


# ============================================================================ two processes: callers


def test_ray_hixl_tensor_transport(peers: Callable[..., Peer], variant: Variant) -> None:
    """Spec 11.3: engines at ip:free_port with AutoConnect; the source registers tensor storages
    once each; the receiver connects (accepting ALREADY_CONNECTED), transfer_async READ, polls
    every 1 ms with its own deadline; on a new memory generation it disconnects and connects
    again; finalize in try/except."""
    two = Two(peers, variant, dict(AUTO), dict(AUTO), client_listens=True)
    source, receiver = two.server, two.client
    t0 = alloc(source, variant, "t0", 32768, "MEM_DEVICE", seed=1)
    t1 = source.call(hixl_peer.alloc, "t1", 8192, seed=2)
    ret, h0 = source.call(hixl_peer.register, "t0", "MEM_DEVICE")
    assert ret == hixl.SUCCESS
    assert source.call(hixl_peer.register, "t0", "MEM_DEVICE") == (hixl.SUCCESS, h0)  # the same storage again
    ret, h1 = source.call(hixl_peer.register, "t1", "MEM_HOST")
    assert ret == hixl.SUCCESS
    r0 = alloc(receiver, variant, "r0", 32768, "MEM_DEVICE")
    r1 = receiver.call(hixl_peer.alloc, "r1", 8192)
    assert receiver.call(hixl_peer.register, "r0", "MEM_DEVICE")[0] == hixl.SUCCESS
    assert receiver.call(hixl_peer.register, "r1", "MEM_HOST")[0] == hixl.SUCCESS
    whole0 = [(i * 8192, i * 8192, 8192) for i in range(4)]
    whole1 = [(0, 0, 8192)]
    code = check_moves(lambda: receiver.call(hixl_peer.ray_read, two.server_id,
                                             read_descs(r0, t0, whole0) + read_descs(r1, t1, whole1)),
                       [(source, "t0", receiver, "r0", whole0), (source, "t1", receiver, "r1", whole1)])
    assert code == hixl.SUCCESS
    # the cached link: connect says ALREADY_CONNECTED, which Ray takes as success
    part = [(100, 30000, 2000)]
    code = check_moves(lambda: receiver.call(hixl_peer.ray_read, two.server_id, read_descs(r0, t0, part)),
                       [(source, "t0", receiver, "r0", part)], untouched=[(receiver, "r1")])
    assert code == hixl.ALREADY_CONNECTED
    # a new memory generation: t1 released, t2 registered; the receiver reconnects
    assert source.call(hixl_peer.deregister, h1) == hixl.SUCCESS
    t2 = source.call(hixl_peer.alloc, "t2", 8192, seed=9)
    assert source.call(hixl_peer.register, "t2", "MEM_HOST")[0] == hixl.SUCCESS
    assert receiver.call(hixl_peer.ray_reconnect, two.server_id) == (hixl.SUCCESS, hixl.SUCCESS)
    code = check_moves(lambda: receiver.call(hixl_peer.ray_read, two.server_id, read_descs(r1, t2, whole1)),
                       [(source, "t2", receiver, "r1", whole1)], untouched=[(receiver, "r0")])
    assert code == hixl.ALREADY_CONNECTED
    receiver.call(hixl_peer.ray_shutdown)
    source.call(hixl_peer.ray_shutdown)
    assert receiver.call(hixl_peer.connect, two.server_id) == hixl.FAILED
    assert source.call(hixl_peer.notifies) == (hixl.FAILED, [])


def test_vllm_ascend_eplb(peers: Callable[..., Peer], variant: Variant) -> None:
    """Spec 11.4: three ranks at ip:port with no options, merged regions as MEM_DEVICE, connect to
    every peer with 300 s; per layer, transfer_async READs from every other rank (two requests
    per source, all outstanding), polled every 0.5 ms; close: disconnects first on every rank,
    then each rank's close (NOT_CONNECTED tolerated), deregister, finalize (None)."""
    n, size, chunk = 3, 12288, 1024
    ranks = [peers(f"eplb-rank{i}", env=variant.env()) for i in range(n)]
    ids = [r.call(hixl_peer.start, {}) for r in ranks]
    send = [alloc(r, variant, "send", size, "MEM_DEVICE", seed=10 + i) for i, r in enumerate(ranks)]
    recv = [alloc(r, variant, "recv", size, "MEM_DEVICE") for r in ranks]
    for r in ranks:
        assert r.call(hixl_peer.register, "send", "MEM_DEVICE")[0] == hixl.SUCCESS
        assert r.call(hixl_peer.register, "recv", "MEM_DEVICE")[0] == hixl.SUCCESS
    for i, r in enumerate(ranks):
        for j in range(n):
            if j != i:
                assert r.call(hixl_peer.connect, ids[j], 300000) == hixl.SUCCESS
    for layer in range(2):
        for i, r in enumerate(ranks):
            # from rank j: two requests, chunk (layer, i) of j's send into slot (layer, j) of i's recv
            plans: list[tuple[int, list[Triple]]] = []
            for j in range(n):
                if j == i:
                    continue
                s = (layer * n + i) * chunk
                d = (layer * n + j) * chunk
                plans.append((j, [(s, d, chunk // 2)]))
                plans.append((j, [(s + chunk // 2, d + chunk // 2, chunk // 2)]))
            transfers = [(ids[j], read_descs(recv[i], send[j], t)) for j, t in plans]
            finals = check_moves(functools.partial(r.call, hixl_peer.eplb_layer, transfers),
                                 [(ranks[j], "send", r, "recv", t) for j, t in plans], untouched=[(r, "send")])
            assert finals == ["COMPLETED"] * len(plans)
    for i, r in enumerate(ranks):
        assert [r.call(hixl_peer.disconnect, ids[j]) for j in range(n) if j != i] == [hixl.SUCCESS] * (n - 1)
    for i, r in enumerate(ranks):
        closed = r.call(hixl_peer.eplb_close, [ids[j] for j in range(n) if j != i])
        assert closed == {"disconnect": [hixl.NOT_CONNECTED] * (n - 1), "deregister": [hixl.SUCCESS] * 2,
                          "finalize": None}


MOONCAKE_OPTIONS = {
    "AutoConnect": "1",
    "LocalCommRes": json.dumps({"version": "1.3", "server_count": "1", "server_list": [
        {"server_id": "127.0.0.1", "device": [{"device_id": "0", "device_ip": "127.0.0.1", "rank_id": "0"}]}],
        "status": "completed"}),
    "RdmaTrafficClass": "132",
    "RdmaServiceLevel": "4",
    "GlobalResourceConfig": json.dumps({"comm_resource_config.listen_port": 16666}),
}


def test_mooncake_tent(peers: Callable[..., Peer], variant: Variant) -> None:
    """Spec 11.5: AutoConnect always, transfer_async with no connect, polled; teardown: disconnect
    every remote first, then deregister each handle, then finalize."""
    two = Two(peers, variant, MOONCAKE_OPTIONS, MOONCAKE_OPTIONS, client_listens=True)
    src, dst = two.buffers()
    writes = [(0, 4096, 2048), (9000, 100, 50)]
    state = check_moves(lambda: two.client.call(hixl_peer.mooncake_transfer, two.server_id, "WRITE",
                                                write_descs(dst, src, writes)),
                        [(two.client, "dst", two.server, "src", writes)])
    assert state == "COMPLETED"
    reads = [(4096, 12000, 4000)]
    state = check_moves(lambda: two.client.call(hixl_peer.mooncake_transfer, two.server_id, "READ",
                                                read_descs(dst, src, reads)),
                        [(two.server, "src", two.client, "dst", reads)])
    assert state == "COMPLETED"
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.ALREADY_CONNECTED  # the auto-made link
    assert two.client.call(hixl_peer.mooncake_teardown, [two.server_id]) == {
        "disconnect": [hixl.SUCCESS], "deregister": [hixl.SUCCESS], "finalize": None}
    assert two.server.call(hixl_peer.mooncake_teardown, []) == {
        "disconnect": [], "deregister": [hixl.SUCCESS], "finalize": None}


# ============================================================================ two processes: notifications


def test_notifications(peers: Callable[..., Peer], variant: Variant) -> None:
    two = Two(peers, variant)
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    sent = [("layer0", "done"), ("layer1", ""), ("", "payload"), ("N" * 1024, "M" * 1024)]
    for name, msg in sent:
        assert two.client.call(hixl_peer.send_notify, two.server_id, name, msg) == hixl.SUCCESS
    assert two.client.call(hixl_peer.send_notify, two.server_id, "N" * 1025, "m") == hixl.PARAM_INVALID
    assert two.client.call(hixl_peer.send_notify, two.server_id, "n", "M" * 1025) == hixl.PARAM_INVALID
    assert two.client.call(hixl_peer.send_notify, two.server_id, "n", "m", 0) == hixl.PARAM_INVALID
    # acked means queued: all there at once, in order, and drained
    assert two.server.call(hixl_peer.notifies) == (hixl.SUCCESS, sent)
    assert two.server.call(hixl_peer.notifies) == (hixl.SUCCESS, [])
    assert two.client.call(hixl_peer.notifies) == (hixl.SUCCESS, [])
    assert two.client.call(hixl_peer.send_notify, two.server_id, "again", "x") == hixl.SUCCESS
    assert two.server.call(hixl_peer.notifies) == (hixl.SUCCESS, [("again", "x")])


def test_a_full_notification_queue_is_resource_exhausted(peers: Callable[..., Peer], variant: Variant) -> None:
    two = Two(peers, variant)
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    codes = two.client.call_within(120, hixl_peer.send_many, two.server_id, 4097)
    assert codes == [hixl.SUCCESS] * 4096 + [hixl.RESOURCE_EXHAUSTED]
    assert two.server.call(hixl_peer.notifies) == (hixl.SUCCESS, [(f"n{i}", f"m{i}") for i in range(4096)])
    assert two.client.call(hixl_peer.send_notify, two.server_id, "after", "drain") == hixl.SUCCESS
    assert two.server.call(hixl_peer.notifies) == (hixl.SUCCESS, [("after", "drain")])


# ============================================================================ two processes: faults


@SERVING
def test_a_frozen_peer_gives_timeout(peers: Callable[..., Peer], variant: Variant) -> None:
    two = Two(peers, variant)
    src, dst = two.buffers()
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    src0, dst0 = two.server.call(hixl_peer.snapshot, "src"), two.client.call(hixl_peer.snapshot, "dst")
    two.server.freeze()
    try:
        code = two.client.call_within(hang_guard(500), hixl_peer.transfer_sync, two.server_id, "READ",
                                      [(dst, src, 4096)], 500)
    finally:
        two.server.thaw()
    assert code == hixl.TIMEOUT
    assert_same(two.client.call(hixl_peer.snapshot, "dst"), dst0, "the client's dst after a timed-out read")
    assert_same(two.server.call(hixl_peer.snapshot, "src"), src0, "the server's src")
    # a fresh link (a timed-out link may stay failed, as hixl_cs latches it), then a notification
    assert two.client.call(hixl_peer.disconnect, two.server_id) == hixl.SUCCESS
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    two.server.freeze()
    try:
        notified = two.client.call_within(hang_guard(500), hixl_peer.send_notify, two.server_id, "n", "m", 500)
    finally:
        two.server.thaw()
    assert notified == hixl.TIMEOUT
    # and a fresh link works
    assert two.client.call(hixl_peer.disconnect, two.server_id) == hixl.SUCCESS
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    code = check_moves(lambda: two.client.call(hixl_peer.transfer_sync, two.server_id, "READ", [(dst, src, 4096)]),
                       [(two.server, "src", two.client, "dst", [(0, 0, 4096)])])
    assert code == hixl.SUCCESS


def test_a_dead_peer_fails_transfers_without_a_hang(peers: Callable[..., Peer], variant: Variant) -> None:
    two = Two(peers, variant)
    src, dst = two.buffers()
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    code = check_moves(lambda: two.client.call(hixl_peer.transfer_sync, two.server_id, "READ", [(dst, src, 64)]),
                       [(two.server, "src", two.client, "dst", [(0, 0, 64)])])
    assert code == hixl.SUCCESS
    dst0 = two.client.call(hixl_peer.snapshot, "dst")
    two.server.kill()
    code = two.client.call_within(hang_guard(1000), hixl_peer.transfer_sync, two.server_id, "READ",
                                  [(dst + 4096, src + 4096, 4096)], 1000)
    assert code != hixl.SUCCESS
    ret, req = two.client.call(hixl_peer.transfer_async, two.server_id, "READ", [(dst, src + 64, 64)])
    if ret == hixl.SUCCESS:
        assert req != 0
        ret, state, _ = two.client.call_within(hang_guard(1000), hixl_peer.wait_done, req, 10.0)
        assert (ret, state) != (hixl.SUCCESS, "COMPLETED")
        assert state == "FAILED"
    else:
        assert req == 0
    assert_same(two.client.call(hixl_peer.snapshot, "dst"), dst0, "the client's dst after the peer died")
    assert two.client.call_within(hang_guard(1000), hixl_peer.disconnect, two.server_id, 1000) in (
        hixl.SUCCESS, hixl.NOT_CONNECTED)
    code = two.client.call_within(hang_guard(1000), hixl_peer.connect, two.server_id, 1000)
    assert code in (hixl.TIMEOUT, hixl.FAILED, hixl.NOT_CONNECTED)


# ============================================================================ one-way links, both ways


class Side:
    """One engine of a pair that link both ways: its peer process, its id, and a buffer it reads
    into ("in", a pattern) from the other side's buffer ("out", another pattern)."""

    def __init__(self, peer: Peer, variant: Variant, ident: str, seed: int):
        self.peer, self.variant, self.id = peer, variant, ident
        self.out = alloc(peer, variant, "out", 16384, seed=seed)
        self.into = alloc(peer, variant, "in", 16384, seed=seed + 1)
        assert peer.call(hixl_peer.register, "out")[0] == hixl.SUCCESS
        assert peer.call(hixl_peer.register, "in")[0] == hixl.SUCCESS

    def reads(self, other: Side, count: int = 1, at: int = 0) -> list[int]:
        """``count`` READs of 64 bytes over this side's own link from ``other``'s "out" (offsets
        from ``at``), each checked: every read byte lands, nothing else changes."""
        triples = [(at + i * 64, 8192 - at - (i + 1) * 64, 64) for i in range(count)]
        return check_moves(lambda: self.peer.call(hixl_peer.transfer_many, other.id, "READ",
                                                  read_descs(self.into, other.out, triples)),
                           [(other.peer, "out", self.peer, "in", triples)])

    def refused(self, other: Side, code: int) -> None:
        """A READ from ``other`` gives ``code`` and moves nothing."""
        got = check_moves(lambda: self.peer.call_within(hang_guard(3000), hixl_peer.transfer_sync, other.id, "READ",
                                                        [(self.into, other.out, 64)], 3000),
                          [], untouched=[(self.peer, "in")])
        assert got == code, got


def both_ways(peers: Callable[..., Peer], variant: Variant) -> tuple[Side, Side]:
    """Two listening engines, each linked to the other (two links, one per direction), each read
    over its own link once."""
    two = Two(peers, variant, client_listens=True)
    c, s = Side(two.client, variant, two.client_id, 1), Side(two.server, variant, two.server_id, 3)
    assert c.peer.call(hixl_peer.connect, s.id) == hixl.SUCCESS
    assert s.peer.call(hixl_peer.connect, c.id) == hixl.SUCCESS
    assert c.reads(s) == [hixl.SUCCESS] and s.reads(c) == [hixl.SUCCESS]
    return c, s


def test_a_link_back_that_notifies_and_disconnects_leaves_the_first_link_working(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """A real program's sequence: C links to S and reads; S links back to C, notifies and
    disconnects. In CANN's hixl that ends S's own link only: C's goes on moving bytes (many
    transfers after the notification arrived), C's connect answers ALREADY_CONNECTED on a link that
    works, and S may link back again."""
    two = Two(peers, variant, client_listens=True)
    c, s = Side(two.client, variant, two.client_id, 1), Side(two.server, variant, two.server_id, 3)
    assert c.peer.call(hixl_peer.connect, s.id) == hixl.SUCCESS
    assert c.reads(s) == [hixl.SUCCESS]
    assert s.peer.call(hixl_peer.connect, c.id) == hixl.SUCCESS
    assert s.peer.call(hixl_peer.send_notify, c.id, "kv_done", "req-1") == hixl.SUCCESS
    assert s.peer.call(hixl_peer.disconnect, c.id) == hixl.SUCCESS
    assert c.peer.call(hixl_peer.wait_notifies, 1) == [("kv_done", "req-1")]
    assert c.reads(s, count=100) == [hixl.SUCCESS] * 100
    assert c.peer.call(hixl_peer.connect, s.id) == hixl.ALREADY_CONNECTED
    assert c.reads(s, count=20, at=4096) == [hixl.SUCCESS] * 20
    assert s.peer.call(hixl_peer.send_notify, c.id, "late", "x") == hixl.NOT_CONNECTED  # S's link is gone
    s.refused(c, hixl.NOT_CONNECTED)
    assert s.peer.call(hixl_peer.connect, c.id) == hixl.SUCCESS  # and may be made again
    assert s.peer.call(hixl_peer.send_notify, c.id, "kv_done", "req-2") == hixl.SUCCESS
    assert c.peer.call(hixl_peer.wait_notifies, 1) == [("kv_done", "req-2")]
    assert s.reads(c) == [hixl.SUCCESS] and c.reads(s) == [hixl.SUCCESS]


@pytest.mark.parametrize("first", ["client", "server"])
def test_each_disconnect_ends_only_its_own_direction(peers: Callable[..., Peer], variant: Variant, first: str) -> None:
    """Two engines linked both ways; either disconnects first, then the other. Each disconnect ends
    the caller's link only: the other direction keeps moving bytes until its own disconnect, and
    either link can be made again in any order."""
    c, s = both_ways(peers, variant)
    one, other = (c, s) if first == "client" else (s, c)
    assert one.peer.call(hixl_peer.disconnect, other.id) == hixl.SUCCESS
    one.refused(other, hixl.NOT_CONNECTED)
    assert one.peer.call(hixl_peer.disconnect, other.id) == hixl.NOT_CONNECTED
    assert other.reads(one, count=10) == [hixl.SUCCESS] * 10
    assert other.peer.call(hixl_peer.disconnect, one.id) == hixl.SUCCESS
    other.refused(one, hixl.NOT_CONNECTED)
    assert other.peer.call(hixl_peer.connect, one.id) == hixl.SUCCESS  # the second to leave links first
    assert other.reads(one) == [hixl.SUCCESS]
    one.refused(other, hixl.NOT_CONNECTED)
    assert one.peer.call(hixl_peer.connect, other.id) == hixl.SUCCESS
    assert one.reads(other) == [hixl.SUCCESS] and other.reads(one) == [hixl.SUCCESS]


def test_engines_killed_and_restarted_in_turn_relink_and_move_every_byte(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """Two engines linked both ways; each is killed and started again at its id in turn. The
    survivor's link to the dead one fails its transfers with FAILED, and connect answers
    ALREADY_CONNECTED, until the survivor disconnects and connects again (CANN's rule); its other
    direction, the restarted engine's new link, works at once."""
    c, s = both_ways(peers, variant)
    for round_ in range(2):
        dead, survivor = (s, c) if round_ == 0 else (c, s)
        dead.peer.kill()
        survivor.refused(dead, hixl.FAILED)
        restarted = peers(f"hixl-restarted-{round_}", env=variant.env(), same_host_as=dead.peer)
        restarted.call(hixl_peer.start_at, dead.id)
        back = Side(restarted, variant, dead.id, 5 + 2 * round_)
        survivor.refused(back, hixl.FAILED)  # the old link stays failed
        assert survivor.peer.call(hixl_peer.connect, back.id) == hixl.ALREADY_CONNECTED
        assert back.peer.call(hixl_peer.connect, survivor.id) == hixl.SUCCESS
        assert back.reads(survivor, count=5) == [hixl.SUCCESS] * 5
        assert survivor.peer.call(hixl_peer.disconnect, back.id) == hixl.SUCCESS
        assert survivor.peer.call(hixl_peer.connect, back.id) == hixl.SUCCESS
        assert survivor.reads(back, count=5) == [hixl.SUCCESS] * 5
        assert back.reads(survivor) == [hixl.SUCCESS]
        if round_ == 0:
            s = back
        else:
            c = back


# ============================================================================ async requests' lifecycle
# What becomes of async requests (docs/hixl.md, "Async requests"; the originals' behaviour and where
# it is written: docs/compatibility.md) when their remote is disconnected, their engine is finalized
# or they time out while their bytes are held in flight at a relay (tests/relay.py), and the bound on
# requests nobody polls. Each held case reads 24 descriptors of 1 MiB through a relay that holds the
# answers after 1 MiB: the request is in flight and cannot have completed. After the disconnect,
# finalize or timeout the request reports the original's exact status, the engine keeps nothing for
# it (no request, no transfer in flight), and the transfer provably stopped: the destination holds
# each descriptor's old or new bytes (guards and everything else unchanged), and stays exactly so
# after the relay lets the held bytes go.

MIB = 1 << 20
PIECES = 24  # descriptors of 1 MiB: the transfer is three requests of 8 MiB, each a cancel point
TRIPLES = [(i * MIB, i * MIB, MIB) for i in range(PIECES)]  # (src offset, dst offset, len)
GUARD_S = 20  # bounds a disconnect or finalize: reaching it means it waited for the held bytes (a hang)


class Held:
    """A listening server with "src" (a seeded pattern) and a client with "dst" (another), 24 MiB
    each, the client linked to the server through ``relay`` (tcp: the only path whose bytes wait at
    a relay), and one READ of all of "src" in 1 MiB descriptors submitted and held in flight after
    1 MiB of answers."""

    def __init__(self, peers: Callable[..., Peer], variant: Variant, relay: Relay, async_timeout_ms: int | None = None):
        self.two = Two(peers, variant)
        self.client, self.server = self.two.client, self.two.server
        self.src, self.dst = self.two.buffers(PIECES * MIB)
        relay.target_port = int(self.two.server_id.rsplit(":", 1)[1])
        self.remote = f"127.0.0.1:{relay.port}"
        assert self.client.call(hixl_peer.connect, self.remote) == hixl.SUCCESS
        if async_timeout_ms is not None:
            self.client.call(hixl_peer.set_limit, "ASYNC_TRANSFER_TIMEOUT_MS", async_timeout_ms)
        self.src0 = self.server.call(hixl_peer.snapshot, "src")
        self.dst0 = self.client.call(hixl_peer.snapshot, "dst")
        relay.hold_after(DOWN, MIB)
        ret, self.req = self.client.call(hixl_peer.transfer_async, self.remote, "READ",
                                         read_descs(self.dst, self.src, TRIPLES), 77)
        assert (ret, self.req != 0) == (hixl.SUCCESS, True)
        relay.wait_held(DOWN)
        assert self.client.call(hixl_peer.status, self.req) == (hixl.SUCCESS, "WAITING")  # in flight, held

    def stopped(self, relay: Relay, up: int) -> int:
        """Asserts the transfer stopped: "dst" holds new bytes (the source's, at their places) in at
        most as many bytes as the relay let through (the request in flight when its link was
        dropped may have landed in part), old bytes everywhere else, guards included; once the
        relay lets the held bytes go and its connections ended, nothing more landed and no request
        went out after ``up`` bytes (what the relay had forwarded towards the server when the
        request was stopped); "src" unchanged. Returns how many bytes landed."""
        after = self.client.call(hixl_peer.snapshot, "dst")
        new = _landed(self.dst0, after, self.src0)
        assert new <= MIB, f"{new} bytes landed, more than the relay let through"
        relay.release()
        wait_until(relay.ended, 30, "the relayed connection ended")
        assert relay.forwarded[UP] == up, "a request went out after the stop"
        assert_same(self.client.call(hixl_peer.snapshot, "dst"), after, "dst once the relay let go")
        assert_same(self.server.call(hixl_peer.snapshot, "src"), self.src0, "the server's src")
        return new


def _landed(before: Snapshot, after: Snapshot, src: Snapshot) -> int:
    """How many bytes of ``after``'s tensor changed from ``before``; asserts that each changed byte
    holds ``src``'s byte at its place (the transfer's, nothing else) and that everything else,
    guards included, holds ``before``'s. (A tcp link moves a request in chunks over several
    streams: the part that landed need not be a prefix.)"""
    changed = np.flatnonzero(before.tensor(0) != after.tensor(0))
    runs = np.split(changed, np.flatnonzero(np.diff(changed) != 1) + 1) if changed.size else []
    copies = [Copy(0, int(r[0]), 0, int(r[0]), int(r[-1]) - int(r[0]) + 1) for r in runs]
    assert_same(after, before.with_bytes(src, copies), "dst of the stopped request")
    return int(changed.size)


@pytest.fixture
def relay() -> Iterator[Relay]:
    with Relay(0) as r:
        yield r


def _nothing_kept(client: Peer) -> dict[str, Any]:
    """Polls until the client's engine keeps no request and runs no transfer."""
    return wait_until(lambda: (c := client.call(hixl_peer.counts))["requests"] == 0
                      and c.get("in_flight", 0) == 0 and c, 30, "no request kept, no transfer in flight")


@only("cpu-tcp")
@pytest.mark.one_host("the test process relays the link")
def test_disconnect_cancels_a_request_in_flight_and_forgets_it(peers: Callable[..., Peer], variant: Variant,
                                                               relay: Relay) -> None:
    """CANN's disconnect erases the remote's requests from its index (a query then answers
    PARAM_INVALID) and aborts their transfers: so does this one, and the transfer has stopped when
    disconnect returns; the engine links again and moves every byte."""
    h = Held(peers, variant, relay)
    assert h.client.call_within(GUARD_S, hixl_peer.disconnect, h.remote) == hixl.SUCCESS
    up = relay.forwarded[UP]
    # stopped when disconnect returned (not polled): nothing kept, nothing in flight, no link
    assert h.client.call(hixl_peer.counts) == {"requests": 0, "running": 0, "initialized": True, "in_flight": 0,
                                               "links": 0}
    assert h.client.call(hixl_peer.status, h.req) == (hixl.PARAM_INVALID, "FAILED")
    assert h.client.call(hixl_peer.all_status) == (hixl.SUCCESS, [])
    h.stopped(relay, up)
    # the same engine links again (directly) and reads the whole buffer exactly
    assert h.client.call(hixl_peer.connect, h.two.server_id) == hixl.SUCCESS
    code = check_moves(lambda: h.client.call(hixl_peer.transfer_sync, h.two.server_id, "READ",
                                             read_descs(h.dst, h.src, TRIPLES)),
                       [(h.server, "src", h.client, "dst", TRIPLES)])
    assert code == hixl.SUCCESS


@only("cpu-tcp")
@pytest.mark.one_host("the test process relays the link")
def test_finalize_cancels_a_request_in_flight(peers: Callable[..., Peer], variant: Variant, relay: Relay) -> None:
    """CANN's finalize destroys every client, aborting their transfers: finalize here cancels the
    request held in flight, returns once it stopped, and every later query is FAILED."""
    h = Held(peers, variant, relay)
    # the relay still holds the request's bytes: finalize does not wait for them
    assert h.client.call_within(GUARD_S, hixl_peer.finalize) is None
    up = relay.forwarded[UP]
    assert h.client.call(hixl_peer.status, h.req) == (hixl.FAILED, "FAILED")
    assert h.client.call(hixl_peer.all_status) == (hixl.FAILED, [])
    assert h.client.call(hixl_peer.counts) == {"requests": 0, "running": 0, "initialized": False}
    h.stopped(relay, up)


@only("cpu-tcp")
@pytest.mark.one_host("the test process relays the link")
def test_a_request_past_its_timeout_reports_failed_once_and_stops(peers: Callable[..., Peer], variant: Variant,
                                                                  relay: Relay) -> None:
    """A request held past ASYNC_TRANSFER_TIMEOUT_MS (here 1 s) reports FAILED (never TIMEOUT: the
    original's async path, whose device transfers time out in their kernel, reports FAILED too), once;
    then the engine keeps nothing for it and nothing more lands."""
    h = Held(peers, variant, relay, async_timeout_ms=1000)
    assert h.client.call(hixl_peer.wait_done, h.req)[:2] == (hixl.SUCCESS, "FAILED")
    up = relay.forwarded[UP]
    assert h.client.call(hixl_peer.status, h.req) == (hixl.PARAM_INVALID, "FAILED")  # reported already
    _nothing_kept(h.client)
    h.stopped(relay, up)


def test_requests_nobody_polls_are_bounded(peers: Callable[..., Peer], variant: Variant) -> None:
    """MAX_PENDING_TRANSFERS (here 3) requests not yet reported: the next transfer_async is
    (RESOURCE_EXHAUSTED, 0) and moves nothing; reporting one finished frees its place."""
    two = Two(peers, variant)
    src, dst = two.buffers()
    assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
    two.client.call(hixl_peer.set_limit, "MAX_PENDING_TRANSFERS", 3)
    parts = [[(i * 1024, i * 1024, 1000)] for i in range(4)]

    def submit() -> tuple[list[int], tuple[int, int]]:
        reqs = []
        for part in parts[:3]:
            ret, req = two.client.call(hixl_peer.transfer_async, two.server_id, "READ", read_descs(dst, src, part))
            assert ret == hixl.SUCCESS
            reqs.append(req)
        wait_until(lambda: two.client.call(hixl_peer.counts)["running"] == 0, 30, "the three requests ended")
        refused = two.client.call(hixl_peer.transfer_async, two.server_id, "READ", read_descs(dst, src, parts[3]))
        return reqs, refused

    reqs, refused = check_moves(submit, [(two.server, "src", two.client, "dst", [t for p in parts[:3] for t in p])])
    assert refused == (hixl.RESOURCE_EXHAUSTED, 0)
    assert two.client.call(hixl_peer.counts)["requests"] == 3
    assert two.client.call(hixl_peer.wait_done, reqs[0])[:2] == (hixl.SUCCESS, "COMPLETED")

    def fourth() -> tuple[int, str, int] | None:
        ret, _, done = two.client.call(hixl_peer.transfer_async_settled, two.server_id, "READ",
                                       read_descs(dst, src, parts[3]))
        assert ret == hixl.SUCCESS
        return done

    done = check_moves(fourth, [(two.server, "src", two.client, "dst", parts[3])])
    assert done is not None and done[:2] == (hixl.SUCCESS, "COMPLETED")
    assert two.client.call(hixl_peer.counts)["requests"] == 2  # the two never polled
