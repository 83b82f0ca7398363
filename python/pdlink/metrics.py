"""Prometheus metrics of pdlink engines (docs/metrics.md).

The engine counts in C++ (``Engine.stats()``, a typed ``EngineStats``); this module turns those
snapshots into Prometheus families at scrape time:

* ``EngineCollector(engine)`` registers with any ``prometheus_client`` registry, so a program (a
  vLLM worker, a test) exposes it with its own HTTP server;
* ``Metrics(port=...)`` (or ``PDLINK_METRICS=[HOST:]PORT``) serves every engine of this process
  on an HTTP endpoint of its own, for programs that only import ``llm_datadist`` or ``hixl``;
* ``pdlink serve`` exports the same families with its ``device`` label (docs/server.md).

``prometheus_client`` is an optional dependency (``pip install "pdlink[metrics]"``): it is imported
when a collector or endpoint is made, never by ``import pdlink``.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from . import constants, environment

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["CONNECTION_SECONDS", "EngineCollector", "FAMILIES", "Metrics", "PORT_SPAN"]

#: A process endpoint asked for port P takes the first free one of P .. P + PORT_SPAN - 1.
PORT_SPAN = 64
#: The longest a connection to the process endpoint is served (it serves one at a time).
CONNECTION_SECONDS = 5.0

_log = logging.getLogger("pdlink.metrics")

# Every family, its type and its labels beyond the collector's own (``device``, ``engine``):
# (name as exposed, type, labels, help). Counters are named here without ``_total``.
FAMILIES: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("pdlink_transfers", "counter", ("peer", "path", "op"), "Transfers this engine initiated that completed"),
    ("pdlink_transfer_bytes", "counter", ("peer", "path", "op"), "Payload bytes of completed transfers"),
    ("pdlink_transfer_descriptors", "counter", ("peer", "path", "op"),
     "Descriptors (tensor x range pieces as the caller named them) of completed transfers"),
    ("pdlink_transfer_seconds", "histogram", ("peer", "path", "op", "stage"),
     "Latency of completed transfers: stage queue (entry to first request on the link), wire (from there to "
     "completion), total (entry to completion)"),
    ("pdlink_transfer_failures", "counter", ("peer", "path", "op", "code", "stage"),
     "Failed or refused transfers by LLMStatusCode name and the stage they stopped at"),
    ("pdlink_links", "gauge", ("path",), "Live links by host data path"),
    ("pdlink_link_events", "counter", ("peer", "event", "reason"),
     "Links installed (up, reconnect) and ended (down, with its reason)"),
)

# EngineStats' resource fields: (field, family, type, help). Gauges are now-values; counters grow.
_RESOURCES: tuple[tuple[str, str, str, str], ...] = (
    ("tombstones", "pdlink_link_tombstones", "gauge", "Dead links still reported until unlinked"),
    ("handshakes", "pdlink_handshakes", "gauge", "Connections in a handshake now"),
    ("threads", "pdlink_engine_threads", "gauge", "Engine threads running"),
    ("notifications", "pdlink_notifications_queued", "gauge", "Notifications received and not yet taken"),
    ("offers_live", "pdlink_offers_live", "gauge", "KV handoff offers not yet released"),
    ("offer_bytes", "pdlink_offer_bytes", "gauge", "Bytes the live offers retain"),
    ("pinned_bytes", "pdlink_pinned_bytes", "gauge", "Bytes pinned for peers' direct accesses now"),
    ("role_epoch", "pdlink_role_epoch", "gauge", "The role epoch (+1 per committed switch)"),
    ("handshakes_refused", "pdlink_handshakes_refused", "counter", "Connections dropped for want of a slot"),
    ("handshakes_evicted", "pdlink_handshakes_evicted", "counter", "Silent connections dropped for a newcomer"),
    ("listener_backoffs", "pdlink_listener_backoffs", "counter", "Listener pauses for want of descriptors"),
    ("pins_expired", "pdlink_pins_expired", "counter", "Pins released before the peer's next frame"),
    ("notifications_refused", "pdlink_notifications_refused", "counter", "Notifications refused at a bound"),
    ("offers_released", "pdlink_offers_released", "counter", "Offers released, every reason"),
    ("offers_expired", "pdlink_offers_expired", "counter", "Offers released by their lease"),
    ("offers_aborted", "pdlink_offers_aborted", "counter", "Offers released by an abort"),
    ("handoff_events_dropped", "pdlink_handoff_events_dropped", "counter", "Handoff events dropped, queue full"),
)


def _prometheus() -> Any:
    try:
        import prometheus_client.core as prom_core
    except ImportError as e:  # pragma: no cover - the extra is installed wherever tests run
        raise ImportError('pdlink.metrics needs prometheus_client: pip install "pdlink[metrics]"') from e
    return prom_core


class EngineCollector:
    """A ``prometheus_client`` collector of one engine, or of several told apart by ``label``.

    ``engines``: an ``Engine``; a mapping of label value -> engine (``pdlink serve``: ``{"0": e0,
    "1": e1}`` with ``label="device"``); or a callable returning such a mapping at each scrape.
    Each scrape takes one ``Engine.stats()`` per engine (C++ only; the GIL is released)."""

    def __init__(self, engines: Any, *, label: str = "engine") -> None:
        self._prom = _prometheus()
        single = not isinstance(engines, Mapping) and hasattr(engines, "stats")
        self._source: Callable[[], Mapping[str, Any]]
        if single:
            self._source = lambda: {"": engines}
        elif isinstance(engines, Mapping):
            fixed = dict(engines)
            self._source = lambda: fixed
        else:
            self._source = engines
        self._keys: tuple[str, ...] = () if single else (label,)  # one engine: no label of the collector's

    def _engines(self) -> list[tuple[tuple[str, ...], Any]]:
        return [((str(k),) if self._keys else (), e) for k, e in self._source().items()]

    def describe(self) -> Iterator[Any]:
        """The families without samples: lets a registry check names without a scrape."""
        yield from self._families(self._keys).values()

    def _families(self, keys: tuple[str, ...]) -> dict[str, Any]:
        p = self._prom
        kinds = {"counter": p.CounterMetricFamily, "gauge": p.GaugeMetricFamily,
                 "histogram": p.HistogramMetricFamily}
        out = {name: kinds[kind](name, doc, labels=[*keys, *labels]) for name, kind, labels, doc in FAMILIES}
        for _field, name, kind, doc in _RESOURCES:
            out[name] = kinds[kind](name, doc, labels=list(keys))
        return out

    def collect(self) -> Iterator[Any]:
        fams = self._families(self._keys)
        bounds = constants.LATENCY_BOUNDS
        for prefix, engine in self._engines():
            try:
                stats = engine.stats()
            except Exception as e:  # a closed engine still answers; anything else must not break a scrape
                _log.warning("skipping an engine in a metrics scrape: %s", e)
                continue
            for t in stats.transfers:
                labels = [*prefix, t.peer, t.path, t.op]
                fams["pdlink_transfers"].add_metric(labels, t.transfers)
                fams["pdlink_transfer_bytes"].add_metric(labels, t.bytes)
                fams["pdlink_transfer_descriptors"].add_metric(labels, t.descriptors)
                for stage in ("queue", "wire", "total"):
                    h = getattr(t, stage)
                    cumulative, buckets = 0, []
                    for bound, n in zip((*bounds, float("inf")), h.buckets):
                        cumulative += n
                        buckets.append((_le(bound), cumulative))
                    fams["pdlink_transfer_seconds"].add_metric([*labels, stage], buckets, h.sum)
            for f in stats.failures:
                fams["pdlink_transfer_failures"].add_metric([*prefix, f.peer, f.path, f.op, f.code, f.stage], f.count)
            for path, n in stats.links_by_path:
                fams["pdlink_links"].add_metric([*prefix, path], n)
            for ev in stats.link_events:
                fams["pdlink_link_events"].add_metric([*prefix, ev.peer, ev.event, ev.reason], ev.count)
            for field, name, _kind, _doc in _RESOURCES:
                fams[name].add_metric(list(prefix), getattr(stats, field))
        yield from fams.values()


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class Metrics:
    """An HTTP metrics endpoint inside this process that serves every open ``Engine`` of the
    process (label ``engine``: its cluster id), for programs that only import ``llm_datadist`` or
    ``hixl``. Off unless started: ``pdlink.Metrics(port=9400).start()``, or the environment
    variable ``PDLINK_METRICS=[HOST:]PORT`` read when the process makes its first engine. ``host``
    defaults to loopback: the endpoint has no authentication (docs/metrics.md)."""

    _lock = threading.Lock()
    _process: Metrics | None = None

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.host, self.port = host, port
        self.registry: Any = None
        self._server: Any = None

    def start(self) -> Metrics:
        """Starts serving (once per process: a second start returns the running endpoint), on the
        first free port of ``port`` .. ``port + PORT_SPAN - 1`` (``port`` 0: any free one), which
        ``.port`` then says. ``OSError`` when none is free."""
        with Metrics._lock:
            if Metrics._process is not None:
                return Metrics._process
            from prometheus_client import CollectorRegistry

            from .engine import open_engines

            self.registry = CollectorRegistry(auto_describe=True)
            self.registry.register(EngineCollector(_labelled(open_engines), label="engine"))
            server = None
            # Processes of one program (a TP group's ranks) often share the environment: each takes
            # the first free port of PORT .. PORT + PORT_SPAN - 1.
            for port in ([0] if self.port == 0 else range(self.port, min(self.port + PORT_SPAN, 65536))):
                try:
                    server = _serve(self.host, port, self.registry)
                    break
                except OSError as e:
                    if e.errno != errno.EADDRINUSE:
                        raise
            if server is None:
                raise OSError(errno.EADDRINUSE, f"pdlink metrics: ports {self.port} to "
                              f"{self.port + PORT_SPAN - 1} on {self.host} are all in use")
            self._server = server
            asked, self.port = self.port, server.server_address[1]
            Metrics._process = self
            if asked not in (0, self.port):
                _log.warning("pdlink metrics: port %d is in use; serving at http://%s:%d/metrics instead", asked,
                             self.host, self.port)
            else:
                _log.info("pdlink metrics at http://%s:%d/metrics", self.host, self.port)
            return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        with Metrics._lock:
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                self._server = None
            if Metrics._process is self:
                Metrics._process = None

    @classmethod
    def running(cls) -> Metrics | None:
        """The process's endpoint, if one was started."""
        return cls._process

    @classmethod
    def at(cls, address: str) -> Metrics:
        """Starts the process's endpoint at ``address`` (``PORT`` or ``HOST:PORT``), once: the
        endpoint already running otherwise. ``ValueError`` for a malformed address."""
        host, port = parse_address(address)
        return cls(port, host).start()

    @classmethod
    def from_environment(cls) -> Metrics | None:
        """Starts the endpoint ``PDLINK_METRICS`` names, once (``Metrics.at``); None when it is unset."""
        value = environment.read(environment.METRICS)
        if not value:
            return cls._process
        try:
            return cls.at(value)
        except ValueError as e:
            raise ValueError(f"{environment.METRICS.name}: {e}") from None
        except OSError as e:  # metrics must not stop the program: said, and left off
            _log.warning("%s=%s: no metrics endpoint: %s", environment.METRICS.name, value, e)
            return None


def _serve(host: str, port: int, registry: Any) -> Any:
    """prometheus_client's WSGI app on a server of one thread, started: connections are taken one at
    a time (the kernel's backlog of 16 holds the next), each closed after CONNECTION_SECONDS however
    slowly its client sends, so scrapers can make this process spend one serving thread, and while a
    connection is served its descriptor and one timer thread, and a backlog, never more
    (prometheus_client's own server spends a thread per connection)."""
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    class Handler(WSGIRequestHandler):
        timeout = CONNECTION_SECONDS  # each read and write (StreamRequestHandler)

        def handle(self) -> None:
            cut = threading.Timer(CONNECTION_SECONDS, self._cut)  # and the whole connection
            cut.daemon = True
            cut.start()
            try:
                super().handle()
            finally:
                cut.cancel()

        def _cut(self) -> None:
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # a scrape is not worth a line on stderr

    class Server(WSGIServer):
        request_queue_size = 16

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # a client that went away mid-answer, or was cut: nothing to report

    server = make_server(host, port, make_wsgi_app(registry), server_class=Server, handler_class=Handler)
    threading.Thread(target=server.serve_forever, name="pdlink-metrics", daemon=True).start()
    return server


def parse_address(value: str) -> tuple[str, int]:
    """``"PORT"`` or ``"HOST:PORT"`` -> (host, port); the host defaults to 127.0.0.1."""
    host, _, port = value.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected PORT or HOST:PORT, got {value!r}")
    return host or "127.0.0.1", int(port)


def _labelled(engines: Callable[[], list[Engine]]) -> Callable[[], dict[str, Engine]]:
    def by_cluster() -> dict[str, Engine]:
        out: dict[str, Engine] = {}
        for e in engines():
            key = str(e.cluster_id)
            n = 2
            while key in out:  # two engines of one cluster id (a process's devices): told apart
                key, n = f"{e.cluster_id}#{n}", n + 1
            out[key] = e
        return out

    return by_cluster
