"""Load: many links on one engine with concurrent pulls, on every data path, and thousands of
link/unlink cycles with flat memory (docs/reliability.md, "Load"). Bounded in count and time.

* ``test_64_links_on_one_engine_with_concurrent_pulls``: 4 processes x 16 native engines = 64
  links to one prompt engine; each of the 64 engines pulls 16 times (4 blocks each, all 8 blocks
  covered) on its own thread, all at once; every destination is then the source, whole, guards
  intact; on cpu-tcp, cpu-cma and ascend-fake.
* ``test_10000_link_unlink_cycles_keep_memory_flat``: 500 warm-up plus 9,500 link/unlink cycles of
  one native engine against a prompt over TCP; both processes' descriptors and threads equal
  before and after (read once both engines are at rest), resident memory within 4 MiB.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable

import pytest

from backend_env import Variant
from conftest import PROMPT_ID
from llm_datadist import BlocksCacheKey, DataType
from peer import Peer
from peers import kv, load
from poll import wait_until
from verify import assert_same

pytestmark = pytest.mark.heavy  # CI runs these with `pytest -m heavy`; the default run leaves them out

GROUPS, PER_GROUP, PULLS = 4, 16, 16


def test_64_links_on_one_engine_with_concurrent_pulls(peers: Callable[..., Peer], variant: Variant) -> None:
    p = peers("prefill", env=variant.env())
    port = p.call(kv.start, "prompt", PROMPT_ID, listen=True)
    p.call(kv.register_blocks, "kv", 2, load.SHAPE, DataType.DT_UINT8, seed=5, key=BlocksCacheKey(PROMPT_ID, 0))
    source = p.call(kv.snapshot, "kv")
    groups = []
    for g in range(GROUPS):
        d = peers(f"decoders{g}", env=variant.env())
        d.call_within(120, load.start_engines, PER_GROUP, 100 + PER_GROUP * g)
        assert d.call_within(120, load.link_all, port) == [0] * PER_GROUP
        groups.append(d)
    assert len(p.call(kv.links)) == GROUPS * PER_GROUP
    before = [d.call(load.snapshots) for d in groups]
    # all 64 engines pull at once: each group's threads start as soon as its call arrives
    with concurrent.futures.ThreadPoolExecutor(GROUPS) as pool:
        futures = [pool.submit(d.call_within, 300, load.pull_concurrently, PULLS, 240) for d in groups]
        errors = [f.result() for f in futures]
    assert errors == [[]] * GROUPS, errors
    for d, snaps0 in zip(groups, before):
        for i, (now, dst0) in enumerate(zip(d.call(load.snapshots), snaps0)):
            assert_same(now, dst0.with_rows(source, [(b, b) for b in range(load.SHAPE[0])]), f"engine {i}")
    assert_same(p.call(kv.snapshot, "kv"), source, "the prompt's cache")
    for d in groups:
        d.call(load.finalize_all)
    # the decoders' finalize reaches the prefill asynchronously (an unlink frame, or the close)
    wait_until(lambda: all(link["broken"] for link in p.call(kv.links)), 30, "the prefill saw every decoder go")


@pytest.mark.skipif(bool(os.environ.get("PDLINK_SANITIZER")),
                    reason="resident memory is meaningless under a sanitizer (quarantine, shadow memory); "
                           ".ci/sanitizers.sh checks leaks with LeakSanitizer instead")
def test_10000_link_unlink_cycles_keep_memory_flat(peers: Callable[..., Peer]) -> None:
    p = peers("prefill", env={"PDLINK_TRANSPORT": "tcp"})
    port = p.call(kv.start, "prompt", PROMPT_ID, listen=True)
    d = peers("decoder", env={"PDLINK_TRANSPORT": "tcp"})
    d.call(load.start_engines, 1, 2)

    def quiet() -> bool:
        """Both engines at rest: no link, no handshake, no engine thread still running."""
        idle = {"live_links": 0, "handshakes": 0, "threads": 0}
        return all({k: st[k] for k in idle} == idle for st in (p.call(kv.stats), d.call(load.first_engine_stats)))

    def state() -> tuple[int, tuple[int, int], int, tuple[int, int]]:
        return d.call(kv.rss_kib), d.call(kv.resources), p.call(kv.rss_kib), p.call(kv.resources)

    d.call_within(120, load.cycles, port, 500)  # warm-up: allocator pools, thread stacks
    wait_until(quiet, 30, "both engines at rest after the warm-up")
    before = state()
    t0 = time.monotonic()
    d.call_within(300, load.cycles, port, 9500)
    took = time.monotonic() - t0
    wait_until(quiet, 30, "both engines at rest after the cycles")  # the prefill's handshake threads end
    after = state()
    assert after[1] == before[1] and after[3] == before[3], (before, after)  # fds and threads
    assert after[0] - before[0] < 4096 and after[2] - before[2] < 4096, (before, after)  # < 4 MiB RSS growth
    assert p.call(kv.links) == []
    print(f"9500 link/unlink cycles in {took:.1f} s; RSS decoder {before[0]}->{after[0]} KiB, "
          f"prefill {before[2]}->{after[2]} KiB")
