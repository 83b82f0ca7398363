"""Shared fixtures: real prefill/decode peer processes linked over loopback."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from peer import Peer  # noqa: E402

from pdlink._sysinfo import direct_access_permitted  # noqa: E402
from pdlink.status import LLMStatusCode  # noqa: E402

PROMPT_ID, DECODER_ID = 1, 2


CMA_AVAILABLE = direct_access_permitted()


@pytest.fixture(params=["cma", "tcp"])
def transport(request):
    """Each data-movement test runs over both link transports: direct memory access between the
    two processes (cma) and loopback TCP."""
    if request.param == "cma" and not CMA_AVAILABLE:
        pytest.skip("process_vm_readv between sibling processes is not permitted on this machine")
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
    prompt's listen port.
    """

    def __init__(self, peers, transport, remote=True, timeout=None, pool=1 << 22):
        self.transport = transport
        env = {"PDLINK_TRANSPORT": transport}
        self.prefill = p = peers("prefill", env=env)
        self.decode = d = peers("decode", env=env)
        extra = f", remote={remote}, timeout={timeout}, pool={pool}"
        p.exec(f"dd = LLMDataDist(LLMRole.PROMPT, {PROMPT_ID}); "
               f"dd.init(options(listen='127.0.0.1:0'{extra})); cm = dd.cache_manager")
        d.exec(f"dd = LLMDataDist(LLMRole.DECODER, {DECODER_ID}); dd.init(options({extra[2:]})); "
               "cm = dd.cache_manager")
        self.port = p.eval("dd.listen_port")

    def link(self):
        ret = self.decode.eval(f"dd.link_clusters([cluster({PROMPT_ID}, {self.port})], 5000)")
        assert ret == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS]), ret
        for side in (self.prefill, self.decode):
            assert {link["transport"] for link in side.eval("dd.links()")} == {self.transport}


@pytest.fixture
def make_pd(peers, transport):
    return lambda **kw: PD(peers, transport, **kw)


@pytest.fixture
def pd(make_pd):
    return make_pd()
