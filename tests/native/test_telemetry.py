"""Telemetry (docs/metrics.md): what an engine counts of its transfers and links, read as
``Engine.stats()`` and as Prometheus families, on every backend and data path.

Each transfer test moves known blocks and ranges between real processes and checks, besides the
whole destination, the exact counts the initiator recorded: transfers, bytes and descriptors of
the completed ones under the path that moved them, each failure under its code and stage, and
histograms whose sums agree with the wall time measured around the calls."""

from __future__ import annotations

import functools
import socket
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import pdlink
import rawwire
from backend_env import Variant
from conftest import only
from internals import parse_engine_options
from pdlink.metrics import EngineCollector
from peer import Peer
from peers import hostile, kv, native, telemetry
from poll import wait_until
from ports import free_block
from review_kit import PING
from verify import Copy, assert_same

ROW = 4096
ROWS = 8
NO_SUCH_PEER = 77


def prefill_and_decode(peers: Callable[..., Peer], variant: Variant, *, env: dict[str, str] | None = None
                       ) -> tuple[Peer, Peer, int]:
    """A prefill process (cluster 1, listening, region "src" keyed 5) and a decode process (cluster
    2, region "dst" of zeros) linked to it; the decode's id for the prefill."""
    p = peers("prefill", env=variant.env())
    port = p.call(native.start, 1, listen=True)
    p.call(native.register, "src", ROWS, ROW, seed=1, key=5)
    d = peers("decode", env={**variant.env(), **(env or {})})
    d.call(native.start, 2)
    d.call(native.register, "dst", ROWS, ROW, seed=None)
    return p, d, d.call(native.connect, port)


def one_path(stats: Any) -> str:
    paths = {t.path for t in stats.transfers}
    assert len(paths) == 1, stats.transfers
    return paths.pop()


def series(stats: Any, op: str) -> Any:
    (t,) = [t for t in stats.transfers if t.op == op]
    return t


def test_exact_counts_after_known_transfers(peers: Callable[..., Peer], variant: Variant) -> None:
    """A prepared read of 3 blocks and one of 1, a prepared write of 1 block, a descriptor read of
    100 bytes; then a read the peer refuses (a remote block past its region: stage ``served``), one
    refused here (a local block out of range: ``admission``) and one to a peer never linked
    (``LLM_NOT_YET_LINK``, path ``none``, peer ``other``). Counted: 3 pulls of 4 * 4096 + 100 bytes and 5
    descriptors, 1 push of 4096 bytes and 1 descriptor, and exactly those three failures."""
    p, d, peer = prefill_and_decode(peers, variant)
    src, dst = p.call(native.snapshot, "src"), d.call(native.snapshot, "dst")
    d.call(native.prepare, "t", peer, "dst", p.call(native.remote, "src"))
    before = d.call(telemetry.stats)
    wall = d.call(telemetry.post, "t", [0, 1, 2], [5, 6, 7], "read")
    wall += d.call(telemetry.post, "t", [4], [3], "read")
    push_wall = d.call(telemetry.post, "t", [6], [0], "write")
    address = p.call(native.addresses, "src")[0]
    wall += d.call(telemetry.descriptors, peer, "dst", [(5 * ROW + 8, 100)], [(address + 7 * ROW, 100)], "read")
    assert d.call(telemetry.failing, "post", "t", [0], [ROWS + 4], "read") == "LLM_PARAM_INVALID"
    assert d.call(telemetry.failing, "post", "t", [ROWS], [0], "read") == "LLM_PARAM_INVALID"
    assert d.call(telemetry.failing, "descriptors", NO_SUCH_PEER, "dst", [(0, 64)], [(address, 64)], "read") \
        == "LLM_NOT_YET_LINK"
    delta = d.call(telemetry.stats) - before

    rows = [(5, 0), (6, 1), (7, 2), (3, 4)]
    expected = dst.with_rows(src, rows).with_bytes(src, [Copy(0, 7 * ROW, 0, 5 * ROW + 8, 100)])
    assert_same(d.call(native.snapshot, "dst"), expected, "the decode region")
    assert_same(p.call(native.snapshot, "src"), src.with_rows(dst, [(6, 0)]), "the prefill region")

    path = one_path(delta)
    link = d.call(native.links)[0]
    assert path in (link.transport, *link.device_paths), (path, link)
    pulls, pushes = series(delta, "pull"), series(delta, "push")
    assert (pulls.peer, pulls.transfers, pulls.bytes, pulls.descriptors) == (str(peer), 3, 4 * ROW + 100, 5)
    assert (pushes.peer, pushes.transfers, pushes.bytes, pushes.descriptors) == (str(peer), 1, ROW, 1)
    assert {(f.peer, f.path, f.op, f.code, f.stage, f.count) for f in delta.failures} == {
        (str(peer), path, "pull", "LLM_PARAM_INVALID", "served", 1),
        (str(peer), link.transport, "pull", "LLM_PARAM_INVALID", "admission", 1),
        ("other", "none", "pull", "LLM_NOT_YET_LINK", "admission", 1)}  # never linked: no label of its own
    # Histograms: one observation per completed transfer and stage; queue + wire is total (one clock,
    # three points); the total inside what the caller measured around its calls.
    for s, count, measured in ((pulls, 3, wall), (pushes, 1, push_wall)):
        for h in (s.queue, s.wire, s.total):
            assert h.count == count and sum(h.buckets) == count and len(h.buckets) == len(pdlink.LATENCY_BOUNDS) + 1
        assert s.queue.sum + s.wire.sum == pytest.approx(s.total.sum, abs=1e-6)
        assert 0 < s.total.sum <= measured


def test_link_events_count_each_up_down_and_reconnect_with_its_reason(peers: Callable[..., Peer],
                                                                      variant: Variant) -> None:
    """The decode links, unlinks and links again; then the prefill closes. The decode counts 2 ups,
    1 reconnect, a down ``unlinked`` and a down for the prefill's close: ``peer_unlinked`` when it
    read the prefill's notice first, ``failed`` when the streams closed under it first (a closing
    engine tells its peers best effort, without waiting: docs/metrics.md); the prefill the same ups
    and a down ``peer_unlinked`` and ``finalized``."""
    p, d, peer = prefill_and_decode(peers, variant)
    port = p.call(native.listen_port)
    d.call(native.disconnect, peer)
    assert d.call(native.connect, port) == peer
    p.call(native.close)

    def events(stats: Any) -> set[tuple[str, str, str, int]]:
        return {(e.peer, e.event, e.reason, e.count) for e in stats.link_events}

    def downs() -> int:
        return sum(e.count for e in d.call(telemetry.stats).link_events if e.event == "down")

    wait_until(lambda: downs() == 2, 20, "the decode to see the prefill's end")
    seen = events(d.call(telemetry.stats))
    known = {(str(peer), "up", "", 2), (str(peer), "reconnect", "", 1), (str(peer), "down", "unlinked", 1)}
    assert known <= seen and seen - known in ({(str(peer), "down", "peer_unlinked", 1)},
                                              {(str(peer), "down", "failed", 1)}), seen
    assert events(p.call(telemetry.stats)) == {("2", "up", "", 2), ("2", "reconnect", "", 1),
                                               ("2", "down", "peer_unlinked", 1), ("2", "down", "finalized", 1)}


@only("cpu-cma")
def test_pinned_bytes_count_the_regions_a_direct_access_pins_until_the_peers_next_frame(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """A same-host raw peer's direct read of 1000 runs (the same 64 bytes, repeated) pins the region
    (4 blocks of 4096 bytes) until the peer's next frame: ``pinned_bytes`` is the region's 16384
    bytes, not the 64000 the runs name; then 0."""
    victim = peers("victim", env=variant.env())
    port = victim.call(native.start, 1, listen=True)
    victim.call(native.register, "src", 4, ROW, seed=1, key=7)
    assert victim.call(telemetry.stats).pinned_bytes == 0
    a = peers("attacker")
    assert a.call(hostile.link_raw, port, 9, b"", a.call(hostile.redirect_name, port, 9)) == (0, "")
    body = rawwire.blocks_body(model=7, runs=((3 * ROW, 64),) * 1000)
    answer = a.call(hostile.exchange, rawwire.request(rawwire.OP_READ, body, flags=rawwire.FLAG_DIRECT))
    assert isinstance(answer, tuple) and answer[0] == 0, answer
    wait_until(lambda: victim.call(telemetry.stats).pinned_bytes == 4 * ROW, 20, "the region pinned")
    assert a.call(hostile.exchange, PING) == (0, "", b"")
    wait_until(lambda: victim.call(telemetry.stats).pinned_bytes == 0, 20, "the pin released")


@only("cpu-tcp")
def test_peers_past_the_cap_are_counted_as_other(peers: Callable[..., Peer], variant: Variant) -> None:
    """An engine with ``max_metric_peers=2`` reads a block from each of 4 linked peers: the first two
    peers it met have series of their own, the other two are counted together as ``other``."""
    hub = peers("hub", env=variant.env())
    port = hub.call(native.start, 100, listen=True, limits={"max_metric_peers": 2})
    hub.call(native.register, "dst", ROWS, ROW, seed=None)
    sources = []
    for i in range(4):
        s = peers(f"source{i}", env=variant.env())
        s.call(native.start, 10 + i)
        s.call(native.register, "src", ROWS, ROW, seed=10 + i, key=5)
        assert s.call(native.connect, port) == 100
        wait_until(functools.partial(_links_are, hub, i + 1), 20, "the hub to accept the link")
        sources.append(s)
    dst = hub.call(native.snapshot, "dst")
    for i, s in enumerate(sources):
        hub.call(telemetry.read_peer, 10 + i, f"from{i}", "dst", s.call(native.remote, "src"), 1)
    assert_same(hub.call(native.snapshot, "dst"), dst.with_rows(sources[-1].call(native.snapshot, "src"), [(0, 0)]),
                "the hub's region: block 0 from the last source")
    stats = hub.call(telemetry.stats)
    assert sorted((t.peer, t.transfers) for t in stats.transfers) == [("10", 1), ("11", 1), ("other", 2)]
    assert sorted((e.peer, e.count) for e in stats.link_events if e.event == "up") == [
        ("10", 1), ("11", 1), ("other", 2)]


def _answers(port: int) -> bool:
    try:
        return ("pdlink_role_epoch", (("engine", "2"),)) in _scrape(port)
    except OSError:
        return False


def _links_are(peer: Peer, n: int) -> bool:
    return len(peer.call(native.links)) == n


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint, parsed by prometheus_client's own parser: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@only("cpu-tcp", "cpu-cma")
def test_an_llm_datadist_program_serves_its_engines_metrics_over_http(peers: Callable[..., Peer],
                                                                      variant: Variant) -> None:
    """A decode that only uses ``llm_datadist``, with the option ``pdlink.Metrics`` =
    ``127.0.0.1:0``, pulls 2 blocks: its endpoint (scraped over HTTP, parsed by prometheus_client)
    reports that pull under its engine's cluster id, as its ``stats()`` does."""
    from llm_datadist import BlocksCacheKey, DataType

    p = peers("prefill", env=variant.env())
    port = p.call(kv.start, "prompt", 0, listen=True)
    p.call(kv.register_blocks, "kv", 2, (4, 256), DataType.DT_FLOAT, seed=1, key=BlocksCacheKey(0, 0))
    d = peers("decode", env=variant.env())
    d.call(kv.start, "decoder", 1, extra={"pdlink.Metrics": "127.0.0.1:0"})
    d.call(kv.register_blocks, "kv", 2, (4, 256), DataType.DT_FLOAT, seed=2)
    assert d.call(kv.link, 0, port)[0] == 0
    src, dst = p.call(kv.snapshot, "kv"), d.call(kv.snapshot, "kv")
    d.call(kv.pull_blocks, BlocksCacheKey(0, 0), "kv", [1, 3], [0, 2])
    assert_same(d.call(kv.snapshot, "kv"), dst.with_rows(src, [(1, 0), (3, 2)]), "the decode cache")
    samples = _scrape(d.call(telemetry.metrics_port))
    path = d.call(kv.links)[0]["transport"]
    labels = (("engine", "1"), ("op", "pull"), ("path", path), ("peer", "0"))
    assert samples[("pdlink_transfers_total", labels)] == 1
    assert samples[("pdlink_transfer_bytes_total", labels)] == 2 * 2 * 1024  # 2 blocks x 2 tensors x 1 KiB
    assert samples[("pdlink_transfer_descriptors_total", labels)] == 4
    assert samples[("pdlink_transfer_seconds_count", (*labels[:3], ("peer", "0"), ("stage", "total")))] == 1
    assert samples[("pdlink_links", (("engine", "1"), ("path", path)))] == 1
    assert samples[("pdlink_link_events_total", (("engine", "1"), ("event", "up"), ("peer", "0"), ("reason", "")))] \
        == 1


def test_the_environment_variable_starts_one_endpoint_per_process(peers: Callable[..., Peer]) -> None:
    """``PDLINK_METRICS=127.0.0.1:P`` in two processes (as a TP group's ranks inherit it): the first
    serves on P, the second on P + 1, each its own engine, labelled ``engine``; with it unset no
    endpoint starts."""
    base = free_block(2)
    ranks = [peers(f"rank{i}", env={"PDLINK_METRICS": f"127.0.0.1:{base}"}) for i in range(2)]
    for i, rank in enumerate(ranks):
        rank.call(native.start, 20 + i)
        assert rank.call(telemetry.metrics_port) == base + i
    for i in range(2):
        samples = _scrape(base + i)
        assert samples[("pdlink_role_epoch", (("engine", str(20 + i)),))] == 0
        assert {labels for name, labels in samples if name == "pdlink_engine_threads"} == {(("engine", str(20 + i)),)}
    plain = peers("plain")
    plain.call(native.start, 3)
    assert plain.call(_metrics_running) is False


def test_idle_connections_to_the_endpoint_cost_the_process_no_threads_or_descriptors(
        peers: Callable[..., Peer]) -> None:
    """12 connections to the process endpoint (within its backlog of 16), each stopping mid request
    line (a slowloris): the process gains at most the one connection being served (a descriptor and
    a timer thread), never one per connection; once they close, scrapes are answered again. The
    baseline is taken once the endpoint has closed the first scrape's connection (which it may do
    after the client has read the answer)."""
    d = peers("decode", env={"PDLINK_METRICS": "127.0.0.1:0"})
    d.call(native.start, 2)
    port = d.call(telemetry.metrics_port)
    assert ("pdlink_role_epoch", (("engine", "2"),)) in _scrape(port)
    wait_until(lambda: d.call(telemetry.served_connections, port) == 0, 20, "the first scrape's connection closed")
    threads, fds = d.call(telemetry.threads_and_descriptors)
    idle = []
    for _ in range(12):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /metr")
        idle.append(s)
    wait_until(lambda: d.call(telemetry.served_connections, port) == 1, 20, "the endpoint to take a connection")
    for _ in range(3):
        now_threads, now_fds = d.call(telemetry.threads_and_descriptors)
        assert now_threads <= threads + 1 and now_fds <= fds + 1, (threads, fds, now_threads, now_fds)
        assert d.call(telemetry.served_connections, port) <= 1
    for s in idle:
        s.close()
    wait_until(lambda: _answers(port), 60, "a scrape answered again")


def test_the_llm_datadist_metrics_option_is_checked_at_init() -> None:
    """``pdlink.Metrics`` takes ``PORT`` or ``HOST:PORT``; anything else is ``LLM_PARAM_INVALID``
    before an engine or an endpoint exists."""
    assert parse_engine_options({"pdlink.Metrics": "127.0.0.1:9400"})["metrics"] == "127.0.0.1:9400"
    assert parse_engine_options({})["metrics"] is None
    for bad in ("127.0.0.1:x", "9400000", "host:"):
        with pytest.raises(pdlink.LLMException) as e:
            parse_engine_options({"pdlink.Metrics": bad})
        assert e.value.status_code == pdlink.LLMStatusCode.LLM_PARAM_INVALID and "pdlink.Metrics" in str(e.value)


def _metrics_running() -> bool:
    return pdlink.Metrics.running() is not None


def test_a_delta_keeps_gauges_and_subtracts_counts_and_a_collector_exports_one_engine() -> None:
    """``later - earlier``: counts and histograms as differences, gauges as in ``later``; and
    ``EngineCollector(engine)`` in a registry of the test's own, rendered and parsed back."""
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=1, listen="127.0.0.1:0")) as a, \
            pdlink.Engine(pdlink.EngineOptions(cluster_id=2, transport="tcp")) as b:
        src, dst = np.arange(4 * ROW, dtype=np.uint8), np.zeros(4 * ROW, dtype=np.uint8)
        ra, rb = a.register(src, block_size=ROW), b.register(dst, block_size=ROW)
        peer = b.connect(f"127.0.0.1:{a.listen_port}")
        job = b.prepare(peer, rb, ra.remote())
        job.read([0], [1])
        first = b.stats()
        job.read([2, 3], [2, 3])
        later = b.stats()
        delta = later.since(first)
        assert delta == later - first
        assert (series(delta, "pull").transfers, series(delta, "pull").bytes) == (1, 2 * ROW)
        assert series(later, "pull").transfers == 2 and series(delta, "pull").total.count == 1
        assert delta.live_links == later.live_links == 1 and delta.links_by_path == (("tcp", 1),)
        assert delta.taken_at == later.taken_at > first.taken_at
        assert np.array_equal(dst[ROW:2 * ROW], np.zeros(ROW, np.uint8))
        assert np.array_equal(dst[:ROW], src[ROW:2 * ROW]) and np.array_equal(dst[2 * ROW:], src[2 * ROW:])
        # one engine in any registry: its families without a label of the collector's own
        registry = CollectorRegistry()
        registry.register(EngineCollector(b))
        samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
                   for family in text_string_to_metric_families(generate_latest(registry).decode())
                   for x in family.samples}
        pulled = (("op", "pull"), ("path", "tcp"), ("peer", "1"))
        assert samples[("pdlink_transfers_total", pulled)] == 2
        assert samples[("pdlink_transfer_bytes_total", pulled)] == 3 * ROW
        assert samples[("pdlink_transfer_seconds_count", (*pulled, ("stage", "wire")))] == 2
        assert samples[("pdlink_links", (("path", "tcp"),))] == 1
