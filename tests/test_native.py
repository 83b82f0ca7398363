"""The native module's interface: C++ enums and structs bound once, engines opened from typed
settings (pdlink.native), never from positional numbers."""

from __future__ import annotations

import pytest

from internals import core, open_engine
from pdlink import LLMException, LLMRole, Placement
from pdlink import LLMStatusCode as S
from pdlink.native import placement_of, role_of, transport_of


def test_enums_are_read_by_name_from_the_native_module() -> None:
    assert role_of(LLMRole.PROMPT) is core.Role.PROMPT
    assert role_of("decoder") is core.Role.DECODER
    assert transport_of("cma") is core.Transport.CMA
    assert placement_of(Placement.HOST) is core.Placement.HOST
    with pytest.raises(ValueError, match=r"unknown transport 'udp'; one of \['auto', 'cma', 'tcp'\]"):
        transport_of("udp")


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
        assert [(p["placement"], p["capacity"]) for p in e.pools()] == [(core.Placement.HOST, 1 << 20)]
    finally:
        e.finalize()


def test_open_engine_refuses_what_the_engine_refuses() -> None:
    with pytest.raises(ValueError, match="limits must be positive"):
        open_engine(backend="cpu", device_id=0, cluster_id=7, role="PROMPT", limits={"max_links": 0})
    with pytest.raises(LLMException) as e:
        open_engine(backend="cpu", device_id=0, cluster_id=7, role="PROMPT", payload_integrity=True)
    assert e.value.status_code == S.LLM_PARAM_INVALID  # payload integrity needs a link secret
