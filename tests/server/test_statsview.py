"""``pdlink stats``: a live view of a pdlink metrics endpoint, checked against a real
prometheus_client registry served on loopback (prometheus_client's own HTTP server, in a thread)
holding known values: exact transfer counts, bytes, latency percentiles estimated from known
buckets as Prometheus' ``histogram_quantile`` does, failures with their top code, the column of
extra labels, the footer of links and link events; the live view's second frame shows only what
happened between two scrapes (the scrapes are driven by a hook, nothing sleeps); a dead port, an
HTTP error and a body that is not Prometheus text are one line on stderr and exit status 1.

A hostile endpoint (local servers that misbehave on purpose) is one line and exit status 1 too, or
a table that is safe to print: values that are not finite or overflow, a Content-Length of 2**62, a
chunk of 2**64 - 1 bytes, an endless body, headers or a body dripped a byte at a time (one deadline
for the whole scrape), more samples than are read, redirects (not followed), broken HTTP; label
values holding terminal escapes are printed with ``?`` in place of each control character, and at
most ``MAX_ROWS`` rows are printed."""

from __future__ import annotations

import http.client
import io
import math
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from pdlink import statsview  # noqa: E402
from pdlink.cli import main  # noqa: E402

BUCKETS = (0.001, 0.01, 0.1, 1.0)
MiB = 1 << 20


class Endpoint:
    """The metric families pdlink serves, with a leading ``device`` label (as ``pdlink serve``'s),
    in a registry of their own, served on 127.0.0.1 at ``port``."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        row = ["device", "peer", "path", "op"]
        self.transfers = Counter("pdlink_transfers", "transfers", row, registry=r)
        self.bytes = Counter("pdlink_transfer_bytes", "bytes", row, registry=r)
        self.descriptors = Counter("pdlink_transfer_descriptors", "descriptors", row, registry=r)
        self.latency = Histogram("pdlink_transfer_seconds", "latency", row + ["stage"], buckets=BUCKETS, registry=r)
        self.failures = Counter("pdlink_transfer_failures", "failures", row + ["code", "stage"], registry=r)
        self.links = Gauge("pdlink_links", "links", ["device", "path"], registry=r)
        self.link_events = Counter("pdlink_link_events", "link events", ["device", "peer", "event", "reason"],
                                   registry=r)
        self.server, self.thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=r)
        self.port = self.server.server_address[1]
        self.target = f"127.0.0.1:{self.port}"

    def fill(self) -> None:
        """Device 0 pulled 1.5 GiB from cluster 2 over tcp in 5 transfers of known latency (3 x 5 ms,
        50 ms, 500 ms: p50 8.5 ms, p90 550 ms, p99 955 ms by interpolation in BUCKETS), 3 timeouts
        and a link failure; device 1 pushed 2 KiB to "other" over cma in 2 transfers, no latency
        observed, 2 timeouts."""
        pull = ("0", "2", "tcp", "pull")
        self.transfers.labels(*pull).inc(5)
        self.bytes.labels(*pull).inc(3 * 512 * MiB)
        self.descriptors.labels(*pull).inc(40)
        for value in (0.005, 0.005, 0.005, 0.05, 0.5):
            self.latency.labels(*pull, "total").observe(value)
            self.latency.labels(*pull, "wire").observe(value / 2)  # other stages are not shown
        self.latency.labels(*pull, "queue").observe(5.0)
        self.failures.labels(*pull, "LLM_TIMEOUT", "payload").inc(2)
        self.failures.labels(*pull, "LLM_TIMEOUT", "request").inc(1)
        self.failures.labels(*pull, "LLM_LINK_FAILED", "commit").inc(1)
        push = ("1", "other", "cma", "push")
        self.transfers.labels(*push).inc(2)
        self.bytes.labels(*push).inc(2048)
        self.failures.labels(*push, "LLM_TIMEOUT", "admission").inc(2)
        self.links.labels("0", "tcp").set(2)
        self.links.labels("1", "cma").set(1)
        self.links.labels("1", "ucx").set(0)
        self.link_events.labels("0", "2", "up", "").inc(3)
        self.link_events.labels("0", "2", "down", "LLM_TIMEOUT").inc(1)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    e = Endpoint()
    yield e
    e.close()


def cells(line: str) -> list[str]:
    """A table line's cells (columns are two or more spaces apart)."""
    return re.split(r"\s{2,}", line.strip())


def table(text: str) -> list[list[str]]:
    """The header and rows of the first frame in ``text`` (after its title line, before its footer)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("LABELS") or
                 line.startswith("PEER"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(("links:", "(no transfers")))
    return [cells(line) for line in lines[start:end]]


HEADER = ["LABELS", "PEER", "PATH", "OP", "TRANSFERS", "BYTES", "GB/s", "P50 ms", "P90 ms", "P99 ms", "FAILURES"]


def test_once_prints_the_cumulative_table(endpoint: Endpoint, capsys: pytest.CaptureFixture[str]) -> None:
    endpoint.fill()
    assert main(["stats", endpoint.target, "--once"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    gbps = f"{3 * 512 * MiB / (0.015 + 0.05 + 0.5) / 1e9:.2f}"  # bytes over the summed total latency
    assert gbps == "2.85"
    assert table(out) == [
        HEADER,
        ["device=0", "2", "tcp", "pull", "5", "1.5 GiB", gbps, "8.500", "550.0", "955.0", "4 LLM_TIMEOUT:3 +1"],
        ["device=1", "other", "cma", "push", "2", "2.0 KiB", "-", "-", "-", "-", "2 LLM_TIMEOUT"],
    ]
    lines = out.splitlines()
    assert lines[0].startswith(f"pdlink stats http://127.0.0.1:{endpoint.port}/metrics ")
    assert "since start (cumulative)" in lines[0]
    assert lines[-1] == "links: tcp 2, cma 1 (3) | link events: down 1 (LLM_TIMEOUT 1), up 3"
    assert "\x1b[" not in out  # one table, no screen control


def test_a_full_url_and_no_transfers_yet(endpoint: Endpoint, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", f"http://127.0.0.1:{endpoint.port}/metrics", "--once"]) == 0
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    assert cells(lines[1]) == HEADER[1:]  # no row has extra labels: no LABELS column
    assert lines[2:] == ["(no transfers)", "links: none | link events: none"]


def test_the_live_view_shows_the_interval(endpoint: Endpoint) -> None:
    endpoint.fill()
    waits: list[float] = []

    def between_scrapes(seconds: float) -> None:  # in place of sleeping: what happens in the interval
        waits.append(seconds)
        pull = ("0", "2", "tcp", "pull")
        endpoint.transfers.labels(*pull).inc(2)
        endpoint.bytes.labels(*pull).inc(MiB)
        for _ in range(2):
            endpoint.latency.labels(*pull, "total").observe(0.05)
        endpoint.failures.labels(*pull, "LLM_TIMEOUT", "payload").inc()
        endpoint.link_events.labels("0", "2", "up", "").inc()
        endpoint.links.labels("0", "tcp").set(3)

    out = io.StringIO()
    rc = statsview.run(f"http://127.0.0.1:{endpoint.port}/metrics", interval=0.25, count=2, out=out,
                       wait=between_scrapes)
    assert rc == 0 and waits == [0.25]
    first, second = out.getvalue().split("\n\n")
    assert table(first)[1][:6] == ["device=0", "2", "tcp", "pull", "5", "1.5 GiB"]  # cumulative
    title, *rest = second.splitlines()
    assert re.search(r" last \d+\.\d s, 1 idle rows hidden$", title), title
    rows = table(second)
    assert len(rows) == 2  # the header and the one row that moved; device 1 was idle
    # 2 transfers of 50 ms in the interval: both in the (10 ms, 100 ms] bucket, p50 55 ms
    assert rows[1][:6] + rows[1][7:] == ["device=0", "2", "tcp", "pull", "2", "1.0 MiB", "55.0", "91.0", "99.1",
                                         "1 LLM_TIMEOUT"]
    assert rest[-1] == "links: tcp 3, cma 1 (4) | link events: up 1"
    assert "\x1b[" not in out.getvalue()  # not a terminal: no screen control


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_is_cleared_before_each_frame_and_ctrl_c_ends_with_0(endpoint: Endpoint) -> None:
    endpoint.fill()
    seen: list[int] = []

    def ctrl_c_on_the_third(seconds: float) -> None:
        seen.append(1)
        if len(seen) == 3:
            raise KeyboardInterrupt

    out = Terminal()
    assert statsview.run(f"http://{endpoint.target}/metrics", out=out, wait=ctrl_c_on_the_third) == 0
    frames = out.getvalue().split("\x1b[H\x1b[2J")
    assert frames[0] == "" and len(frames) == 4  # three frames, each after a clear
    assert ["(no transfers in this interval)" in f for f in frames[1:]] == [False, True, True]  # nothing moved
    once = Terminal()
    assert statsview.run(f"http://{endpoint.target}/metrics", once=True, out=once) == 0
    assert "\x1b[" not in once.getvalue()  # --once never controls the screen


def one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["stats", *argv]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("pdlink stats: ")
    return err


def test_a_dead_port_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as held:  # bound, never listening: connections to it are refused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        err = one_line_error(capsys, f"127.0.0.1:{port}", "--once", "--timeout", "10")
    assert err.startswith(f"pdlink stats: cannot reach http://127.0.0.1:{port}/metrics: ")
    assert "Connection refused" in err


def test_a_silent_endpoint_times_out_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as silent:  # listening, never accepting: the request is never answered
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        err = one_line_error(capsys, f"127.0.0.1:{port}", "--once", "--timeout", "0.2")
    assert f"http://127.0.0.1:{port}/metrics: timed out after 0.2 s" in err, err


class Stub:
    """Plain HTTP on loopback answering every GET with ``status``, ``body`` (which a test may change
    between scrapes) and ``headers``; ``requests`` counts the GETs."""

    def __init__(self, status: int, body: bytes, headers: tuple[tuple[str, str], ...] = ()):
        self.body = body
        self.requests = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stub.requests += 1
                body = stub.body
                self.send_response(status)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                for name, value in headers:
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("status, body, message", [
    (200, b"<html><body><h1>Welcome</h1></body></html>\n", "not Prometheus text format (ValueError: "),
    (200, b"# HELP up whether up\n# TYPE up gauge\nup 1\n", "no pdlink_ metrics in the answer"),
    (404, b"not found", "answered HTTP 404 Not Found"),
    (500, b"", "answered HTTP 500 Internal Server Error"),
])
def test_an_answer_that_is_not_pdlink_metrics_is_one_line_and_exit_1(
        capsys: pytest.CaptureFixture[str], status: int, body: bytes, message: str) -> None:
    stub = Stub(status, body)
    try:
        err = one_line_error(capsys, f"127.0.0.1:{stub.port}", "--once")
    finally:
        stub.close()
    assert message in err, err


def test_without_prometheus_client_it_says_what_to_install(endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client.parser", None)  # import fails as if not installed
    err = one_line_error(capsys, endpoint.target, "--once")
    assert 'pip install "pdlink[metrics]"' in err


@pytest.mark.parametrize("argv, message", [
    (["nohost"], "give HOST:PORT or an http(s):// URL"),
    (["::1:9100"], "an IPv6 host goes in brackets"),
    (["127.0.0.1:9100", "--interval", "0"], "--interval must be > 0"),
    (["127.0.0.1:9100", "--count", "0"], "--count must be > 0"),
])
def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["stats", *argv]) == 2
    assert message in capsys.readouterr().err


def test_metrics_url() -> None:
    assert statsview.metrics_url("10.0.0.1:1027") == "http://10.0.0.1:1027/metrics"
    assert statsview.metrics_url("[::1]:1027") == "http://[::1]:1027/metrics"
    assert statsview.metrics_url("https://h:1027") == "https://h:1027/metrics"
    assert statsview.metrics_url("http://h:1027/") == "http://h:1027/metrics"
    assert statsview.metrics_url("http://h:1027/custom/metrics") == "http://h:1027/custom/metrics"


def test_quantile_interpolates_as_histogram_quantile() -> None:
    inf = math.inf
    buckets = {0.001: 0.0, 0.01: 3.0, 0.1: 4.0, 1.0: 5.0, inf: 5.0}
    assert statsview.quantile(0.5, buckets) == pytest.approx(0.001 + 0.009 * 2.5 / 3)
    assert statsview.quantile(0.9, buckets) == pytest.approx(0.1 + 0.9 * 0.5)
    assert statsview.quantile(0.2, {0.01: 4.0, inf: 4.0}) == pytest.approx(0.002)  # the first bucket from 0
    assert statsview.quantile(0.99, {0.01: 1.0, 0.1: 1.0, inf: 10.0}) == 0.1  # in +Inf: the largest bound
    assert statsview.quantile(0.5, {0.01: 0.0, inf: 0.0}) is None  # nothing observed
    assert statsview.quantile(0.5, {0.01: 1.0}) is None  # no +Inf bucket
    assert statsview.quantile(0.5, {}) is None


def test_delta_of_two_snapshots_and_a_reset(endpoint: Endpoint) -> None:
    from urllib.request import urlopen

    def scrape() -> statsview.Snapshot:
        with urlopen(f"http://{endpoint.target}/metrics", timeout=10) as answer:
            return statsview.parse(answer.read().decode())

    endpoint.fill()
    before = scrape()
    endpoint.bytes.labels("1", "other", "cma", "push").inc(1024 * MiB)
    endpoint.transfers.labels("1", "other", "cma", "push").inc(4)
    endpoint.bytes.labels("0", "9", "ucx", "pull").inc(10)  # a new series
    endpoint.transfers.labels("0", "9", "ucx", "pull").inc()
    now = scrape()
    rows = statsview.table_rows(statsview.delta(before, now), interval=2.0, hide_idle=True)
    assert [(r.labels, r.peer, r.path, r.op, r.transfers, r.bytes, r.gbps) for r in rows] == [
        ("device=1", "other", "cma", "push", 4, 1024 * MiB, 1024 * MiB / 2.0 / 1e9),
        ("device=0", "9", "ucx", "pull", 1, 10, 5 / 1e9),
    ]
    # the engine restarted between two scrapes: its counters went down, and count whole
    reset = statsview.table_rows(statsview.delta(now, before), interval=1.0)
    push = next(r for r in reset if r.peer == "other")
    assert (push.transfers, push.bytes, push.failures) == (2, 2048, 2)
    pull = next(r for r in reset if r.peer == "2")
    assert (pull.transfers, pull.bytes, pull.failures) == (0, 0, 0)  # unchanged
    assert "9" not in [r.peer for r in reset]  # gone from the later scrape


def test_render_and_footer_without_extra_labels() -> None:
    snap = statsview.parse(
        "# TYPE pdlink_transfers_total counter\n"
        'pdlink_transfers_total{peer="7",path="unix",op="push"} 3\n'
        "# TYPE pdlink_transfer_bytes_total counter\n"
        'pdlink_transfer_bytes_total{peer="7",path="unix",op="push"} 512\n'
        "# TYPE pdlink_links gauge\n"
        'pdlink_links{path="unix"} 1\n')
    text = statsview.render(statsview.table_rows(snap), "title", statsview.footer(snap))
    assert text.splitlines() == [
        "title",
        "PEER  PATH  OP    TRANSFERS  BYTES  GB/s  P50 ms  P90 ms  P99 ms  FAILURES",
        "7     unix  push          3  512 B     -       -       -       -  0",
        "links: unix 1 (1) | link events: none",
    ]
    assert [statsview.format_bytes(n) for n in (0, 1023, 1024, 1536 * MiB, 5 << 40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 GiB", "5.0 TiB"]


# --- a hostile endpoint -------------------------------------------------------------------------

PULL = 'peer="a",path="tcp",op="pull"'


def serve(stub: Stub, *argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``pdlink stats`` against ``stub`` (more ``argv`` after the target): exit status, stdout, stderr."""
    try:
        rc = main(["stats", stub.url, *argv])
    finally:
        stub.close()
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return rc, out, err


def printable_lines(text: str) -> bool:
    return all(line.isprintable() for line in text.splitlines())


HOSTILE_VALUES = "\n".join([
    "# TYPE pdlink_transfers_total counter",
    f"pdlink_transfers_total{{{PULL}}} 3",
    f'pdlink_transfers_total{{{PULL},reason="inf"}} +Inf',
    f'pdlink_transfers_total{{{PULL},reason="1e400"}} 1e400',
    f'pdlink_transfers_total{{{PULL},reason="digits"}} {"9" * 100_000}',
    f'pdlink_transfers_total{{{PULL},reason="int"}} {"9" * 4000}',  # an int, too large for a float
    f'pdlink_transfers_total{{{PULL},reason="nan"}} NaN',
    "# TYPE pdlink_transfer_bytes_total counter",
    f'pdlink_transfer_bytes_total{{{PULL},reason="x"}} 1e308',
    f'pdlink_transfer_bytes_total{{{PULL},reason="y"}} 1e308',  # the sum would overflow: left out
    "# TYPE pdlink_transfer_failures_total counter",
    f'pdlink_transfer_failures_total{{{PULL},code="E",stage="a"}} 1e308',
    f'pdlink_transfer_failures_total{{{PULL},code="E",stage="b"}} 1e308',
    f'pdlink_transfer_failures_total{{{PULL},code="F",stage="a"}} 1e308',  # E + F overflows in the row
    f'pdlink_transfer_failures_total{{{PULL},code="G",stage="a"}} -Inf',
    "# TYPE pdlink_transfer_seconds histogram",
    f'pdlink_transfer_seconds_bucket{{{PULL},stage="total",le="0.1"}} 1e308',
    f'pdlink_transfer_seconds_bucket{{{PULL},stage="total",le="NaN"}} 1',
    f'pdlink_transfer_seconds_bucket{{{PULL},stage="total",le="-Inf"}} 1',
    f'pdlink_transfer_seconds_bucket{{{PULL},stage="total",le="+Inf"}} 1e308',
    f'pdlink_transfer_seconds_sum{{{PULL},stage="total"}} 1e-300',  # bytes / seconds overflows
    f'pdlink_transfer_seconds_count{{{PULL},stage="total"}} 1e308',
    "# TYPE pdlink_links gauge",
    'pdlink_links{path="tcp"} 1e308',
    'pdlink_links{path="tcp",device="1"} 1e308',  # summed over devices in the footer: overflows
    'pdlink_links{path="cma"} +Inf',
    "# TYPE pdlink_link_events_total counter",
    'pdlink_link_events_total{event="up",reason="r"} 1e308',
    'pdlink_link_events_total{event="up",reason="s",device="1"} 1e308',
    'pdlink_link_events_total{event="up",reason="t"} +Inf',
    "",
])


def test_values_that_are_not_finite_or_overflow_are_left_out(capsys: pytest.CaptureFixture[str]) -> None:
    snap = statsview.parse(HOSTILE_VALUES)
    s = snap.series[((), "a", "tcp", "pull")]
    assert (s.transfers, s.bytes, s.failures, s.observed) == (3.0, 1e308, {"E": 1e308, "F": 1e308}, 1e308)
    assert s.buckets == {0.1: 1e308, math.inf: 1e308}
    assert sorted(snap.links.values()) == [1e308, 1e308]
    (row,) = statsview.table_rows(snap)
    assert (row.transfers, row.bytes, row.gbps, row.failures) == (3, round(1e308), None, round(1e308))
    assert row.p50 == pytest.approx(0.05)
    foot = statsview.footer(snap)
    assert foot.startswith(f"links: tcp {round(1e308)} ({round(1e308)}) | link events: up {round(1e308)} (")

    rc, out, err = serve(Stub(200, HOSTILE_VALUES.encode()), "--once", capsys=capsys)
    assert (rc, err) == (0, "")
    assert table(out)[1][:5] == ["a", "tcp", "pull", "3", f"{1e308 / 1024 ** 5:.1f} PiB"]


def test_the_live_view_survives_differences_that_overflow(capsys: pytest.CaptureFixture[str]) -> None:
    def body(sign: str) -> bytes:
        return "\n".join([
            f"pdlink_transfers_total{{{PULL}}} {sign}1e308",
            f"pdlink_transfer_bytes_total{{{PULL}}} {sign}1.7e308",
            f'pdlink_transfer_failures_total{{{PULL},code="E"}} {sign}1.7e308',
            f'pdlink_transfer_seconds_bucket{{{PULL},stage="total",le="1e308"}} {sign}1.7e308',
            f'pdlink_transfer_seconds_bucket{{{PULL},stage="total",le="+Inf"}} {sign}1.7e308',
            f'pdlink_transfer_seconds_sum{{{PULL},stage="total"}} {sign}1.7e308',
            f'pdlink_link_events_total{{event="up"}} {sign}1.7e308', ""]).encode()

    before, now = statsview.parse(body("-").decode()), statsview.parse(body("").decode())
    d = statsview.delta(before, now)
    s = d.series[((), "a", "tcp", "pull")]
    # each difference overflows: counted whole, as a reset counter is
    assert [s.transfers, s.bytes, s.failures["E"], s.seconds] == [1e308, 1.7e308, 1.7e308, 1.7e308]
    assert all(math.isfinite(v) for v in (s.transfers, s.bytes, s.seconds, *s.failures.values(), *s.buckets.values(),
                                          *d.link_events.values()))
    statsview.render(statsview.table_rows(d, interval=1e-300), "t", statsview.footer(d))  # no OverflowError

    stub = Stub(200, body("-"))

    def swap(seconds: float) -> None:
        stub.body = body("")

    out = io.StringIO()
    try:
        assert statsview.run(stub.url, count=2, out=out, wait=swap) == 0
    finally:
        stub.close()
    second = out.getvalue().split("\n\n")[1]
    assert table(second)[1][:5] == ["a", "tcp", "pull", str(round(1e308)), f"{1.7e308 / 1024 ** 5:.1f} PiB"]


class Raw:
    """A TCP server on loopback that reads each request's head and then runs ``answer(conn, stop)``
    (``stop`` is set at ``close``): hostile HTTP, written byte by byte."""

    def __init__(self, answer: Callable[[socket.socket, threading.Event], None]):
        self.answer = answer
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            head = b""
            try:
                while b"\r\n\r\n" not in head:
                    got = conn.recv(4096)
                    if not got:
                        return
                    head += got
                self.answer(conn, self.stop)
            except OSError:  # the client went away
                pass

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)
        self.listener.close()


def drip(first: bytes, then: bytes) -> Callable[[socket.socket, threading.Event], None]:
    """Sends ``first``, then ``then`` a byte every 50 ms (far inside any per-read timeout), forever."""
    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(first)
        i = 0
        while not stop.wait(0.05):
            conn.sendall(then[i % len(then):i % len(then) + 1])
            i += 1
    return answer


def endless(first: bytes) -> Callable[[socket.socket, threading.Event], None]:
    """Sends ``first``, then metrics text as fast as it is read, until the client goes away."""
    block = b"pdlink_links 1\n" * 65536

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(first)
        while not stop.is_set():
            conn.sendall(block)
    return answer


def then_hold(data: bytes) -> Callable[[socket.socket, threading.Event], None]:
    """Sends ``data`` and holds the connection open until the server closes."""
    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(data)
        stop.wait(30)
    return answer


def stats_bounded(capsys: pytest.CaptureFixture[str], raw: Raw, *argv: str) -> str:
    """``pdlink stats URL --once ARGV`` against ``raw`` in a thread that must end (a hang fails the
    test instead of holding it): its one line on stderr, exit status 1."""
    rc: list[int] = []
    cli = threading.Thread(target=lambda: rc.append(main(["stats", raw.url, "--once", *argv])), daemon=True)
    try:
        cli.start()
        cli.join(60)
        assert not cli.is_alive(), "pdlink stats did not end"
    finally:
        raw.close()
    out, err = capsys.readouterr()
    assert rc == [1] and out == "" and err.count("\n") == 1 and "Traceback" not in err, (rc, out, err)
    assert err.startswith("pdlink stats: ") and printable_lines(err), err
    return err


@pytest.mark.parametrize("answer", [
    drip(b"HTTP/1.1 200 OK\r\nX-Drip: ", b"a"),  # a header that never ends
    drip(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n", b"pdlink_links 1\n"),  # a body that never ends
    drip(b"", b"HTTP/1.1 100 Continue\r\n\r\n"),  # informational answers, forever
], ids=["headers", "body", "continue"])
def test_one_deadline_bounds_a_server_that_drips(capsys: pytest.CaptureFixture[str],
                                                 answer: Callable[[socket.socket, threading.Event], None]) -> None:
    raw = Raw(answer)
    err = stats_bounded(capsys, raw, "--timeout", "0.5")
    assert err == f"pdlink stats: cannot read {raw.url}: timed out after 0.5 s\n"


def test_the_deadline_covers_parsing(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TimeoutError):
        statsview.parse("pdlink_links 1\n", deadline=time.monotonic() - 1)
    release = threading.Event()

    def slow_parse(text: str, deadline: float | None = None) -> statsview.Snapshot:
        release.wait(30)  # an answer that takes long to parse
        return statsview.Snapshot()

    monkeypatch.setattr(statsview, "parse", slow_parse)
    stub = Stub(200, b"pdlink_links 1\n")
    try:
        err = one_line_error(capsys, stub.url, "--once", "--timeout", "0.3")
    finally:
        release.set()
        stub.close()
    assert err == f"pdlink stats: cannot read {stub.url}: timed out after 0.3 s\n"


@pytest.mark.parametrize("answer, message", [
    (then_hold(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\npdlink_links 1\n" % 2 ** 62),
     "is larger than 64.0 MiB (Content-Length 4611686018427387904)"),
    (endless(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n"), "is larger than 64.0 MiB"),
    (endless(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n"), "is larger than 64.0 MiB"),  # read to the end: none
    (then_hold(b"HTTP/1.1 200 OK\r\n" + b"X-Many: 1\r\n" * 101 + b"\r\n"), "HTTPException: got more than 100 headers"),
    (then_hold(b"\x1b[2J garbage\r\n\r\n"), "cannot read"),  # not HTTP at all (BadStatusLine)
    (then_hold(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"), "IncompleteRead"),
    (then_hold(b"HTTP/1.1 404 Not\x1b]0;pwned\x07 Found\r\nContent-Length: 0\r\n\r\n"),
     "answered HTTP 404 Not?]0;pwned? Found"),
], ids=["content-length-2**62", "chunk-2**64-1", "endless", "101-headers", "not-http", "bad-chunk",
        "escapes-in-reason"])
def test_a_hostile_answer_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str], message: str,
                                                   answer: Callable[[socket.socket, threading.Event], None]) -> None:
    assert statsview.MAX_BODY_BYTES == 64 << 20
    err = stats_bounded(capsys, Raw(answer), "--timeout", "2")
    assert message in err, err


def test_an_answer_closed_short_of_its_length_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    def short(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npdlink_links 1\n")

    err = stats_bounded(capsys, Raw(short), "--timeout", "10")
    assert "IncompleteRead" in err, err


def test_more_samples_than_read_is_one_line(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    body = b"pdlink_links 1\n" * (statsview.MAX_SAMPLES + 1)  # refused before parsing: fast
    rc, out, err = serve(Stub(200, body), "--once", "--timeout", "20", capsys=capsys)
    assert (rc, out) == (1, "")
    assert err == "pdlink stats: more than 500000 samples in the answer (at most 500000 are read)\n"
    monkeypatch.setattr(statsview, "MAX_SAMPLES", 3)
    three = "# HELP pdlink_links links\n# TYPE pdlink_links gauge\n\n  \n" + 'pdlink_links{path="p%d"} 1\n' * 3
    assert len(statsview.parse(three % (0, 1, 2)).links) == 3  # comments and blank lines are not samples
    with pytest.raises(statsview.StatsError, match="more than 3 samples"):
        statsview.parse(three % (0, 1, 2) + "   pdlink_links 1")


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirect_is_not_followed(capsys: pytest.CaptureFixture[str], status: int) -> None:
    target = Stub(200, b"pdlink_links 1\n")
    redirect = Stub(status, b"", headers=(("Location", target.url + "\x1b[2J"),))
    try:
        rc, out, err = serve(redirect, "--once", capsys=capsys)
    finally:
        target.close()
    assert (rc, out, target.requests) == (1, "", 0)
    assert err.startswith(f"pdlink stats: {redirect.url} answered HTTP {status} ")
    assert err.endswith(f", a redirect to {target.url}?[2J (not followed)\n"), err


@pytest.mark.parametrize("error", [MemoryError(), OverflowError("cannot convert float infinity to integer"),
                                   http.client.HTTPException("odd"), ValueError("odd"),
                                   UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")])
def test_any_error_reading_the_answer_is_one_line(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    def failing_parse(text: str, deadline: float | None = None) -> statsview.Snapshot:
        raise error

    monkeypatch.setattr(statsview, "parse", failing_parse)
    stub = Stub(200, b"pdlink_links 1\n")
    try:
        err = one_line_error(capsys, stub.url, "--once")
    finally:
        stub.close()
    assert err.startswith(f"pdlink stats: cannot read {stub.url}: "), err


def test_control_characters_in_label_values_are_not_printed(capsys: pytest.CaptureFixture[str]) -> None:
    osc, csi, c1 = "\x1b]0;pwned\x07", "\x1b[2J", "\x9b31m"
    body = "\n".join([
        f'pdlink_transfers_total{{peer="{osc}",path="tcp{csi}",op="pull\\nX",device="\r{c1}"}} 1',
        f'pdlink_transfer_failures_total{{peer="{osc}",path="tcp{csi}",op="pull\\nX",device="\r{c1}",'
        f'code="E{csi}"}} 2',
        'pdlink_links{path="a\x07b"} 1',
        f'pdlink_link_events_total{{event="up{csi}",reason="r{c1}"}} 1',
        f'pdlink_transfers_total{{peer="{"x" * 1000}"}} 1',  # long: cut
        ""]).encode()
    rc, out, err = serve(Stub(200, body), "--once", capsys=capsys)
    assert (rc, err) == (0, "")
    assert printable_lines(out) and "\r" not in out
    rows = table(out)
    assert rows[1] == ["device=??31m", "?]0;pwned?", "tcp?[2J", "pull?X", "1", "0 B", "-", "-", "-", "-", "2 E?[2J"]
    assert rows[2][1] == "x" * (statsview.MAX_TEXT - 3) + "..."
    assert out.splitlines()[-1] == "links: a?b 1 (1) | link events: up?[2J 1 (r?31m 1)"
    # an error's text from the server is shown printable too
    rc, out, err = serve(Stub(200, f"{csi}not metrics{{".encode()), "--once", capsys=capsys)
    assert rc == 1 and "\x1b" not in err and err.count("\n") == 1, err


def test_at_most_max_rows_are_printed(capsys: pytest.CaptureFixture[str]) -> None:
    body = "".join(f'pdlink_transfers_total{{peer="p{i:03}",path="tcp",op="pull"}} {1000 - i}\n'
                   for i in range(300))
    body += "".join(f'pdlink_links{{path="path{i:02}"}} {100 - i}\n' for i in range(30))
    body += "".join(f'pdlink_transfer_failures_total{{{PULL},code="C{i:06}"}} 1\n' for i in range(3000))
    rc, out, err = serve(Stub(200, body.encode()), "--once", capsys=capsys)
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert len(lines) == 1 + 1 + statsview.MAX_ROWS + 2
    assert cells(lines[2])[0] == "p000" and lines[-2] == "... 101 more rows"
    shown = ", ".join(f"path{i:02} {100 - i}" for i in range(20))
    assert lines[-1] == f"links: {shown}, +10 more ({sum(range(71, 101))}) | link events: none"
    rows = statsview.table_rows(statsview.parse(body))
    assert len(statsview.render(rows, limit=None).splitlines()) == 1 + 301
    assert next(r for r in rows if r.peer == "a").failures == 3000  # one cell, however many codes
