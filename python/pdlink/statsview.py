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
``run`` scrapes and prints. This module imports the standard library only; ``prometheus_client``
(the optional extra ``pdlink[metrics]``) is imported when a scrape is parsed.
"""

from __future__ import annotations

import http.client
import math
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any

__all__ = ["Row", "Series", "Snapshot", "StatsError", "delta", "footer", "format_bytes", "metrics_url", "parse",
           "quantile", "render", "run", "table_rows"]

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


def parse(text: str) -> Snapshot:
    """The pdlink series of one scrape (Prometheus text format). ``StatsError`` when the text is not
    that format, or names no ``pdlink_`` metric at all; ``ImportError`` without prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    snap = Snapshot()
    seen_pdlink = False
    try:
        for family in text_string_to_metric_families(text):
            seen_pdlink = seen_pdlink or family.name.startswith("pdlink_")
            for sample in family.samples:
                _add_sample(snap, sample.name, sample.labels, float(sample.value))
    except Exception as e:  # noqa: BLE001 - the parser raises ValueError, but also others on odd input
        first = (str(e).splitlines() or [""])[0]
        raise StatsError(f"not Prometheus text format ({type(e).__name__}: {first[:120]})") from None
    if not seen_pdlink:
        raise StatsError("no pdlink_ metrics in the answer (is this a pdlink metrics endpoint?)")
    return snap


def _add_sample(snap: Snapshot, name: str, labels: dict[str, str], value: float) -> None:
    if not name.startswith("pdlink_") or math.isnan(value):
        return
    extra = _extra(labels)
    if name == "pdlink_links":
        key = (extra, labels.get("path", ""))
        snap.links[key] = snap.links.get(key, 0.0) + value
        return
    if name == "pdlink_link_events_total":
        ev = (extra, labels.get("event", ""), labels.get("reason", ""))
        snap.link_events[ev] = snap.link_events.get(ev, 0.0) + value
        return
    row: RowKey = (extra, labels.get("peer", ""), labels.get("path", ""), labels.get("op", ""))
    if name == "pdlink_transfers_total":
        _series(snap, row).transfers += value
    elif name == "pdlink_transfer_bytes_total":
        _series(snap, row).bytes += value
    elif name == "pdlink_transfer_failures_total":
        s = _series(snap, row)
        code = labels.get("code", "") or "unknown"
        s.failures[code] = s.failures.get(code, 0.0) + value
    elif name.startswith("pdlink_transfer_seconds_") and labels.get("stage", "total") == "total":
        suffix = name[len("pdlink_transfer_seconds_"):]
        if suffix == "bucket" and "le" in labels:
            s = _series(snap, row)
            le = _le(labels["le"])
            s.buckets[le] = s.buckets.get(le, 0.0) + value
        elif suffix == "sum":
            _series(snap, row).seconds += value
        elif suffix == "count":
            _series(snap, row).observed += value


def _series(snap: Snapshot, key: RowKey) -> Series:
    s = snap.series.get(key)
    if s is None:
        s = snap.series[key] = Series()
    return s


def _minus(now: float, before: float) -> float:
    """A counter's increase; a counter that went down was reset (the engine restarted): all of it."""
    return now - before if now >= before else now


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
        out.series[key] = Series(transfers=s.transfers - b.transfers, bytes=s.bytes - b.bytes,
                                 seconds=max(0.0, s.seconds - b.seconds), observed=s.observed - b.observed,
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
        failures = sum(s.failures.values())
        if hide_idle and s.transfers <= 0 and s.observed <= 0 and failures <= 0 and s.bytes <= 0:
            continue
        if interval is not None:
            gbps = s.bytes / interval / 1e9 if interval > 0 else None
        else:
            gbps = s.bytes / s.seconds / 1e9 if s.seconds > 0 else None
        codes = tuple(sorted(((c, round(n)) for c, n in s.failures.items() if n > 0), key=lambda cn: (-cn[1], cn[0])))
        rows.append(Row(labels=",".join(f"{k}={v}" for k, v in extra), peer=peer, path=path, op=op,
                        transfers=round(s.transfers), bytes=round(s.bytes), gbps=gbps,
                        p50=quantile(0.5, s.buckets), p90=quantile(0.9, s.buckets), p99=quantile(0.99, s.buckets),
                        failures=round(failures), codes=codes))
    rows.sort(key=lambda r: (-r.bytes, -r.transfers, -r.failures, r.labels, r.peer, r.path, r.op))
    return rows


def format_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"; under 1 KiB in bytes ("512 B")."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024 or unit == "PiB":
            break
    return f"{n:.1f} {unit}"


def _ms(seconds: float | None) -> str:
    if seconds is None:
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
    top, n = row.codes[0]
    if len(row.codes) == 1:
        return f"{row.failures} {top}"
    return f"{row.failures} {top}:{n} +{len(row.codes) - 1}"


_HEADER = ("PEER", "PATH", "OP", "TRANSFERS", "BYTES", "GB/s", "P50 ms", "P90 ms", "P99 ms", "FAILURES")
_LEFT = {"LABELS", "PEER", "PATH", "OP", "FAILURES"}  # left-aligned columns; the rest are numbers


def render(rows: Iterable[Row], title: str = "", foot: str = "", empty: str = "(no transfers)") -> str:
    """The table as text: ``title``, a header, one line per row (``empty`` when none), ``foot``; a
    leading LABELS column when any row has extra labels. Ends with a newline."""
    rows = list(rows)
    labelled = any(r.labels for r in rows)
    header = (("LABELS",) if labelled else ()) + _HEADER
    cells = [header]
    for r in rows:
        cells.append(((r.labels or "-",) if labelled else ()) + (
            r.peer or "-", r.path or "-", r.op or "-", str(r.transfers), format_bytes(r.bytes),
            "-" if r.gbps is None else f"{r.gbps:.2f}", _ms(r.p50), _ms(r.p90), _ms(r.p99), _failures(r)))
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = [title] if title else []
    for line in cells:
        lines.append("  ".join(c.ljust(w) if h in _LEFT else c.rjust(w)
                               for c, w, h in zip(line, widths, header)).rstrip())
    if not rows:
        lines.append(empty)
    if foot:
        lines.append(foot)
    return "\n".join(lines) + "\n"


def footer(snap: Snapshot) -> str:
    """"links: tcp 2, cma 1 (3) | link events: down 1 (LLM_TIMEOUT 1), up 3": the links gauge by
    path and the link events by event, with their reasons (summed over extra labels and peers)."""
    by_path: dict[str, float] = {}
    for (_, path), n in snap.links.items():
        by_path[path or "-"] = by_path.get(path or "-", 0.0) + n
    shown = sorted(((p, round(n)) for p, n in by_path.items() if n > 0), key=lambda pn: (-pn[1], pn[0]))
    links = ", ".join(f"{p} {n}" for p, n in shown) + f" ({sum(n for _, n in shown)})" if shown else "none"
    events: dict[str, dict[str, float]] = {}
    for (_, event, reason), n in snap.link_events.items():
        if n > 0:
            reasons = events.setdefault(event or "-", {})
            reasons[reason] = reasons.get(reason, 0.0) + n
    parts = []
    for event in sorted(events):
        reasons = events[event]
        total = round(sum(reasons.values()))
        named = sorted(((r, round(n)) for r, n in reasons.items() if r), key=lambda rn: (-rn[1], rn[0]))
        why = " (" + ", ".join(f"{r} {n}" for r, n in named) + ")" if named else ""
        parts.append(f"{event} {total}{why}")
    return f"links: {links} | link events: {', '.join(parts) or 'none'}"


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


def fetch(url: str, timeout: float, context: Any = None) -> str:
    """The body of GET ``url``; ``StatsError`` for anything but a 200."""
    request = urllib.request.Request(url, headers={"Accept": "text/plain"})
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as answer:
            if answer.status != 200:
                raise StatsError(f"{url} answered HTTP {answer.status} {answer.reason}")
            body: bytes = answer.read()
    except urllib.error.HTTPError as e:
        raise StatsError(f"{url} answered HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, TimeoutError):
            raise StatsError(f"cannot reach {url}: timed out after {timeout:g} s") from None
        raise StatsError(f"cannot reach {url}: {reason}") from None
    except TimeoutError:
        raise StatsError(f"cannot read {url}: timed out after {timeout:g} s") from None
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise StatsError(f"cannot read {url}: {type(e).__name__}: {e}") from None
    return body.decode("utf-8", errors="replace")


def _frame(url: str, snap: Snapshot, interval: float | None) -> str:
    rows = table_rows(snap, interval, hide_idle=interval is not None)
    when = time.strftime("%H:%M:%S")
    span = "since start (cumulative)" if interval is None else f"last {interval:.1f} s"
    idle = len(snap.series) - len(rows)
    hidden = f", {idle} idle rows hidden" if idle else ""
    empty = "(no transfers)" if interval is None else "(no transfers in this interval)"
    return render(rows, f"pdlink stats {url}  {when}  {span}{hidden}", footer(snap), empty)


def run(url: str, *, interval: float = 2.0, count: int | None = None, once: bool = False, timeout: float = 5.0,
        context: Any = None, out: IO[str] | None = None, err: IO[str] | None = None,
        wait: Callable[[float], None] | None = None) -> int:
    """Scrapes ``url`` and prints frames to ``out``: one (``once``, or ``count`` 1), ``count``
    frames, or until Ctrl-C (exit status 0). A failed scrape prints one line to ``err`` and
    returns 1. ``wait(seconds)`` sleeps between scrapes (``time.sleep``; tests pass a hook)."""
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
        before = parse(fetch(url, timeout, context))
        taken = time.monotonic()
        out.write((_CLEAR if tty else "") + _frame(url, before, None))
        out.flush()
        shown = 1
        while frames is None or shown < frames:
            wait(interval)
            now = parse(fetch(url, timeout, context))
            now_taken = time.monotonic()
            out.write((_CLEAR if tty else "\n") + _frame(url, delta(before, now), now_taken - taken))
            out.flush()
            before, taken = now, now_taken
            shown += 1
    except StatsError as e:
        print(f"pdlink stats: {e}", file=err)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0
