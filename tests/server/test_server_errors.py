"""The HTTP status of an engine error on pdlink's own endpoints: one status per ``LLMStatusCode``
(``pdlink.server.errors``), the table docs/server.md shows, and the test KV route answering with it."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from internals import DEFAULT_CONFIG_JSON
from pdlink.server import config as C
from pdlink.server.errors import HTTP_STATUS_OF_CODE, http_status
from pdlink.status import LLMException, LLMStatusCode
from server_util import asgi_post
from where import REPO

DOCS = REPO / "docs" / "server.md"


def _doc_table() -> dict[str, int]:
    text = open(DOCS, encoding="utf-8").read()
    block = re.search(r"<!-- http-status-table.*?-->\n(.*?)<!-- /http-status-table -->", text, re.S)
    assert block, "docs/server.md has no http-status-table"
    out: dict[str, int] = {}
    for line in block.group(1).splitlines()[2:]:
        status, _, codes = (cell.strip() for cell in line.strip().strip("|").split("|"))
        for name in re.findall(r"`(LLM_\w+)`", codes):
            assert name not in out, f"{name} has two rows"
            out[name] = int(status)
    return out


@pytest.mark.parametrize("code", list(LLMStatusCode), ids=lambda c: c.name)
def test_every_code_has_one_documented_status(code):
    doc = _doc_table()
    assert code in HTTP_STATUS_OF_CODE
    assert http_status(code) == doc[code.name]
    assert http_status(int(code)) == (500 if code is LLMStatusCode.LLM_UNKNOWN_ERROR else doc[code.name])


def test_the_table_names_only_members_and_unknown_codes_are_500():
    assert set(_doc_table()) == {c.name for c in LLMStatusCode}
    assert http_status(12345) == 500


@pytest.mark.parametrize("code, status", [
    (LLMStatusCode.LLM_NOT_YET_LINK, 409), (LLMStatusCode.LLM_EXIST_LINK, 409),
    (LLMStatusCode.LLM_ALREADY_LINK, 409), (LLMStatusCode.LLM_PARAM_INVALID, 422),
    (LLMStatusCode.LLM_TIMEOUT, 504), (LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, 504),
    (LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, 404), (LLMStatusCode.LLM_LINK_FAILED, 503),
    (LLMStatusCode.LLM_FAILED, 500),
])
def test_the_main_classes(code, status):
    assert http_status(code) == status


class _Node:
    """Raises what it is told to from ``test_pull``."""

    def __init__(self, error: BaseException):
        self.error = error

    def test_pull(self, target: int) -> dict:
        raise self.error


def _pull(error: BaseException, body: bytes = b'{"target": 7}') -> tuple[int, dict]:
    pytest.importorskip("starlette")
    from pdlink.server.app import build_apps

    raw = json.loads(DEFAULT_CONFIG_JSON)
    raw.setdefault("KvTransferConfig", {})["testKv"] = {"enabled": True}
    settings = C.parse(raw, C.EMBEDDED, None, {})
    app = build_apps(settings, _Node(error), None, None)[0]  # type: ignore[arg-type]
    return asyncio.run(asgi_post(app, "/v1/pdlink/test/kv/pull", body))


@pytest.mark.parametrize("code", [LLMStatusCode.LLM_NOT_YET_LINK, LLMStatusCode.LLM_TIMEOUT,
                                  LLMStatusCode.LLM_PARAM_INVALID, LLMStatusCode.LLM_LINK_FAILED,
                                  LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, LLMStatusCode.LLM_FAILED],
                         ids=lambda c: c.name)
def test_a_failed_pull_answers_the_codes_status(code):
    status, doc = _pull(LLMException("pull failed", status_code=code))
    assert status == http_status(code)
    assert doc == {"error": "pull failed", "error_type": code.name}


def test_a_pull_before_any_engine_stays_503():
    from pdlink.server.node import Unavailable

    status, doc = _pull(Unavailable("no engine yet"))
    assert status == 503
    assert doc == {"error": "no engine yet", "error_type": "Service Unavailable"}


@pytest.mark.parametrize("target", [-1, "7", True, None, 2**64 - 1])  # 2**64 - 1: ANY_CLUSTER, never an id
def test_a_target_that_is_no_instance_id_is_422(target):
    status, doc = _pull(AssertionError("not called"), json.dumps({"target": target}).encode())
    assert status == 422
    assert doc["error_type"] == "Input validation error"


def test_a_pulled_byte_that_differs_is_500():
    status, doc = _pull(ValueError("device 0 tensor 0: pulled bytes differ"))
    assert status == 500
    assert doc["error_type"] == "Verification Failed"
