"""Prometheus metrics of ``pdlink serve`` (served at ``/metrics`` on ``metricsPort``).

Every metric lives in the server's own registry (nothing global):

| metric | type | labels |
| --- | --- | --- |
| ``pdlink_links`` | gauge | ``device``: live links of each device's engine |
| ``pdlink_role_info`` | gauge (1) | ``role``, ``role_status``: the current role and its status |
| ``pdlink_peers`` | gauge | peers of the current assignment |
| ``pdlink_role_requests_total`` | counter | ``code``: HTTP status of each ``POST /v1/role/...`` |
| ``pdlink_role_switches_total`` | counter | ``role``: roles applied to the engines (the first assignment counts) |
| ``pdlink_transfer_bytes_total`` | counter | ``op``, ``direction`` (pull/push): bytes moved by this instance's transfers |
| ``pdlink_transfer_seconds`` | histogram | ``op``: latency of each successful transfer |
| ``pdlink_errors_total`` | counter | ``op``, ``code`` (``LLMStatusCode`` name): failed transfers, and links given up |
| ``pdlink_handoff_events_total`` | counter | ``kind``: KV handoff events taken from the engines (``released`` offers, peers' ``aborted`` requests) |

Transfers are counted on the side that initiates them (a pull is counted by the puller; the side
serving it moves bytes in its C++ threads and is not counted).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["Metrics", "CONTENT_TYPE_LATEST"]

_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _StateCollector:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._snapshot()
        links = GaugeMetricFamily("pdlink_links", "Live links of each device's engine", labels=["device"])
        for i, n in enumerate(snap["links"]):
            links.add_metric([str(i)], n)
        yield links
        role = GaugeMetricFamily("pdlink_role_info", "Current role and role status", labels=["role", "role_status"])
        role.add_metric([snap["role"] or "none", snap["role_status"]], 1)
        yield role
        yield GaugeMetricFamily("pdlink_peers", "Peers of the current assignment", value=snap["peers"])


class Metrics:
    """The server's metrics; the node reports events through the methods below."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.role_requests = Counter("pdlink_role_requests", "Role assignment requests by HTTP status", ["code"],
                                     registry=r)
        self.role_switches = Counter("pdlink_role_switches", "Roles applied to the engines", ["role"], registry=r)
        self.bytes = Counter("pdlink_transfer_bytes", "Bytes moved by transfers this instance initiated",
                             ["op", "direction"], registry=r)
        self.latency = Histogram("pdlink_transfer_seconds", "Latency of successful transfers", ["op"],
                                 buckets=_BUCKETS, registry=r)
        self.errors = Counter("pdlink_errors", "Failed transfers and links given up, by LLMStatusCode",
                              ["op", "code"], registry=r)
        self.handoffs = Counter("pdlink_handoff_events", "KV handoff events taken from the engines", ["kind"],
                                registry=r)

    def attach(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(_StateCollector(snapshot))

    # events
    def role_request(self, status: int) -> None:
        self.role_requests.labels(str(status)).inc()

    def role_switch(self, role: str) -> None:
        self.role_switches.labels(role).inc()

    def transfer_done(self, op: str, direction: str, nbytes: int, seconds: float) -> None:
        self.bytes.labels(op, direction).inc(nbytes)
        self.latency.labels(op).observe(seconds)

    def transfer_failed(self, op: str, code: str) -> None:
        self.errors.labels(op, code).inc()

    def link_failed(self, code: str) -> None:
        self.errors.labels("link", code).inc()

    def handoff_event(self, kind: str) -> None:
        self.handoffs.labels(kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
