"""Shared fixtures: the backend x data path matrix, peer processes, linked prefill/decode pairs.

How a test is written here: tests/README.md.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import hostbed  # noqa: E402
from backend_env import BACKENDS, VARIANTS, Variant, fake_ascend_dir  # noqa: E402
from internals import direct_access_permitted, ucx_info  # noqa: E402
from llm_datadist import BlocksCacheKey
from pdlink import LLMStatusCode
from peer import Peer  # noqa: E402
from peers import kv  # noqa: E402
from verify import Snapshot, check_transfer, rows  # noqa: E402

PROMPT_ID, DECODER_ID = 1, 2
PROMPT_KEY = BlocksCacheKey(PROMPT_ID, 0)  # the prompt's usual blocks cache

CMA_AVAILABLE = direct_access_permitted()
UCX_INFO = ucx_info()  # what pdlink's UCX loader finds in this environment (peers inherit it)
UCX_AVAILABLE = bool(UCX_INFO["loaded"])
UCX_WHY_NOT = None if UCX_AVAILABLE else f"needs UCX (pip install \".[ucx]\"; .ci/ucx.sh runs it): {UCX_INFO['error']}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "heavy: load and soak tests; deselected by default, CI runs `pytest -m heavy`")
    config.addinivalue_line("markers", "one_host(why): the test process itself is a party on the peers' network (a "
                                       "raw attacker, a relay, a port it probes): the two-hosts cells are left out")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leaves out the two-hosts cells (``Variant.hosts``) of tests marked ``one_host``: their test
    process talks to the peers itself, and it is on no emulated host (counted as deselected)."""
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        cell = callspec.params.get("variant") if callspec is not None else None
        left_out = isinstance(cell, Variant) and cell.hosts and item.get_closest_marker("one_host") is not None
        (drop if left_out else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Each distinct reason for a skip, said once with how many tests it skipped (pyproject's
    addopts leave pytest's own line per skipped test out: without UCX that was 260 lines)."""
    reasons: dict[str, list[str]] = {}
    for report in terminalreporter.stats.get("skipped", []):
        if isinstance(report.longrepr, tuple):  # (path, line, "Skipped: why")
            why = str(report.longrepr[2]).removeprefix("Skipped: ")
            reasons.setdefault(why, []).append(str(report.longrepr[0]))
    if not reasons:
        return
    terminalreporter.section("skipped, by reason")
    for why, where in sorted(reasons.items(), key=lambda item: -len(item[1])):
        files = sorted(set(where))
        shown = ", ".join(os.path.basename(f) for f in files[:3]) + (", ..." if len(files) > 3 else "")
        terminalreporter.write_line(f"{len(where)} skipped ({shown}): {why}")


@pytest.fixture(scope="session")
def fake_ascend_lib_dir() -> str:
    """The fake Ascend vendor libraries, built once per session. A failed build fails the ascend
    tests (the C++ compiler is always there): it must never turn into a skip."""
    try:
        return fake_ascend_dir()
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    pytest.fail(f"building the fake Ascend libraries (tests/fake_ascend/build.py) failed: {error}", pytrace=False)


def _cell(v: Variant, heavy: bool = False) -> Any:
    """One parameter of the matrix: heavy when asked, or when the cell is (Variant.heavy)."""
    return pytest.param(v, id=v.id, marks=[pytest.mark.heavy] if heavy or v.heavy else [])


@pytest.fixture(params=[_cell(v) for v in VARIANTS])
def variant(request: pytest.FixtureRequest) -> Variant:
    """Each data-movement test runs on every backend x data path (backend_env.VARIANTS): the CPU
    backend over direct memory access (cma) and over loopback TCP, and the Ascend backend over the
    fake vendor libraries, by HCCL, by IPC and by one-sided HCCL (those two with the heavy tests).
    Peers get their environment from ``variant.env()``."""
    v: Variant = request.param
    if v.same_host and not CMA_AVAILABLE:
        pytest.skip("process_vm_readv between sibling processes is not permitted on this machine")
    if v.backend == "ascend":
        request.getfixturevalue("fake_ascend_lib_dir")
    if v.needs_ucx:
        require_for_ucx(UCX_WHY_NOT)
    if v.hosts:
        request.getfixturevalue("test_hosts")
    return v


def require_for_ucx(why_not: str | None) -> None:
    """For a UCX test: skips it when ``why_not`` says what this machine lacks (UCX, pid namespaces),
    except under PDLINK_REQUIRE_UCX=1 (.ci/ucx.sh), where that is a failure."""
    if why_not is None:
        return
    if os.environ.get("PDLINK_REQUIRE_UCX") == "1":
        pytest.fail(f"PDLINK_REQUIRE_UCX=1 and {why_not}", pytrace=False)
    pytest.skip(why_not)


def only(*ids: str, heavy: tuple[str, ...] = ()) -> pytest.MarkDecorator:
    """Runs a test on these cells of the matrix only (a case that exists on one path), e.g.
    ``@only("cpu-cma")``; the cells keep their skip rules (cma not permitted here). Cells named in
    `heavy` run only with the heavy tests (``pytest -m heavy``), for a case that is slow there, as
    do the cells that are heavy themselves (Variant.heavy)."""
    chosen = [v for v in VARIANTS if v.id in ids]
    assert len(chosen) == len(ids) and set(heavy) <= set(ids), f"unknown variant in {ids} / {heavy}"
    return pytest.mark.parametrize("variant", [_cell(v, v.id in heavy) for v in chosen], indirect=True)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Tests of one engine's memory and local copies, and flows whose links do not depend on the
    CPU data path, run on the CPU backend and on the Ascend backend over the fakes. Peers get
    their environment from backend_env.peer_env(backend)."""
    if request.param == "ascend":
        request.getfixturevalue("fake_ascend_lib_dir")
    return str(request.param)


@pytest.fixture(scope="session")
def test_hosts() -> Iterator[Any]:
    """Four emulated hosts on a plain switch (profile "loopback": no shaping), one per peer of a
    test in a two-hosts cell (``Variant.hosts``); made once per test worker (tests/hostbed.py)."""
    with hostbed.bed(4) as hosts:
        yield hosts


@pytest.fixture
def peers(request: pytest.FixtureRequest) -> Iterator[Callable[..., Peer]]:
    """Factory for peer processes; every peer is killed at teardown. In a two-hosts cell
    (``Variant.hosts``) each peer runs on the next emulated host (the first on host 0, the second on
    host 1, ...), with the environment tests/peers/addr.py reads."""
    made: list[Peer] = []
    hosts = None
    if "variant" in request.fixturenames and request.getfixturevalue("variant").hosts:
        hosts = request.getfixturevalue("test_hosts")

    placed: dict[Peer, int] = {}

    def make(name: str = "peer", same_host_as: Peer | None = None, **kw: Any) -> Peer:
        """``same_host_as``: in a two-hosts cell, on that peer's host (a restart in its place)."""
        if hosts is not None:
            i = placed[same_host_as] if same_host_as is not None else len(placed) % len(hosts)
            kw["executable"] = hosts[i].python
            kw["env"] = {**(kw.get("env") or {}), **hostbed.env(hosts, i)}
        p = Peer(name, **kw)
        made.append(p)
        if hosts is not None:
            placed[p] = i
        return p

    yield make
    for p in made:
        p.close()


def reader(peer: Peer, name: str = "kv") -> Callable[[], Snapshot]:
    """Reads cache ``name`` of ``peer`` (peers.kv) whole: one side of ``verify.check_transfer``."""
    return lambda: peer.call(kv.snapshot, name)


def moved(src: tuple[Peer, str], dst: tuple[Peer, str], action: Callable[[], object],
          expect: Callable[[Snapshot, Snapshot], Snapshot]) -> object:
    """``action`` moves bytes from cache ``src`` = (peer, name) to ``dst``: the whole destination is
    what ``expect`` says and the source is unchanged (verify.check_transfer). Returns what ``action``
    returned."""
    return check_transfer(reader(*src), reader(*dst), action, expect)


def pulled(prefill: Peer, decode: Peer, src_blocks: Sequence[int], dst_blocks: Sequence[int] | None = None,
           key: BlocksCacheKey = PROMPT_KEY, name: str = "kv") -> None:
    """The decoder pulls ``src_blocks`` of the prompt's blocks cache ``key`` into ``dst_blocks`` (the
    same blocks unless given) of its cache ``name``: exactly those rows move."""
    dst = list(src_blocks if dst_blocks is None else dst_blocks)
    moved((prefill, name), (decode, name), lambda: decode.call(kv.pull_blocks, key, name, list(src_blocks), dst),
          rows(list(zip(src_blocks, dst))))


class Pair:
    """A listening PROMPT engine (cluster 1) and a DECODER engine (cluster 2) in two peer
    processes, not linked yet; their engines run ``tests/peers/kv.py``.

    ``port``: the prompt's listen port. ``timeout``: both sides' sync_kv_timeout (ms), unless
    ``prefill_timeout`` gives the prompt its own; ``prefill_env``/``decode_env`` add environment
    variables to one side (e.g. fault injection in the fakes); ``prefill_options`` adds init options
    to the prompt (e.g. ``{"pdlink.MaxLinks": "4"}``).
    """

    KEY = PROMPT_KEY

    def __init__(self, peers: Callable[..., Peer], variant: Variant, remote: bool = True,
                 timeout: int | None = None, pool: int | None = 1 << 22,
                 prefill_env: dict[str, str] | None = None, decode_env: dict[str, str] | None = None,
                 prefill_timeout: int | None = None, prefill_options: dict[str, str] | None = None):
        self.variant = variant
        self._env = {"prefill": variant.env(**(prefill_env or {})), "decode": variant.env(**(decode_env or {}))}
        self.prefill = peers("prefill", env=self._env["prefill"])
        self.decode = peers("decode", env=self._env["decode"])
        self.timeout = timeout
        self.port = self.prefill.call(kv.start, "prompt", PROMPT_ID, listen=True, remote=remote, pool=pool,
                                      timeout_ms=prefill_timeout or timeout, extra=prefill_options)
        self.decode.call(kv.start, "decoder", DECODER_ID, remote=remote, pool=pool, timeout_ms=timeout)

    def link(self) -> None:
        """Links decode to prefill; both report the variant's transport and backend, and the device
        paths their own settings give (Variant.device_paths)."""
        ret = self.decode.call(kv.link, PROMPT_ID, self.port)
        assert ret == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS]), ret
        for name, side in (("prefill", self.prefill), ("decode", self.decode)):
            assert {(link["transport"], tuple(link["device_paths"])) for link in side.call(kv.links)} == {
                (self.variant.host_transport(self._env[name]), self.variant.device_paths(self._env[name]))}
            assert side.call(kv.backend) == self.variant.backend

    def unlink(self, force: bool = False) -> LLMStatusCode:
        return self.decode.call(kv.unlink, PROMPT_ID, self.port, force)

    def pulled(self, src_blocks: Sequence[int], dst_blocks: Sequence[int] | None = None) -> None:
        """``pulled`` from the prompt's usual blocks cache ("kv", ``KEY``) into the decoder's."""
        pulled(self.prefill, self.decode, src_blocks, dst_blocks, self.KEY)


@pytest.fixture
def make_pair(peers: Callable[..., Peer], variant: Variant) -> Callable[..., Pair]:
    return lambda **kw: Pair(peers, variant, **kw)


@pytest.fixture
def pair(make_pair: Callable[..., Pair]) -> Pair:
    return make_pair()
