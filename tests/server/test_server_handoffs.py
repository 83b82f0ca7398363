"""``GET /v1/status`` counts KV handoffs (issue 35): ``pdlink.handoffs.offersLive`` (offers of the
instance's engines not yet released) and ``pdlink.handoffs.strandedBytes`` (the bytes those offers
retain), and each device's ``offersLive`` / ``strandedBytes``, read from the engines' ``stats()``;
the server takes the engines' handoff events (released offers, a peer's abort) and counts them
(``released``, ``aborted``; ``eventsDropped`` none), in ``/metrics`` too.

The server runs in this process (``pdlink.server.node.Node`` with the app of ``build_apps``, driven
by ASGI messages: no socket), so the test reaches the engine the role post created and makes
offers on it: one released by ``Offer.release()``, one claimed by a decoder engine of this process
(its whole destination checked). The counts are polled up, then back to 0. MindIE's part of the
body keeps exactly its fields.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import pdlink
from poll import wait_until
from server_util import LOCAL, decode_body, free_block, free_ports, write_config

pytest.importorskip("starlette")

P_ID, NOBODY = 1, 9  # the prefill instance; a peer that never exists
BLOCK, BLOCKS = 4096, 8
SERVICE_KEYS = {"roleStatus", "currentRole"}
RESOURCE_KEYS = {"availSlotsNum", "availBlockNum", "waitingRequestNum", "runningRequestNum", "swappedRequestNum",
                 "freeNpuBlockNums", "freeCpuBlockNums", "totalNpuBlockNums", "totalCpuBlockNums"}


async def _get(app: Any, path: str) -> tuple[int, dict[str, Any]]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


@pytest.fixture
def prefill(tmp_path) -> Iterator[Any]:
    """A prefill instance (in this process) that applied its role: ``(node, app)``."""
    from pdlink.server.app import build_apps
    from pdlink.server.config import load
    from pdlink.server.metrics import Metrics
    from pdlink.server.node import Node
    from pdlink.server.validation import parse_role_request

    mgmt, metrics = free_ports(2)
    path = write_config(os.path.join(str(tmp_path), "conf", "config.json"),
                        {"ipAddress": LOCAL, "port": mgmt, "managementPort": mgmt, "metricsPort": metrics,
                         "httpsEnabled": False},
                        kv={"listenPortBase": free_block(8), "linkTotalTimeMs": 500, "linkRetryIntervalMs": 50,
                            "testKv": {"enabled": False}})
    settings = load(path, env={})
    node = Node(settings, Metrics())
    try:
        node.accept(parse_role_request("prefill", decode_body(P_ID, [0], [(NOBODY, [0])])))
        wait_until(lambda: node._engines and node.status()["pdlink"]["appliedGeneration"] == 1, 20,
                   "the prefill role applied")
        yield node, build_apps(settings, node, None, None)[0]  # type: ignore[arg-type]  # GET needs no decoder
    finally:
        node.close()


def _status(app: Any) -> dict[str, Any]:
    code, doc = asyncio.run(_get(app, "/v1/status"))
    assert code == 200
    return doc


def _counts(app: Any) -> tuple[int, int]:
    h = _status(app)["pdlink"]["handoffs"]
    return h["offersLive"], h["strandedBytes"]


def _events(app: Any) -> tuple[int, int, int]:
    h = _status(app)["pdlink"]["handoffs"]
    return h["released"], h["aborted"], h["eventsDropped"]


NO_HANDOFFS = {"offersLive": 0, "strandedBytes": 0, "released": 0, "aborted": 0, "eventsDropped": 0}


def test_status_counts_live_offers_and_their_bytes_until_released(prefill):
    node, app = prefill
    doc = _status(app)
    assert set(doc["service"]) == SERVICE_KEYS and set(doc["resource"]) == RESOURCE_KEYS
    assert set(doc) == {"service", "resource", "linkStatus", "pdlink"}
    assert doc["pdlink"]["handoffs"] == NO_HANDOFFS
    assert (doc["pdlink"]["devices"][0]["offersLive"], doc["pdlink"]["devices"][0]["strandedBytes"]) == (0, 0)

    engine: pdlink.Engine = node._engines[0]
    source = (np.arange(BLOCKS * BLOCK) % 251 + 1).astype(np.uint8)
    region = engine.register(source, block_size=BLOCK, key=5)
    released = engine.offer(region, [1, 2, 3], request_id="req-release")
    claimed = engine.offer(region, [6], request_id="req-claim")
    wait_until(lambda: _counts(app) == (2, 4 * BLOCK), 10, "two offers of 4 blocks counted")
    dev = _status(app)["pdlink"]["devices"][0]
    assert (dev["offersLive"], dev["strandedBytes"]) == (2, 4 * BLOCK)

    released.release()
    assert released.wait(10) and released.reason == "released"
    wait_until(lambda: _counts(app) == (1, BLOCK), 10, "one offer of 1 block left")

    # a decoder of this process claims the other one: the claim's commit releases it
    dest = np.zeros(2 * BLOCK, np.uint8)
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=77, timeout_ms=10000)) as decoder:
        local = decoder.register(dest, block_size=BLOCK)
        decoder.claim(claimed.ticket, local, [1])
        assert claimed.wait(10) and claimed.reason == "claimed"
        wait_until(lambda: _counts(app) == (0, 0), 10, "no live offer")
        # the decoder aborts a request: the prefill's engine queues the event, the server takes it
        decoder.abort("req-gone", peer=P_ID, reason="client went away")
        wait_until(lambda: _events(app) == (2, 1, 0), 10, "two released offers and one abort taken")
    assert np.array_equal(dest[BLOCK:], source[6 * BLOCK:7 * BLOCK]) and not dest[:BLOCK].any()
    assert (engine.released(), engine.handoff_events()) == ([], [])  # taken by the server, none left
    doc = _status(app)
    assert set(doc["service"]) == SERVICE_KEYS and set(doc["resource"]) == RESOURCE_KEYS
    assert doc["pdlink"]["handoffs"] == {**NO_HANDOFFS, "released": 2, "aborted": 1}
    rendered = node._metrics.render().decode()
    assert 'pdlink_handoff_events_total{kind="released"} 2.0' in rendered
    assert 'pdlink_handoff_events_total{kind="aborted"} 1.0' in rendered
