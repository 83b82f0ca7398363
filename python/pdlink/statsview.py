"""``pdlink stats HOST:PORT``: a live terminal view of the transfer metrics a pdlink endpoint serves.

It scrapes the Prometheus text exposition (``http://HOST:PORT/metrics``, or a full URL), and prints
one row per (extra labels, peer, path, op): transfers, bytes, GB/s, the p50/p90/p99 latency of
``stage="total"`` estimated from the histogram's buckets as Prometheus' ``histogram_quantile`` does
(linear interpolation inside the bucket), and failures with their most frequent code; then a footer
with the live links by path and the link events.

The first frame (and ``--once``) is cumulative, since the engine started: GB/s there is bytes over
the summed ``stage="total"`` seconds (busy throughput). Later frames of the live view are the
difference between the last two scrapes: GB/s is bytes moved over the time between the scrapes,
percentiles come from the difference of the histograms, and failures and link events are those of
the interval.

The metric families read (any series may carry further labels, e.g. ``device`` or ``engine``: they
become part of the row, shown in a leading column):

* ``pdlink_transfers_total{peer,path,op}``, ``pdlink_transfer_bytes_total{peer,path,op}``
* ``pdlink_transfer_seconds{peer,path,op,stage}`` (histogram; only ``stage="total"`` is shown)
* ``pdlink_transfer_failures_total{peer,path,op,code,stage}`` (summed over ``stage``)
* ``pdlink_links{path}`` (gauge), ``pdlink_link_events_total{peer,event,reason}``

The work is done by pure functions, ``parse`` (text -> ``Snapshot``), ``delta`` (two snapshots ->
the interval's), ``table_rows`` (snapshot -> ``Row`` list), ``render`` and ``footer`` (-> text);
``scrape`` fetches and parses one answer within its deadline; ``run`` scrapes and prints. This
module imports the standard library only; ``prometheus_client`` (the optional extra
``pdlink[metrics]``) is imported when a scrape is parsed.

The endpoint is not trusted. One scrape (connect, headers, body and parsing) has one deadline,
``timeout`` seconds; the body is read up to ``MAX_BODY_BYTES`` and holds at most ``MAX_SAMPLES``
samples; redirects are not followed; anything else is one line and exit status 1, never a
traceback. A sample that is not finite (or that would make a sum overflow) is left out. Label
values are printed with each non-printable character (control characters, terminal escapes) as
``?``, cut at ``MAX_TEXT`` characters; at most ``MAX_ROWS`` rows are printed.
"""

from __future__ import annotations

import functools
import http.client
import io
import itertools
import math
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any, TextIO, cast

__all__ = ["MAX_BODY_BYTES", "MAX_ROWS", "MAX_SAMPLES", "MAX_TEXT", "Row", "Series", "Snapshot", "StatsError",
           "delta", "footer", "format_bytes", "metrics_url", "parse", "printable", "quantile", "render", "run",
           "scrape", "table_rows"]

MAX_BODY_BYTES = 64 << 20  # the largest answer read; a larger one is refused
MAX_SAMPLES = 500_000  # the most samples (lines that are not comments) an answer may hold
MAX_ROWS = 200  # the most table rows printed; then "... N more rows"
MAX_TEXT = 200  # the most characters of a label value (or an error's detail) printed
_MAX_FOOTER_ITEMS = 20  # the most paths, events, and reasons of an event, named in the footer
_CHUNK = 1 << 20  # the body is read this much at a time
_NO_DEADLINE = 1e9  # a timeout of this many seconds or more is none (sockets and locks take no more)
_SAMPLE_LINE = re.compile(r"^[^\S\n]*[^#\s]", re.MULTILINE)  # a line that is neither blank nor a comment

# labels that say what a series measures; every other label is part of the row's identity
_KNOWN_LABELS = frozenset({"peer", "path", "op", "stage", "code", "le", "event", "reason"})
_INSTALL_HINT = 'pip install "pdlink[metrics]"'
_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen

Extra = tuple[tuple[str, str], ...]  # the extra labels of a series, sorted by name
RowKey = tuple[Extra, str, str, str]  # extra labels, peer, path, op


class StatsError(Exception):
    """A scrape that could not be fetched or read; its text is the one-line message shown."""


@dataclass
class Series:
    """What one row's metrics hold: counters, and the ``stage="total"`` histogram."""

    transfers: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0  # _sum of stage="total"
    observed: float = 0.0  # _count of stage="total"
    buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count, stage="total"
    failures: dict[str, float] = field(default_factory=dict)  # code -> count, summed over stages


@dataclass
class Snapshot:
    """One scrape (or the difference of two): the rows' series, the links gauge by (extra labels,
    path), the link events by (extra labels, event, reason), summed over peers."""

    series: dict[RowKey, Series] = field(default_factory=dict)
    links: dict[tuple[Extra, str], float] = field(default_factory=dict)
    link_events: dict[tuple[Extra, str, str], float] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    """One line of the table; latencies in seconds, None when nothing was observed."""

    labels: str  # the extra labels, "device=0,engine=e1"; "" when none
    peer: str
    path: str
    op: str
    transfers: int
    bytes: int
    gbps: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    failures: int
    codes: tuple[tuple[str, int], ...]  # (code, count), most frequent first


def _extra(labels: dict[str, str]) -> Extra:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in _KNOWN_LABELS))


def _le(text: str) -> float:
    return math.inf if text in ("+Inf", "Inf", "inf") else float(text)


def parse(text: str, deadline: float | None = None) -> Snapshot:
    """The pdlink series of one scrape (Prometheus text format). ``StatsError`` when the text is not
    that format, holds more than ``MAX_SAMPLES`` samples, or names no ``pdlink_`` metric at all;
    ``TimeoutError`` when parsing goes past ``deadline`` (a ``time.monotonic()`` time); ``ImportError``
    without prometheus_client. Samples that are not finite numbers are left out."""
    from prometheus_client.parser import text_fd_to_metric_families

    if sum(1 for _ in itertools.islice(_SAMPLE_LINE.finditer(text), MAX_SAMPLES + 1)) > MAX_SAMPLES:
        raise StatsError(f"more than {MAX_SAMPLES} samples in the answer (at most {MAX_SAMPLES} are read)")
    snap = Snapshot()
    seen_pdlink = False
    try:
        for family in text_fd_to_metric_families(cast(TextIO, _lines(text, deadline))):
            seen_pdlink = seen_pdlink or family.name.startswith("pdlink_")
            for sample in family.samples:
                value = _finite(sample.value)
                if value is not None:
                    _add_sample(snap, sample.name, sample.labels, value)
    except (StatsError, TimeoutError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - the parser raises ValueError, but also others on odd input
        first = (str(e).splitlines() or [""])[0]
        raise StatsError(f"not Prometheus text format ({type(e).__name__}: {first[:120]})") from None
    if not seen_pdlink:
        raise StatsError("no pdlink_ metrics in the answer (is this a pdlink metrics endpoint?)")
    return snap


def _lines(text: str, deadline: float | None) -> Iterator[str]:
    """The lines of ``text`` (as the parser reads a file); ``TimeoutError`` once past ``deadline``."""
    for i, line in enumerate(io.StringIO(text)):
        if deadline is not None and i % 1024 == 0 and time.monotonic() > deadline:
            raise TimeoutError("parsing went past the deadline")
        yield line


def _finite(value: Any) -> float | None:
    """``value`` as a float; None when it is not a finite number (+Inf, NaN, 1e400, a huge integer)."""
    try:
        f = float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    return f if math.isfinite(f) else None


def _plus(total: float, value: float) -> float:
    """``total + value``; ``total`` when the sum would overflow (a hostile endpoint's 1e308s)."""
    s = total + value
    return s if math.isfinite(s) else total


def _sum(values: Iterable[float]) -> float:
    return functools.reduce(_plus, values, 0.0)


def _add(to: dict[Any, float], key: Any, value: float) -> None:
    to[key] = _plus(to.get(key, 0.0), value)


def _add_sample(snap: Snapshot, name: str, labels: dict[str, str], value: float) -> None:
    if not name.startswith("pdlink_") or not math.isfinite(value):
        return
    extra = _extra(labels)
    if name == "pdlink_links":
        _add(snap.links, (extra, labels.get("path", "")), value)
        return
    if name == "pdlink_link_events_total":
        _add(snap.link_events, (extra, labels.get("event", ""), labels.get("reason", "")), value)
        return
    row: RowKey = (extra, labels.get("peer", ""), labels.get("path", ""), labels.get("op", ""))
    if name == "pdlink_transfers_total":
        s = _series(snap, row)
        s.transfers = _plus(s.transfers, value)
    elif name == "pdlink_transfer_bytes_total":
        s = _series(snap, row)
        s.bytes = _plus(s.bytes, value)
    elif name == "pdlink_transfer_failures_total":
        _add(_series(snap, row).failures, labels.get("code", "") or "unknown", value)
    elif name.startswith("pdlink_transfer_seconds_") and labels.get("stage", "total") == "total":
        suffix = name[len("pdlink_transfer_seconds_"):]
        if suffix == "bucket" and "le" in labels:
            le = _le(labels["le"])
            if not math.isnan(le) and le != -math.inf:
                _add(_series(snap, row).buckets, le, value)
        elif suffix == "sum":
            s = _series(snap, row)
            s.seconds = _plus(s.seconds, value)
        elif suffix == "count":
            s = _series(snap, row)
            s.observed = _plus(s.observed, value)


def _series(snap: Snapshot, key: RowKey) -> Series:
    s = snap.series.get(key)
    if s is None:
        s = snap.series[key] = Series()
    return s


def _minus(now: float, before: float) -> float:
    """A counter's increase; a counter that went down was reset (the engine restarted): all of it
    (and so is one whose difference overflows)."""
    d = now - before
    return d if now >= before and math.isfinite(d) else now


def _minus_map(now: dict[Any, float], before: dict[Any, float]) -> dict[Any, float]:
    return {k: _minus(v, before.get(k, 0.0)) for k, v in now.items()}


def delta(before: Snapshot, now: Snapshot) -> Snapshot:
    """What happened between two scrapes: counters and histograms subtracted (a series that went
    down was reset and counts whole; a series gone from ``now`` is left out), links as ``now``."""
    out = Snapshot(links=dict(now.links), link_events=_minus_map(now.link_events, before.link_events))
    for key, s in now.series.items():
        b = before.series.get(key)
        if b is None or s.transfers < b.transfers or s.bytes < b.bytes or s.observed < b.observed:
            b = Series()  # new, or reset since the last scrape
        out.series[key] = Series(transfers=_minus(s.transfers, b.transfers), bytes=_minus(s.bytes, b.bytes),
                                 seconds=max(0.0, _minus(s.seconds, b.seconds)),
                                 observed=_minus(s.observed, b.observed),
                                 buckets=_minus_map(s.buckets, b.buckets),
                                 failures=_minus_map(s.failures, b.failures))
    return out


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The ``q`` quantile (0..1) of a histogram given as {upper bound: cumulative count}, estimated
    as Prometheus' ``histogram_quantile``: linear interpolation inside the bucket the rank falls in,
    from 0 for the first bucket; a rank in the +Inf bucket gives the largest finite bound. None when
    nothing was observed (or there is no +Inf bucket)."""
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf:
        return None
    counts: list[float] = []
    for le in bounds:  # cumulative counts never go down (a difference of two scrapes might)
        counts.append(max(buckets[le], counts[-1] if counts else 0.0))
    total = counts[-1]
    if total <= 0:
        return None
    if len(bounds) == 1:
        return None  # only +Inf: nothing to interpolate within
    rank = q * total
    i = next(i for i, c in enumerate(counts) if c >= rank)
    if i == len(bounds) - 1:
        return bounds[-2]
    if i == 0 and bounds[0] <= 0:
        return bounds[0]
    start = 0.0 if i == 0 else bounds[i - 1]
    below = 0.0 if i == 0 else counts[i - 1]
    inside = counts[i] - below
    if inside <= 0:
        return bounds[i]
    return start + (bounds[i] - start) * (rank - below) / inside


def table_rows(snap: Snapshot, interval: float | None = None, hide_idle: bool = False) -> list[Row]:
    """One ``Row`` per series, by bytes, most first. ``interval`` (seconds): ``snap`` is a
    ``delta`` over that long, and GB/s is bytes / interval; None: cumulative, and GB/s is bytes /
    the summed latency (busy throughput). ``hide_idle`` leaves out rows with nothing to show."""
    rows: list[Row] = []
    for (extra, peer, path, op), s in snap.series.items():
        failures = _sum(s.failures.values())
        if hide_idle and s.transfers <= 0 and s.observed <= 0 and failures <= 0 and s.bytes <= 0:
            continue
        if interval is not None:
            gbps = s.bytes / interval / 1e9 if interval > 0 else None
        else:
            gbps = s.bytes / s.seconds / 1e9 if s.seconds > 0 else None
        if gbps is not None and not math.isfinite(gbps):
            gbps = None
        codes = tuple(sorted(((c, _int(n)) for c, n in s.failures.items() if n > 0), key=lambda cn: (-cn[1], cn[0])))
        rows.append(Row(labels=",".join(f"{k}={v}" for k, v in extra), peer=peer, path=path, op=op,
                        transfers=_int(s.transfers), bytes=_int(s.bytes), gbps=gbps,
                        p50=quantile(0.5, s.buckets), p90=quantile(0.9, s.buckets), p99=quantile(0.99, s.buckets),
                        failures=_int(failures), codes=codes))
    rows.sort(key=lambda r: (-r.bytes, -r.transfers, -r.failures, r.labels, r.peer, r.path, r.op))
    return rows


def _int(x: float) -> int:
    """``round(x)``; 0 for what is not a finite number (a snapshot holds none: a guard)."""
    return round(x) if math.isfinite(x) else 0


def printable(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` safe to print on a terminal: each non-printable character (control characters,
    the ESC of terminal escapes, newlines) as ``?``, cut to ``limit`` characters ("..." at the end)."""
    cut = text if len(text) <= limit else text[:max(0, limit - 3)] + "..."
    return cut if cut.isprintable() else "".join(c if c.isprintable() else "?" for c in cut)


def format_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"; under 1 KiB in bytes ("512 B")."""
    try:
        n = float(n)
    except OverflowError:
        n = math.inf
    if not math.isfinite(n):
        return "-"
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024 or unit == "PiB":
            break
    return f"{n:.1f} {unit}"


def _ms(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds * 1e3):
        return "-"
    ms = seconds * 1e3
    if ms < 10:
        return f"{ms:.3f}"
    if ms < 1000:
        return f"{ms:.1f}"
    return f"{ms:.0f}"


def _failures(row: Row) -> str:
    """"0"; "3 LLM_TIMEOUT" (one code); "5 LLM_TIMEOUT:3 +1" (the top code, its count, how many other codes)."""
    if not row.codes:
        return str(row.failures)
    top, n = printable(row.codes[0][0]), row.codes[0][1]
    if len(row.codes) == 1:
        return f"{row.failures} {top}"
    return f"{row.failures} {top}:{n} +{len(row.codes) - 1}"


_HEADER = ("PEER", "PATH", "OP", "TRANSFERS", "BYTES", "GB/s", "P50 ms", "P90 ms", "P99 ms", "FAILURES")
_LEFT = {"LABELS", "PEER", "PATH", "OP", "FAILURES"}  # left-aligned columns; the rest are numbers


def render(rows: Iterable[Row], title: str = "", foot: str = "", empty: str = "(no transfers)",
           limit: int | None = MAX_ROWS) -> str:
    """The table as text: ``title``, a header, one line per row (``empty`` when none; the first
    ``limit`` rows, then "... N more rows"), ``foot``; a leading LABELS column when any row shown has
    extra labels. Label values are shown ``printable``. Ends with a newline."""
    rows = list(rows)
    shown = rows if limit is None else rows[:limit]
    labelled = any(r.labels for r in shown)
    header = (("LABELS",) if labelled else ()) + _HEADER
    cells = [header]
    for r in shown:
        cells.append(((printable(r.labels) or "-",) if labelled else ()) + (
            printable(r.peer) or "-", printable(r.path) or "-", printable(r.op) or "-", str(r.transfers),
            format_bytes(r.bytes), "-" if r.gbps is None or not math.isfinite(r.gbps) else f"{r.gbps:.2f}",
            _ms(r.p50), _ms(r.p90), _ms(r.p99), _failures(r)))
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = [title] if title else []
    for line in cells:
        lines.append("  ".join(c.ljust(w) if h in _LEFT else c.rjust(w)
                               for c, w, h in zip(line, widths, header)).rstrip())
    if not rows:
        lines.append(empty)
    if len(rows) > len(shown):
        lines.append(f"... {len(rows) - len(shown)} more rows")
    if foot:
        lines.append(foot)
    return "\n".join(lines) + "\n"


def _some(parts: list[str]) -> str:
    """``parts`` joined by ", "; past ``_MAX_FOOTER_ITEMS``, the first ones and "+N more"."""
    more = len(parts) - _MAX_FOOTER_ITEMS
    return ", ".join(parts[:_MAX_FOOTER_ITEMS] + ([f"+{more} more"] if more > 0 else []))


def footer(snap: Snapshot) -> str:
    """"links: tcp 2, cma 1 (3) | link events: down 1 (LLM_TIMEOUT 1), up 3": the links gauge by
    path and the link events by event, with their reasons (summed over extra labels and peers);
    names shown ``printable``, at most ``_MAX_FOOTER_ITEMS`` of each list (then "+N more")."""
    by_path: dict[str, float] = {}
    for (_, path), n in snap.links.items():
        _add(by_path, path or "-", n)
    shown = sorted(((p, _int(n)) for p, n in by_path.items() if n > 0), key=lambda pn: (-pn[1], pn[0]))
    links = _some([f"{printable(p)} {n}" for p, n in shown]) + f" ({sum(n for _, n in shown)})" if shown else "none"
    events: dict[str, dict[str, float]] = {}
    for (_, event, reason), n in snap.link_events.items():
        if n > 0:
            _add(events.setdefault(event or "-", {}), reason, n)
    parts = []
    for event in sorted(events):
        reasons = events[event]
        total = _int(_sum(reasons.values()))
        named = sorted(((r, _int(n)) for r, n in reasons.items() if r), key=lambda rn: (-rn[1], rn[0]))
        why = " (" + _some([f"{printable(r)} {n}" for r, n in named]) + ")" if named else ""
        parts.append(f"{printable(event)} {total}{why}")
    return f"links: {links} | link events: {_some(parts) or 'none'}"


def metrics_url(target: str) -> str:
    """``HOST:PORT`` (an IPv6 host in brackets) -> ``http://HOST:PORT/metrics``; an http(s) URL is
    kept (``/metrics`` added when its path is empty or ``/``). ``ValueError`` for anything else."""
    if target.startswith(("http://", "https://")):
        scheme, rest = target.split("://", 1)
        if not rest or rest.startswith("/"):
            raise ValueError(f"no host in {target!r}")
        return target if rest.partition("/")[2] else f"{target.rstrip('/')}/metrics"
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"give HOST:PORT or an http(s):// URL, got {target!r}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"an IPv6 host goes in brackets ([::1]:PORT), got {target!r}")
    return f"http://{host}:{port}/metrics"


def _deadline(timeout: float) -> float:
    """The ``time.monotonic()`` time ``timeout`` seconds from now; math.inf for a very long timeout."""
    return time.monotonic() + timeout if timeout < _NO_DEADLINE else math.inf


def _remaining(deadline: float) -> float | None:
    """The seconds left before ``deadline`` (None: no deadline); ``TimeoutError`` when none are."""
    if deadline == math.inf:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


class _DeadlineIO(io.RawIOBase):
    """A response's socket reader whose every read waits at most until ``deadline``: a server that
    drips its headers or body a byte at a time cannot hold the scrape past it."""

    def __init__(self, raw: Any, sock: Any, deadline: float):
        super().__init__()
        self._raw, self._sock, self._deadline = raw, sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sock.settimeout(_remaining(self._deadline))
        n: int = self._raw.readinto(buffer)
        return n

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class _Response(http.client.HTTPResponse):
    def __init__(self, sock: Any, *args: Any, deadline: float, **kwargs: Any):
        super().__init__(sock, *args, **kwargs)
        self.fp = io.BufferedReader(_DeadlineIO(self.fp.detach(), sock, deadline))


class _DeadlineConnection(http.client.HTTPConnection):
    """A connection (http, or https through _HTTPSConnection) bounded by one deadline: connecting,
    and every read of its response."""

    def __init__(self, *args: Any, deadline: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._deadline = deadline
        self.response_class = cast("type[http.client.HTTPResponse]", functools.partial(_Response, deadline=deadline))

    def connect(self) -> None:
        self.timeout = _remaining(self._deadline)
        super().connect()


class _HTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: float):
        super().__init__()
        self._deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_DeadlineConnection, deadline=self._deadline), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: float, context: Any):
        super().__init__(context=context)
        self._deadline, self._pdlink_context = deadline, context

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_HTTPSConnection, deadline=self._deadline), req,
                            context=self._pdlink_context)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is not followed: it reaches the caller as the ``HTTPError`` of its 3xx status."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def fetch(url: str, timeout: float, context: Any = None, deadline: float | None = None) -> str:
    """The body of GET ``url``; ``StatsError`` for anything but a 200 (a redirect is not followed),
    an answer over ``MAX_BODY_BYTES``, or one not read whole by ``deadline`` (a ``time.monotonic()``
    time; default ``timeout`` seconds from now, math.inf for none)."""
    if deadline is None:
        deadline = _deadline(timeout)
    opener = urllib.request.build_opener(_HTTPHandler(deadline), _HTTPSHandler(deadline, context), _NoRedirects())
    request = urllib.request.Request(url, headers={"Accept": "text/plain"})
    try:
        with opener.open(request, timeout=_remaining(deadline)) as answer:
            if answer.status != 200:
                raise StatsError(f"{url} answered HTTP {answer.status} {printable(answer.reason)}")
            body = _read_body(url, answer, deadline)
    except urllib.error.HTTPError as e:
        e.close()
        where = e.headers.get("Location") if 300 <= e.code < 400 and e.headers is not None else None
        moved = f", a redirect to {printable(where)} (not followed)" if where is not None else ""
        raise StatsError(f"{url} answered HTTP {e.code} {printable(str(e.reason))}{moved}") from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, TimeoutError):
            raise StatsError(f"cannot reach {url}: timed out after {timeout:g} s") from None
        raise StatsError(f"cannot reach {url}: {printable(str(reason))}") from None
    except _READ_ERRORS as e:
        raise _read_failure(url, e, timeout) from None
    return body.decode("utf-8", errors="replace")


# What reading an answer (fetch) or parsing it (parse) can raise besides StatsError; _read_failure
# says it in one line.
_READ_ERRORS = (MemoryError, OSError, http.client.HTTPException, ValueError, OverflowError)


def _read_failure(url: str, e: BaseException, timeout: float) -> StatsError:
    """One of ``_READ_ERRORS`` (TimeoutError, an OSError, included) as the StatsError a user sees."""
    if isinstance(e, TimeoutError):
        return StatsError(f"cannot read {url}: timed out after {timeout:g} s")
    if isinstance(e, MemoryError):
        return StatsError(f"cannot read {url}: out of memory")
    return StatsError(f"cannot read {url}: {type(e).__name__}: {printable(str(e))}")


def _read_body(url: str, answer: http.client.HTTPResponse, deadline: float) -> bytes:
    """The body, read a chunk at a time: ``StatsError`` past ``MAX_BODY_BYTES``, ``TimeoutError``
    past ``deadline``."""
    too_large = f"the answer of {url} is larger than {format_bytes(MAX_BODY_BYTES)}"
    if answer.length is not None and answer.length > MAX_BODY_BYTES:  # a Content-Length of 2**62
        raise StatsError(f"{too_large} (Content-Length {answer.length})")
    chunks: list[bytes] = []
    size = 0
    while True:
        _remaining(deadline)
        chunk = answer.read(min(_CHUNK, MAX_BODY_BYTES + 1 - size))
        if not chunk:
            break
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise StatsError(too_large)
        chunks.append(chunk)
    if answer.length:  # the server closed before its Content-Length
        raise http.client.IncompleteRead(b"", answer.length)
    return b"".join(chunks)


def scrape(url: str, timeout: float, context: Any = None) -> Snapshot:
    """``parse(fetch(url))`` within ``timeout`` seconds in all (connecting, the headers, the body and
    parsing): done in a daemon thread that is given up on at the deadline, so nothing (a dripping
    server, a name lookup, an answer slow to parse) holds the caller past it. ``StatsError`` for
    whatever goes wrong."""
    if math.isnan(timeout) or timeout <= 0:
        raise StatsError(f"the timeout must be a number of seconds > 0, not {timeout!r}")
    deadline = _deadline(timeout)
    done: list[Snapshot | BaseException] = []

    def work() -> None:
        try:
            done.append(parse(fetch(url, timeout, context, deadline), deadline))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            done.append(e)

    worker = threading.Thread(target=work, name="pdlink-stats-scrape", daemon=True)
    worker.start()
    # a little past the deadline: the worker's own message, when it is on time
    worker.join(None if deadline == math.inf else max(0.0, deadline - time.monotonic()) + 0.1)
    result = done[0] if done else TimeoutError()
    if isinstance(result, Snapshot):
        return result
    if isinstance(result, StatsError):
        raise result
    if isinstance(result, _READ_ERRORS):
        raise _read_failure(url, result, timeout) from None
    raise result


def _frame(url: str, snap: Snapshot, interval: float | None) -> str:
    rows = table_rows(snap, interval, hide_idle=interval is not None)
    when = time.strftime("%H:%M:%S")
    span = "since start (cumulative)" if interval is None else f"last {interval:.1f} s"
    idle = len(snap.series) - len(rows)
    hidden = f", {idle} idle rows hidden" if idle else ""
    empty = "(no transfers)" if interval is None else "(no transfers in this interval)"
    return render(rows, f"pdlink stats {printable(url, 4 * MAX_TEXT)}  {when}  {span}{hidden}", footer(snap), empty)


def run(url: str, *, interval: float = 2.0, count: int | None = None, once: bool = False, timeout: float = 5.0,
        context: Any = None, out: IO[str] | None = None, err: IO[str] | None = None,
        wait: Callable[[float], None] | None = None) -> int:
    """Scrapes ``url`` and prints frames to ``out``: one (``once``, or ``count`` 1), ``count``
    frames, or until Ctrl-C (exit status 0). A failed scrape (``timeout`` seconds for all of it)
    prints one line to ``err`` and returns 1. ``wait(seconds)`` sleeps between scrapes (``time.sleep``;
    tests pass a hook)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    wait = time.sleep if wait is None else wait
    try:
        import prometheus_client.parser  # noqa: F401
    except ImportError:
        print(f"pdlink stats: reading metrics needs prometheus_client: {_INSTALL_HINT}", file=err)
        return 1
    tty = not once and out.isatty()
    frames = 1 if once else count
    try:
        before = scrape(url, timeout, context)
        taken = time.monotonic()
        out.write((_CLEAR if tty else "") + _frame(url, before, None))
        out.flush()
        shown = 1
        while frames is None or shown < frames:
            wait(interval)
            now = scrape(url, timeout, context)
            now_taken = time.monotonic()
            out.write((_CLEAR if tty else "\n") + _frame(url, delta(before, now), now_taken - taken))
            out.flush()
            before, taken = now, now_taken
            shown += 1
    except StatsError as e:
        print(f"pdlink stats: {printable(str(e), 4 * MAX_TEXT)}", file=err)
        return 1
    except (MemoryError, ArithmeticError, ValueError) as e:  # a guard: scrape reports these as StatsError
        print(f"pdlink stats: cannot show {url}: {type(e).__name__}: {printable(str(e))}", file=err)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0
