"""Prometheus metrics of ``pdlink serve`` (served at ``/metrics`` on ``metricsPort``).

Every metric lives in the server's own registry (nothing global). The engines' own families
(``pdlink.metrics``: ``pdlink_transfers_total``, ``pdlink_transfer_bytes_total``,
``pdlink_transfer_seconds``, ``pdlink_transfer_failures_total``, ``pdlink_links``,
``pdlink_link_events_total`` and the resource gauges and counters) come with a leading ``device``
label, one engine per device. The server adds:

| metric | type | labels |
| --- | --- | --- |
| ``pdlink_role_info`` | gauge (1) | ``role``, ``role_status``: the current role and its status |
| ``pdlink_peers`` | gauge | peers of the current assignment |
| ``pdlink_role_requests_total`` | counter | ``code``: HTTP status of each ``POST /v1/role/...`` |
| ``pdlink_role_switches_total`` | counter | ``role``: roles applied to the engines (the first assignment counts) |
| ``pdlink_errors_total`` | counter | ``op`` (``link``), ``code`` (``LLMStatusCode`` name): links given up |
| ``pdlink_handoff_events_total`` | counter | ``kind``: KV handoff events taken from the engines (``released`` offers, peers' ``aborted`` requests) |
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..metrics import EngineCollector

__all__ = ["Metrics", "CONTENT_TYPE_LATEST"]


class _StateCollector:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._snapshot()
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
        self.errors = Counter("pdlink_errors", "Links given up, by LLMStatusCode", ["op", "code"], registry=r)
        self.handoffs = Counter("pdlink_handoff_events", "KV handoff events taken from the engines", ["kind"],
                                registry=r)

    def attach(self, snapshot: Callable[[], dict[str, Any]], engines: Callable[[], Mapping[str, Any]]) -> None:
        """``snapshot``: the node's role and peers; ``engines``: its engines by device."""
        self.registry.register(_StateCollector(snapshot))
        self.registry.register(EngineCollector(engines, label="device"))

    # events
    def role_request(self, status: int) -> None:
        self.role_requests.labels(str(status)).inc()

    def role_switch(self, role: str) -> None:
        self.role_switches.labels(role).inc()

    def link_failed(self, code: str) -> None:
        self.errors.labels("link", code).inc()

    def handoff_event(self, kind: str) -> None:
        self.handoffs.labels(kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
