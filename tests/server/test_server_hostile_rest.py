"""``pdlink serve``'s REST surface against a hostile HTTP client, in process (the real ASGI app of
``pdlink.server.app.build_apps`` with the real body decoder, driven by raw ASGI messages), with a
node that records every call: a bad body or a role name that is not exactly one of the table's
never reaches the node (nothing changes), and garbage always gets a 4xx, never a 5xx; each REST
role maps to exactly the engine role its table row names (``_core.Role``, ``LLMRole``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from internals import DEFAULT_CONFIG_JSON
from server_util import asgi_post

pytest.importorskip("starlette")

from pdlink.server import config as C  # noqa: E402
from pdlink.server.parsing import BodyDecoder  # noqa: E402
from pdlink.server.roles import ROLES  # noqa: E402


class SpyNode:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def accept(self, req):  # noqa: ANN001
        self.calls.append(("accept", req))
        return 1

    def test_pull(self, target: int) -> dict:
        self.calls.append(("test_pull", target))
        return {"result": "ok"}

    def status(self) -> dict:
        return {}

    def healthy(self) -> bool:
        return True


class Metrics:
    def role_request(self, code: int) -> None:
        pass


@pytest.fixture
def app():
    from pdlink.server.app import build_apps

    raw = json.loads(DEFAULT_CONFIG_JSON)
    raw.setdefault("KvTransferConfig", {})["testKv"] = {"enabled": True}
    settings = C.parse(raw, C.EMBEDDED, None, {})
    node, decoder = SpyNode(), BodyDecoder()
    application = build_apps(settings, node, Metrics(), decoder)[0]  # type: ignore[arg-type]
    yield application, node
    decoder.close()


VALID: dict[str, Any] = {
    "local": {"server_ip": "127.0.0.1", "device": [{"device_logical_id": "0", "device_ip": "127.0.0.1"}]},
    "peers": [{"server_ip": "127.0.0.2", "device": [{"device_logical_id": "0", "device_ip": "127.0.0.2"}]}]}


def test_the_role_table_maps_each_rest_name_to_its_engine_role() -> None:
    from llm_datadist import LLMRole
    from pdlink.native import core

    assert {r.name: r.engine_role for r in ROLES.values()} == {"prefill": "PROMPT", "decode": "DECODER",
                                                                 "flex": "MIX"}
    assert {r.name: r.listens for r in ROLES.values()} == {"prefill": True, "decode": False, "flex": True}
    for r in ROLES.values():
        assert hasattr(core().Role, r.engine_role) and hasattr(LLMRole, r.engine_role), r


NEAR_MISSES = ["Prefill", "PREFILL", "prefill ", " prefill", "prefill%00", "prefill%20", "prefil", "prefilll",
               "PROMPT", "DECODER", "MIX", "prompt", "decoder", "mix", "pre\u0456ll", "ﬂex",
               "flex%2F", "flex.", "decode;", "decode%0A", "%E2%80%8Bdecode", "__init__", "ROLES", "name",
               "get", "0", "-1", ".."]


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_a_role_name_that_is_not_exactly_one_of_the_table_is_404_and_changes_nothing(app, name: str) -> None:
    application, node = app
    status, doc = asyncio.run(asgi_post(application, f"/v1/role/{name}", json.dumps(VALID).encode()))
    assert status in (404, 405), (name, status, doc)
    assert node.calls == []


@pytest.mark.parametrize("name", sorted(ROLES))
def test_an_honest_post_reaches_the_node(app, name: str) -> None:
    application, node = app
    status, doc = asyncio.run(asgi_post(application, f"/v1/role/{name}", json.dumps(VALID).encode()))
    assert status == 200, doc
    assert [c[0] for c in node.calls] == ["accept"] and node.calls[0][1].role == name


GARBAGE = [
    b"", b"{", b"null", b"[]", b'"local"', b"0", b"NaN", b'{"local": NaN}', b'{"local": Infinity}',
    b"\xef\xbb\xbf" + json.dumps(VALID).encode(), json.dumps(VALID).encode("utf-16"), b"\xff\xfe\x00",
    b'{"local": "\\ud800"}', b'{"local": {"server_ip": "\\ud800", "device": []}}',
    b'{"local": {"server_ip": "1e400", "device": [{"device_logical_id": "0", "device_ip": "127.0.0.1"}]}}',
    json.dumps({**VALID, "local": {**VALID["local"], "id": 2**64, "host_ip": "127.0.0.1"}}).encode(),
    json.dumps({**VALID, "local": {**VALID["local"], "id": -1, "host_ip": "127.0.0.1"}}).encode(),
    json.dumps({**VALID, "local": {**VALID["local"], "id": True, "host_ip": "127.0.0.1"}}).encode(),
    json.dumps({**VALID, "local": {**VALID["local"], "id": 1.5, "host_ip": "127.0.0.1"}}).encode(),
    json.dumps({**VALID, "local": {**VALID["local"], "device": [{"device_logical_id": "0" * 11,
                                                                  "device_ip": "127.0.0.1"}]}}).encode(),
    json.dumps({**VALID, "local": {**VALID["local"], "device": [{"device_logical_id": "\u0661",
                                                                  "device_ip": "127.0.0.1"}]}}).encode(),
    json.dumps({**VALID, "local": {**VALID["local"], "server_ip": "fe80::1%\u00e9"}}).encode(),
    json.dumps({**VALID, "peers": [VALID["local"]]}).encode(),  # the local instance as its own peer
    json.dumps({**VALID, "peers": [VALID["peers"][0]] * 2}).encode(),
    json.dumps({**VALID, "peers": {"0": VALID["peers"][0]}}).encode(),
    b'{"p_percentage": 1e400, "local": 1}',
    b"[" * 40 + b"]" * 40, b'{"local":' * 40 + b"1" + b"}" * 40, b"1" * 5000,
    b'{"local": {"server_ip": "127.0.0.1", "device": [' + b"{}," * 3000 + b"{}]}}",
]


@pytest.mark.parametrize("role", sorted(ROLES))
def test_a_garbage_role_body_gets_a_4xx_and_changes_nothing(app, role: str) -> None:
    application, node = app
    for body in GARBAGE:
        status, doc = asyncio.run(asgi_post(application, f"/v1/role/{role}", body))
        assert 400 <= status < 500, (body[:80], status, doc)
        assert set(doc) == {"error", "error_type"}, doc
    assert node.calls == []


PULL_GARBAGE = [
    b"", b"{", b"null", b"[]", b"7", b'"7"', b'{"target": "7"}', b'{"target": NaN}', b'{"target": Infinity}',
    b'{"target": 1e400}', b'{"target": 7.0}', b'{"target": -1}',
    b'{"target": true}', b'{"target": null}', b'{"target": [7]}', b'{"target": {"a": 7}}',
    b'{"target": 18446744073709551615}', b'{"target": 18446744073709551616}', b'{"target": 1' + b"0" * 4000 + b"}",
    b'{"Target": 7}', b'{"target": 7, "target": "x"}', b"\xef\xbb\xbf{\"target\": 7}", '{"target": 7}'.encode("utf-16"),
    b"\xff", b'{"target": "\\ud800"}', b"[" * 3000 + b"]" * 1000, b'{"target":' * 2000,
    b" " * 5000,
]


def test_a_garbage_pull_body_gets_a_4xx_and_never_pulls(app) -> None:
    application, node = app
    for body in PULL_GARBAGE:
        status, doc = asyncio.run(asgi_post(application, "/v1/pdlink/test/kv/pull", body))
        assert 400 <= status < 500, (body[:80], status, doc)
        assert set(doc) == {"error", "error_type"}, doc
    for ctype in (b"text/plain", b"application/jsonx", b"", b"application/json\x00"):
        status, _ = asyncio.run(asgi_post(application, "/v1/pdlink/test/kv/pull", b'{"target": 7}', ctype))
        assert status == 400, ctype
    assert node.calls == []
    status, doc = asyncio.run(asgi_post(application, "/v1/pdlink/test/kv/pull", b'{"target": 7}'))
    assert status == 200 and node.calls == [("test_pull", 7)], doc
