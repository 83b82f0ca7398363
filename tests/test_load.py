"""Load: many links on one engine with concurrent pulls, and thousands of link/unlink cycles with
flat memory (issue: reliability and security, item 5). Bounded in count and time."""

from __future__ import annotations

import os
import time

import pytest

from poll import wait_until

pytestmark = pytest.mark.heavy  # CI runs these with `pytest -m heavy`; the default run leaves them out

# Many native engines in one process (llm_datadist allows one LLMDataDist per process; the engine
# itself has no such limit), each wrapped in pdlink's CacheManager for the llm_datadist calls.
ENGINES = """
import os, threading, types
from pdlink import _core
from pdlink.cache_manager import CacheManager
owner = types.SimpleNamespace(_is_call_linked=False)
engines, managers, caches, arrays = [], [], [], []
for i in range({count}):
    e = _core.Engine("cpu")
    e.initialize({first} + i, 2, "", 0, 30000, 0, 16, 0, 16, 5000, transport={transport})
    cm = CacheManager(owner, e, True, {{}})
    a = zeros(2, (8, 512), dtype=np.uint8)
    caches.append(cm.register_blocks_cache(CacheDesc(2, [8, 512], DataType.DT_UINT8), addrs(a)))
    engines.append(e); managers.append(cm); arrays.append(a)
"""


def test_64_links_on_one_engine_with_concurrent_pulls(peers):
    p = peers("prefill", env={"PDLINK_TRANSPORT": "tcp"})
    p.exec("dd = LLMDataDist(LLMRole.PROMPT, 1); dd.init(options(listen='127.0.0.1:0')); cm = dd.cache_manager\n"
           "src = tensors(2, (8, 512), seed=5, dtype=np.uint8)\n"
           "cache = cm.register_blocks_cache(CacheDesc(2, [8, 512], DataType.DT_UINT8), addrs(src), "
           "BlocksCacheKey(1, 0))")
    port = p.eval("dd.listen_port")
    expected = p.eval("[a.tobytes() for a in src]")
    groups = []
    for g in range(4):  # 4 processes x 16 engines = 64 links to the one prefill engine
        d = peers(f"decoders{g}")
        d.exec(ENGINES.format(count=16, first=100 + 16 * g, transport=1))
        ret = d.eval(f"[e.link([(1, '127.0.0.1', {port})], 10000)[0][0] for e in engines]", timeout=60)
        assert ret == [0] * 16, ret
        groups.append(d)
    assert len(p.eval("dd.links()")) == 64
    # every decoder engine pulls on its own thread for a bounded time, then checks the bytes
    for d in groups:
        d.exec("""
import time
errors, counts = [], [0] * len(managers)
def worker(i):
    try:
        while time.monotonic() < stop:
            blocks = [(counts[i] + k) % 8 for k in range(4)]
            managers[i].pull_blocks(BlocksCacheKey(1, 0), caches[i], blocks, blocks)
            counts[i] += 1
    except Exception as e:
        errors.append(repr(e))
stop = time.monotonic() + 2.0
threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(managers))]
for t in threads: t.start()
""")
    for d in groups:
        d.exec("for t in threads: t.join(30)")
        assert d.eval("errors") == []
        assert min(d.eval("counts")) > 0
        assert d.eval("[[a.tobytes() for a in arr] for arr in arrays]") == [expected] * 16
    for d in groups:
        d.exec("for e in engines: e.finalize()")
    # the decoders' finalize reaches the prefill asynchronously (an unlink frame, or the close)
    wait_until(lambda: all(link["broken"] for link in p.eval("dd.links()")), 30,
               "the prefill saw every decoder go")


@pytest.mark.skipif(bool(os.environ.get("PDLINK_SANITIZER")),
                    reason="resident memory is meaningless under a sanitizer (quarantine, shadow memory); "
                           ".ci/sanitizers.sh checks leaks with LeakSanitizer instead")
def test_10000_link_unlink_cycles_keep_memory_flat(peers):
    p = peers("prefill", env={"PDLINK_TRANSPORT": "tcp"})
    p.exec("dd = LLMDataDist(LLMRole.PROMPT, 1); dd.init(options(listen='127.0.0.1:0'))\n"
           "def rss_kib():\n"
           "    return int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1])")
    port = p.eval("dd.listen_port")
    d = peers("decoder")
    d.exec(ENGINES.format(count=1, first=2, transport=1) + """
def cycles(n):
    e = engines[0]
    for _ in range(n):
        assert e.link([(1, '127.0.0.1', %d)], 5000)[0][0] == 0
        assert e.unlink([1], 5000, False)[0][0] == 0
def rss_kib():
    return int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1])
""" % port)
    def quiet() -> bool:
        """Both engines at rest: no link, no handshake, no engine thread still running."""
        idle = {"live_links": 0, "handshakes": 0, "threads": 0}
        return all({k: st[k] for k in idle} == idle
                   for st in (p.eval("dd._engine.stats()"), d.eval("engines[0].stats()")))

    d.exec("cycles(500)", timeout=120)  # warm-up: allocator pools, thread stacks
    wait_until(quiet, 30, "both engines at rest after the warm-up")
    before = (d.eval("rss_kib()"), d.eval("resources()"), p.eval("rss_kib()"), p.eval("resources()"))
    t0 = time.monotonic()
    d.exec("cycles(9500)", timeout=300)
    took = time.monotonic() - t0
    wait_until(quiet, 30, "both engines at rest after the cycles")  # the prefill's handshake threads end
    after = (d.eval("rss_kib()"), d.eval("resources()"), p.eval("rss_kib()"), p.eval("resources()"))
    assert after[1] == before[1] and after[3] == before[3], (before, after)  # fds and threads
    assert after[0] - before[0] < 4096 and after[2] - before[2] < 4096, (before, after)  # < 4 MiB RSS growth
    assert p.eval("dd.links()") == []
    print(f"9500 link/unlink cycles in {took:.1f} s; RSS decoder {before[0]}->{after[0]} KiB, "
          f"prefill {before[2]}->{after[2]} KiB")
