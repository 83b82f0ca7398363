"""Shared fixtures: real prefill/decode peer processes linked over loopback."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from backend_env import BACKENDS, TRANSPORTS, backend_name, fake_ascend_dir, link_transport, peer_env  # noqa: E402
from peer import Peer  # noqa: E402

from pdlink._sysinfo import direct_access_permitted  # noqa: E402
from pdlink.status import LLMStatusCode  # noqa: E402

PROMPT_ID, DECODER_ID = 1, 2


CMA_AVAILABLE = direct_access_permitted()


@pytest.fixture(scope="session")
def fake_ascend_lib_dir():
    """The fake Ascend vendor libraries, built once per session. A failed build fails the ascend
    tests (the C++ compiler is always there): it must never turn into a skip."""
    try:
        return fake_ascend_dir()
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    pytest.fail(f"building the fake Ascend libraries (tests/fake_ascend/build.py) failed: {error}", pytrace=False)


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    """Each data-movement test runs over both link transports of the CPU backend, direct memory
    access between the two processes (cma) and loopback TCP, and on the Ascend backend over the
    fake vendor libraries (ascend: device memory moved by HCCL, a TCP control connection).
    Peers get their environment from backend_env.peer_env(transport)."""
    if request.param == "cma" and not CMA_AVAILABLE:
        pytest.skip("process_vm_readv between sibling processes is not permitted on this machine")
    if request.param == "ascend":
        request.getfixturevalue("fake_ascend_lib_dir")
    return request.param


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Tests of one engine's memory and local copies, and flows whose links do not depend on the
    CPU transport, run on the CPU backend and on the Ascend backend over the fakes. Peers get
    their environment from backend_env.peer_env(backend)."""
    if request.param == "ascend":
        request.getfixturevalue("fake_ascend_lib_dir")
    return request.param


@pytest.fixture
def peers():
    """Factory for peer processes; every peer is closed (or killed) at teardown."""
    made = []

    def make(name: str = "peer", **kw) -> Peer:
        p = Peer(name, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


class PD:
    """A listening PROMPT engine (cluster 1) and a DECODER engine (cluster 2), not linked yet.

    Each side's namespace has `dd` (the LLMDataDist) and `cm` (its cache manager); `port` is the
    prompt's listen port; `env` the environment of both peers (for more peers of the same kind).
    `prefill_env`/`decode_env` add variables to one side (e.g. fault injection in the fakes);
    `prefill_timeout` gives the prompt its own sync_kv_timeout (default: `timeout`).
    """

    def __init__(self, peers, transport, remote=True, timeout=None, pool=1 << 22, prefill_env=None, decode_env=None,
                 prefill_timeout=None):
        self.transport = transport
        self.env = env = peer_env(transport)
        self.prefill = p = peers("prefill", env={**env, **(prefill_env or {})})
        self.decode = d = peers("decode", env={**env, **(decode_env or {})})
        extra = f"remote={remote}, pool={pool}"
        p.exec(f"dd = LLMDataDist(LLMRole.PROMPT, {PROMPT_ID}); dd.init(options(listen='127.0.0.1:0', {extra}, "
               f"timeout={prefill_timeout or timeout})); cm = dd.cache_manager")
        d.exec(f"dd = LLMDataDist(LLMRole.DECODER, {DECODER_ID}); dd.init(options({extra}, timeout={timeout})); "
               "cm = dd.cache_manager")
        self.port = p.eval("dd.listen_port")

    def link(self):
        ret = self.decode.eval(f"dd.link_clusters([cluster({PROMPT_ID}, {self.port})], 5000)")
        assert ret == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS]), ret
        for side in (self.prefill, self.decode):
            assert {link["transport"] for link in side.eval("dd.links()")} == {link_transport(self.transport)}
            assert side.eval("dd._engine.backend") == backend_name(self.transport)


@pytest.fixture
def make_pd(peers, transport):
    return lambda **kw: PD(peers, transport, **kw)


@pytest.fixture
def pd(make_pd):
    return make_pd()
