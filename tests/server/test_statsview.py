"""``pdlink stats``: a live view of a pdlink metrics endpoint, checked against a real
prometheus_client registry served on loopback (prometheus_client's own HTTP server, in a thread)
holding known values: exact transfer counts, bytes, latency percentiles estimated from known
buckets as Prometheus' ``histogram_quantile`` does, failures with their top code, the column of
extra labels, the footer of links and link events; the live view's second frame shows only what
happened between two scrapes (the scrapes are driven by a hook, nothing sleeps); a dead port, an
HTTP error and a body that is not Prometheus text are one line on stderr and exit status 1."""

from __future__ import annotations

import io
import math
import re
import socket
import sys
import threading
from collections.abc import Iterator
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
    """Plain HTTP on loopback answering every GET with ``status`` and ``body``."""

    def __init__(self, status: int, body: bytes):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
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
