"""The native module's interface: C++ enums and structs bound once, engines opened from typed
settings (pdlink.native), never from positional numbers; and pdlink.Engine's options,
registration and exception classes in one process (tests/native/test_engine_api.py moves bytes between
two)."""

from __future__ import annotations

import json
import pickle
import re
from typing import Any

import numpy as np
import pytest

import pdlink
from internals import DEFAULT_CONFIG_JSON, as_llm_exception, core, error_class, open_engine
from llm_datadist import LLMRole, Placement
from pdlink import InvalidArgument, LinkError, LLMException, NotFound, NotSupported, OutOfMemory, TransferTimeout
from pdlink import LLMStatusCode as S
from pdlink.native import placement_of, role_of, transport_of


def test_enums_are_read_by_name_from_the_native_module() -> None:
    assert role_of(LLMRole.PROMPT) is core.Role.PROMPT
    assert role_of("decoder") is core.Role.DECODER
    assert transport_of("cma") is core.Transport.CMA
    assert placement_of(Placement.HOST) is core.Placement.HOST
    with pytest.raises(ValueError, match=r"unknown transport 'udp'; one of \['auto', 'cma', 'tcp', 'ucx'\]"):
        transport_of("udp")


def test_transport_and_backend_names_come_from_the_native_module() -> None:
    """The names every layer accepts are the engine's: llm_datadist's options and the server's
    configuration refuse what the native module does not list, and list what it does."""
    from llm_datadist import LLMDataDist
    from pdlink.native import backend_names, transport_names
    from pdlink.server import config as C

    assert transport_names() == tuple(name.lower() for name in core.Transport.__members__)
    assert transport_names() == ("auto", "tcp", "cma", "ucx") and backend_names() == ("auto", "cpu", "ascend")
    for name in transport_names():
        assert transport_of(name).name.lower() == name
    with pytest.raises(LLMException, match=re.escape(str(sorted(transport_names())))) as e:
        LLMDataDist(LLMRole.PROMPT, 1).init({"pdlink.Transport": "rdma"})
    assert e.value.status_code == S.LLM_PARAM_INVALID
    with pytest.raises(LLMException, match=re.escape(str(list(backend_names())))):
        LLMDataDist(LLMRole.PROMPT, 1).init({"pdlink.Backend": "npu"})
    raw = json.loads(DEFAULT_CONFIG_JSON)
    raw["KvTransferConfig"]["transport"] = "rdma"
    with pytest.raises(C.ConfigError, match=re.escape(f"transport must be one of {list(transport_names())}")):
        C.parse(raw, C.EMBEDDED, None, {})


def test_memory_map_covers_by_the_engines_rule() -> None:
    """MemoryMap.covers is the registry's check (csrc/core/spans.h): inside one range or across at
    most max_raw_span ranges that follow each other exactly, whatever order the ranges come in.
    csrc/tests/unit_test.cc checks the registry on the same shapes (64 adjacent tensors: yes; 65: no)."""
    span = core.LIMITS["max_raw_span"]
    ranges = [(0x10000 + 64 * i, 64) for i in reversed(range(span + 1))]  # adjacent, given unsorted
    m = pdlink.MemoryMap(0, tuple(ranges))
    assert m.covers([0x10000], [64 * span])  # across exactly max_raw_span ranges
    assert m.covers([0x10000 + 64], [64 * span]) and m.covers(np.array([0x10010], np.uint64), [64 * span - 32])
    assert not m.covers([0x10000], [64 * (span + 1)])  # one range more than a request may cross
    assert not m.covers([0x10000 + 64 * span], [65])  # past the end
    assert not m.covers([0x10000], [0]) and not m.covers([0xFFFF], [2])
    assert m.covers([], []) and not pdlink.MemoryMap(0, ()).covers([0x10000], [1])
    with pytest.raises(ValueError, match="differ in length"):
        m.covers([0x10000, 0x10040], [64])


def test_a_transfer_spec_is_built_in_one_call() -> None:
    target = core.Target(kind=core.TargetKind.REQUEST_KEY, model_id=2, req_id=9)
    spec = core.TransferSpec(peer_cluster_id=1, target=target, local_cache_id=4, mode=core.TransferMode.EXPLICIT,
                             local_tensors=[1, 0], local_runs=[(0, 8)], remote_runs=[(16, 8)])
    assert (spec.peer_cluster_id, spec.target.kind, spec.target.model_id, spec.target.req_id, spec.local_cache_id,
            spec.mode, spec.local_tensors, spec.local_runs, spec.remote_runs, spec.size) == (
        1, core.TargetKind.REQUEST_KEY, 2, 9, 4, core.TransferMode.EXPLICIT, [1, 0], [(0, 8)], [(16, 8)], -1)
    with pytest.raises(TypeError):
        core.TransferSpec(1)  # type: ignore[call-arg]  # keywords only: no positional argument lists


def test_a_transfer_spec_keeps_what_it_is_given() -> None:
    spec = core.TransferSpec()
    assert (spec.mode, spec.size, spec.local_runs) == (core.TransferMode.SLOT_TO_SLOT, -1, [])
    spec.target.kind = core.TargetKind.RAW  # the spec's own target, not a copy
    spec.local_runs, spec.remote_runs = [(0, 64), (128, 64)], [(4096, 128)]
    spec.local_blocks = [3, 1]
    assert (spec.target.kind, spec.local_runs, spec.remote_runs, spec.local_blocks) == (
        core.TargetKind.RAW, [(0, 64), (128, 64)], [(4096, 128)], [3, 1])


def test_engine_settings_default_to_the_engines_own() -> None:
    c = core.EngineConfig()
    assert (c.role, c.transport, c.sync_timeout_ms, c.device_pool.bytes, c.limits.max_links) == (
        core.Role.MIX, core.Transport.AUTO, 1000, 0, core.EngineLimits().max_links)


def test_open_engine_applies_every_setting() -> None:
    e = open_engine(backend="cpu", device_id=0, cluster_id=7, role="PROMPT", listen_ip="127.0.0.1",
                    host_pool=(1 << 20, 12), limits={"max_links": 3})
    try:
        assert (e.cluster_id, e.role, e.listen_port > 0) == (7, core.Role.PROMPT, True)
        assert [(p.placement, p.capacity) for p in e.pools()] == [(core.Placement.HOST, 1 << 20)]
    finally:
        e.finalize()


def test_open_engine_refuses_what_the_engine_refuses() -> None:
    with pytest.raises(ValueError, match="limits must be positive"):
        open_engine(backend="cpu", device_id=0, cluster_id=7, role="PROMPT", limits={"max_links": 0})
    with pytest.raises(LLMException) as e:
        open_engine(backend="cpu", device_id=0, cluster_id=7, role="PROMPT", payload_integrity=True)
    assert e.value.status_code == S.LLM_PARAM_INVALID  # payload integrity needs a link secret


# ---------------------------------------------------------------- pdlink.Engine, in one process


def test_the_readme_example_moves_exact_blocks() -> None:
    """README.md, "pdlink's own API": two engines (here in one process), a prepared read by key."""
    kv = np.random.default_rng(5).integers(0, 256, (64, 4096), np.uint8)
    kv0 = kv.copy()
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=1, listen="127.0.0.1:0", backend="cpu")) as target:
        remote = target.register(kv, block_size=4096, key=7).remote()
        mine = np.zeros((64, 4096), np.uint8)
        with pdlink.Engine(pdlink.EngineOptions(cluster_id=2, backend="cpu")) as engine:
            peer = engine.connect(f"127.0.0.1:{target.listen_port}")
            assert peer == 1
            job = engine.prepare(peer, engine.register(mine, block_size=4096), remote)
            job.read(np.array([0, 1, 2]), np.array([9, 8, 7]))
        expected = np.zeros_like(mine)
        expected[[0, 1, 2]] = kv0[[9, 8, 7]]
        assert np.array_equal(mine, expected)  # the whole destination
        assert np.array_equal(kv, kv0)  # the source


def test_engine_options_are_checked() -> None:
    with pytest.raises(ValueError, match="cluster_id"):
        pdlink.EngineOptions(cluster_id=-1)
    with pytest.raises(ValueError, match="timeout_ms"):
        pdlink.EngineOptions(cluster_id=1, timeout_ms=0)
    with pytest.raises(ValueError, match="unknown role 'prefill'"):
        pdlink.EngineOptions(cluster_id=1, role="prefill")
    with pytest.raises(ValueError, match="address must be 'ip:port'"):
        pdlink.Engine(pdlink.EngineOptions(cluster_id=1, listen="127.0.0.1", backend="cpu"))


def test_engine_options_left_unset_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PDLINK_TRANSPORT", "PDLINK_LINK_SECRET", "PDLINK_BACKEND", "PDLINK_HCCL_ONE_SIDED"):
        monkeypatch.delenv(name, raising=False)
    r = pdlink.EngineOptions(cluster_id=1).resolved()
    assert (r.transport, r.secret, r.backend, r.hccl_one_sided) == ("auto", None, "auto", False)
    monkeypatch.setenv("PDLINK_TRANSPORT", "tcp")
    monkeypatch.setenv("PDLINK_LINK_SECRET", "s3cret")
    monkeypatch.setenv("PDLINK_HCCL_ONE_SIDED", "1")
    r = pdlink.EngineOptions(cluster_id=1).resolved()
    assert (r.transport, r.secret, r.hccl_one_sided) == ("tcp", "s3cret", True)
    assert pdlink.EngineOptions(cluster_id=1, transport="cma", secret="").resolved().transport == "cma"
    monkeypatch.setenv("PDLINK_HCCL_ONE_SIDED", "yes")
    with pytest.raises(ValueError, match="PDLINK_HCCL_ONE_SIDED"):
        pdlink.EngineOptions(cluster_id=1).resolved()


def test_registration_is_checked() -> None:
    buf = np.zeros((4, 1000), np.uint8)
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=1, backend="cpu")) as engine:
        with pytest.raises(ValueError, match="block_size"):
            engine.register(buf, block_size=3000)
        with pytest.raises(ValueError, match="C-contiguous"):
            engine.register(buf[:, ::2])
        with pytest.raises(ValueError, match="not both"):
            engine.register(buf, address=buf.ctypes.data, length=16)
        region = engine.register(buf, block_size=1000, key=3)
        assert (region.length, region.block_size, region.key, region.placement) == (4000, 1000, 3, "HOST")
        with pytest.raises(InvalidArgument) as e:  # a key is published once per engine
            engine.register(np.zeros(1000, np.uint8), key=3)
        assert e.value.status_code == S.LLM_PARAM_INVALID
        engine.deregister(region)
        with pytest.raises(ValueError, match="not registered here"):
            engine.deregister(region)
        layers = [np.zeros((4, 1000), np.uint8) for _ in range(3)]  # a region of several tensors
        region = engine.register(layers, block_size=1000)
        assert (region.addresses, region.length, region.tensors) == (tuple(a.ctypes.data for a in layers), 4000, 3)
        assert region.remote().tensors == 3
        with pytest.raises(ValueError, match="one size"):
            engine.register([np.zeros(1000, np.uint8), np.zeros(2000, np.uint8)])
        with pytest.raises(ValueError, match="non-empty list"):
            engine.register([])
        with pytest.raises(ValueError, match="positive ints"):
            engine.register(address=[buf.ctypes.data, 0], length=1000)
        with pytest.raises(ValueError, match="cannot register a int"):  # numpy would register a copy
            engine.register([1, 2, 3])
        assert engine.local_memory().ranges == tuple(sorted((a, 4000) for a in region.addresses))  # nothing added


@pytest.mark.parametrize(("code", "cls", "builtin"), [
    (S.LLM_PARAM_INVALID, InvalidArgument, ValueError),
    (S.LLM_KV_CACHE_NOT_EXIST, NotFound, LookupError),
    (S.LLM_TIMEOUT, TransferTimeout, TimeoutError),
    (S.LLM_LINK_FAILED, LinkError, ConnectionError),
    (S.LLM_NOT_YET_LINK, LinkError, ConnectionError),
    (S.LLM_OUT_OF_MEMORY, OutOfMemory, MemoryError),
    (S.LLM_FEATURE_NOT_ENABLED, NotSupported, NotImplementedError),
    (S.LLM_EXIST_LINK, LLMException, RuntimeError),
])
def test_each_code_has_its_exception_class(code: S, cls: type, builtin: type) -> None:
    e = error_class(code)("boom", status_code=code)
    assert (type(e), e.status_code, str(e)) == (cls, code, "boom")
    assert isinstance(e, builtin) and isinstance(e, LLMException) and isinstance(e, RuntimeError)
    restored = pickle.loads(pickle.dumps(e))
    assert (type(restored), restored.status_code, str(restored)) == (cls, code, "boom")
    plain = LLMException("boom", status_code=code)  # as CANN's: LLMException itself, whatever the code
    assert (type(plain), plain.status_code) == (LLMException, code)
    assert type(LLMException) is type and LLMException.__mro__ == (LLMException, RuntimeError, Exception,
                                                                      BaseException, object)
    assert type(as_llm_exception(e)) is LLMException


def test_the_native_module_raises_from_the_status_alone() -> None:
    """A failed Status raises the class registered for its code (pdlink.status.native_errors), with
    ``status_code`` and the engine's own message: no operation name, no llm_datadist format."""
    with pytest.raises(InvalidArgument) as e:
        core.open_backend("npu", 0)
    assert e.value.status_code is S.LLM_PARAM_INVALID
    assert str(e.value).startswith("unknown backend 'npu' (available: "), str(e.value)
    assert "error code is" not in str(e.value)


def test_engine_errors_speak_the_engines_words() -> None:
    """pdlink.Engine's advice names its own calls (connect, disconnect), never llm_datadist's."""
    dst = np.zeros(64, np.uint8)
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=1, role="PROMPT", listen="127.0.0.1:0", backend="cpu")) as a, \
            pdlink.Engine(pdlink.EngineOptions(cluster_id=2, backend="cpu")) as b:
        b.register(dst)
        with pytest.raises(LinkError) as e:
            b.read(5, [(dst.ctypes.data, 8)], [(4096, 8)])
        assert e.value.status_code == S.LLM_NOT_YET_LINK
        assert str(e.value).endswith("no link to cluster 5; connect first"), str(e.value)
        b.connect(f"127.0.0.1:{a.listen_port}")
        with pytest.raises(LLMException) as e2:
            b.switch_role("PROMPT", listen="127.0.0.1:0", require_no_links=True)
        assert e2.value.status_code == S.LLM_EXIST_LINK
        assert "disconnect them first" in str(e2.value) and "unlink_clusters" not in str(e2.value), str(e2.value)


def test_switch_role_moves_the_listener_and_keeps_the_links() -> None:
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=1, role="PROMPT", listen="127.0.0.1:0", backend="cpu")) as a, \
            pdlink.Engine(pdlink.EngineOptions(cluster_id=2, role="DECODER", backend="cpu")) as b:
        assert (a.role, b.role, b.listen_port) == ("PROMPT", "DECODER", 0)
        assert b.connect(f"127.0.0.1:{a.listen_port}") == 1
        with pytest.raises(LLMException) as e:  # llm_datadist's contract, on request: no link may be open
            b.switch_role("PROMPT", listen="127.0.0.1:0", require_no_links=True)
        assert e.value.status_code == S.LLM_EXIST_LINK
        assert (b.role, b.role_state().epoch) == ("DECODER", 0)
        b.switch_role("PROMPT", listen="127.0.0.1:0")  # links survive a switch
        a.switch_role("DECODER")
        assert (a.role, a.listen_port, b.role, b.listen_port > 0) == ("DECODER", 0, "PROMPT", True)
        assert [link.peer_cluster_id for link in b.links()] == [1]
        assert [link.peer_cluster_id for link in a.links()] == [2]
        assert (a.role_state().epoch, b.role_state().epoch) == (1, 1)
        b.disconnect(1)
        assert a.connect(f"127.0.0.1:{b.listen_port}") == 2  # the roles are reversed, a new link works


def test_bad_posts_and_descriptors_are_refused_and_move_nothing() -> None:
    src = np.random.default_rng(7).integers(0, 256, (8, 256), np.uint8)
    src0 = src.copy()
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=1, listen="127.0.0.1:0", backend="cpu")) as target, \
            pdlink.Engine(pdlink.EngineOptions(cluster_id=2, backend="cpu")) as engine:
        remote = target.register(src, block_size=256, key=4).remote()
        dst = np.full((8, 256), 9, np.uint8)
        region = engine.register(dst, block_size=256)
        peer = engine.connect(f"127.0.0.1:{target.listen_port}")
        job = engine.prepare(peer, region, remote)
        refused: list[tuple[Any, Any, type[Exception], str]] = [
            ([8], [0], InvalidArgument, "block index 8 out of range: local cache has 8 blocks"),
            ([-1], [0], InvalidArgument, "block index -1 out of range"),
            ([0], [-2], InvalidArgument, "remote block index -2 out of range"),
            ([], [], InvalidArgument, "the block list is empty"),
            ([0, 1], [0], ValueError, "differ in length"),
            (np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64), ValueError, "one-dimensional"),
            ([True], [0], TypeError, "ints within int64"),
            ([2**63], [0], TypeError, "ints within int64"),
        ]
        for local, rem, exc, text in refused:
            with pytest.raises(exc, match=re.escape(text)):
                job.read(local, rem)
        with pytest.raises(InvalidArgument) as e:  # past the peer's region: the peer refuses
            job.read([0], [8])
        assert e.value.status_code == S.LLM_PARAM_INVALID
        bad_descriptors: list[tuple[Any, Any, str]] = [
            ([(dst.ctypes.data, 16, 0)], [(remote.address, 16)], "list of \\(address, length\\) pairs"),
            ([], [], "non-empty"),
            ([(dst.ctypes.data, 16)], [(remote.address, 16), (remote.address, 16)], "differ in length"),
            ([(dst.ctypes.data, 16)], [(remote.address, 32)], "differ in length"),
            ([(dst.ctypes.data - 4096, 16)], [(remote.address, 16)], "not inside registered memory"),
        ]
        for local_d, remote_d, text in bad_descriptors:
            with pytest.raises(ValueError, match=text):
                engine.read(peer, local_d, remote_d)
        with pytest.raises(InvalidArgument):  # runs past the end of the local region
            engine.read(peer, [(dst.ctypes.data + 8 * 256 - 8, 16)], [(remote.address, 16)])
        assert np.array_equal(dst, np.full((8, 256), 9, np.uint8))  # nothing moved
        assert np.array_equal(src, src0)
        job.read([0], [3])  # and the transfer still works
        assert np.array_equal(dst[0], src0[3]) and np.array_equal(dst[1:], np.full((7, 256), 9, np.uint8))
