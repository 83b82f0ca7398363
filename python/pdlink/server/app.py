"""The HTTP routes of ``pdlink serve`` (Starlette; needs ``pdlink[server]``).

Management plane:

| route | answer |
| --- | --- |
| ``POST /v1/role/{prefill,decode,flex}`` | 200 ``{"result":"ok"}``; 400 not JSON / wrong content type; 404 unknown role; 408 body not received within ``bodyTimeoutMs``; 413 body over ``maxRequestLength``; 422 body breaks the rules (``validation``), or nests deeper than ``maxJsonDepth`` / holds more than ``parsing.MAX_JSON_ITEMS`` items (counted before decoding); 503 cannot be applied (``node.Unavailable``) |
| ``POST /v1/role/{...}`` with ``expected_epoch`` | as above, and 409 when the epoch is stale or another switch is pending (nothing changed); an unfenced post while a fenced switch is pending: 503 |
| ``GET /v1/pd_role`` | 200 vLLM's role document (``node.pd_role``); 404 ``inferMode`` standard |
| ``POST /v1/pd_role`` | vLLM's: 202 accepted (or the same role again: nothing to do); 409 stale epoch, a switch in progress, no role yet; 422 any fault of the body (not JSON, wrong type, missing field, as FastAPI answers vLLM's); 404 ``inferMode`` standard; 408; 413; 503 shutting down |
| ``POST /pd_role_switch`` | SGLang's: 200 ``{"success": true, ...}`` switched or already in the role; 400 ``{"success": false, ...}`` for every refusal and every body fault; 408; 413 |
| ``GET /v1/status`` | 200 MindIE's status document, plus a ``pdlink`` object |
| ``GET /v1/config`` | 200 model statics (``BackendConfig``) |
| ``GET /health`` | 200 empty; 500 error JSON when unhealthy |
| ``GET /v2/health/live``, ``GET /v2/health/ready`` | 200 empty; 500 ``{"message": ...}`` when unhealthy |
| ``POST /v1/pdlink/test/kv/pull`` | only with ``KvTransferConfig.testKv.enabled`` (test/demo surface): 200 pulled and verified; 400 not JSON; 408; 413; 422 ``target`` is not a peer instance id; 503 no engine yet (``node.Unavailable``); an engine error: ``errors.http_status`` of its code (409 not linked, 504 timed out, ...); 500 a byte differs |

Metrics plane (or the management plane when ``metricsPort == managementPort``): ``GET /metrics``.

Every error body is ``{"error": ..., "error_type": ...}``; every response carries
``Connection: close`` and a ``RequestUUID`` header, as MindIE's server does. Below the app,
``guard.py`` bounds how long a request head may take and how many connections one client holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import constants
from ..status import LLMException, LLMStatusCode, code_2_status
from .config import Settings
from .errors import http_status
from .node import Conflict, Fenced, Node, NotEnabled, Unavailable
from .parsing import BodyDecoder
from .roles import ROLE_NAMES, ROLES
from .validation import MAX_EPOCH

__all__ = ["build_apps"]

logger = logging.getLogger("pdlink.server")

_RESET = "Reset to previous node status."
SWITCH_BODY_LIMIT = 4096  # bytes: the body of POST /v1/pd_role and /pd_role_switch (a few fields)
MAX_DRAIN_TIMEOUT_S = 3600.0  # vLLM's bound on drain_timeout
_ROLE_LIST = ", ".join(ROLE_NAMES[:-1]) + " and " + ROLE_NAMES[-1]  # "prefill, decode and flex"


def error(status: int, message: str, error_type: str) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": error_type}, status_code=status)


class _Headers:
    """ASGI middleware: ``Connection: close`` and ``RequestUUID`` on every response."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"connection"]
                headers += [(b"connection", b"close"), (b"requestuuid", uuid.uuid4().hex.encode())]
                message = dict(message, headers=headers)
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def _read_limited(request: Request, limit: int) -> bytes | None:
    """The body, or None when it exceeds ``limit`` bytes (reading stops there)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


async def _read_body(request: Request, limit: int, seconds: float) -> bytes | None:
    """``_read_limited`` within ``seconds`` (``bodyTimeoutMs``, counted from here, right after the
    head): ``asyncio.TimeoutError`` past it, and what was read is dropped."""
    return await asyncio.wait_for(_read_limited(request, limit), seconds)


def engine_error(e: LLMException) -> JSONResponse:
    """The answer of a pdlink endpoint to an engine error: ``http_status`` of its code, and the
    code's name as ``error_type``. (``POST /v1/role/*`` never answers this way: MindIE's contract.)"""
    raw = e.status_code
    code = raw if isinstance(raw, LLMStatusCode) else code_2_status(raw)
    return error(http_status(code), str(e), code.name)


def _timed_out(ms: int) -> JSONResponse:
    return error(408, f"the request body was not received within bodyTimeoutMs ({ms} ms)", "Request Timeout")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _handlers(settings: Settings, node: Node, metrics: Any, decoder: BodyDecoder) -> dict[str, Any]:
    role_lock = asyncio.Lock()
    limit = settings.max_request_bytes
    body_ms = settings.body_timeout_ms

    async def role(request: Request) -> Response:
        response = await _role(request)
        metrics.role_request(response.status_code)
        return response

    async def _role(request: Request) -> Response:
        name = request.path_params["role"]
        if name not in ROLES:
            return error(404, f"unknown role {name!r}: the roles are {_ROLE_LIST}", "NotFoundError")
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            return error(400, f"Content-Type must be application/json, got {ctype or 'none'!r}", "Bad Request")
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return error(400, "invalid Content-Length", "Bad Request")
            if int(length) > limit:
                return error(413, f"request body of {length} bytes exceeds maxRequestLength ({limit} bytes)",
                             "Payload Too Large")
        try:
            body = await _read_body(request, limit, body_ms / 1000)
        except ClientDisconnect:  # nobody to answer
            return error(400, "the client disconnected before sending the whole body", "Bad Request")
        except asyncio.TimeoutError:
            return _timed_out(body_ms)
        if body is None:
            return error(413, f"request body exceeds maxRequestLength ({limit} bytes)", "Payload Too Large")
        kind, req = await decoder.decode(name, body)  # large bodies in a worker process: see parsing.py
        if kind == "json":
            return error(400, f"request body is not valid JSON: {req}. {_RESET}", "Bad Request")
        if kind == "body":
            return error(422, f"{req}. {_RESET}", "Input validation error")
        async with role_lock:  # role posts are serialised
            try:
                generation = node.accept(req)
            except Unavailable as e:
                return error(503, f"{e}. {_RESET}", "Service Unavailable")
            except Conflict as e:
                return error(409, f"{e}. {_RESET}", "Conflict")
        return JSONResponse({"result": "ok"}, headers={"X-Pdlink-Generation": str(generation)})

    async def status(request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(node.status))

    async def config(request: Request) -> Response:
        m = settings.model
        return JSONResponse({"modelName": m.model_name, "maxSeqLen": m.max_seq_len, "npuMemSize": m.npu_mem_size,
                             "cpuMemSize": m.cpu_mem_size, "worldSize": m.world_size,
                             "maxOutputLen": m.max_output_len, "cacheBlockSize": m.cache_block_size})

    async def health(request: Request) -> Response:
        if await run_in_threadpool(node.healthy):
            return Response(status_code=200)
        return error(500, "a KV link was lost and no peer is linked", "Service Unhealthy")

    async def probe(request: Request) -> Response:
        if await run_in_threadpool(node.healthy):
            return Response(status_code=200)
        return JSONResponse({"message": "Service is abnormal: a KV link was lost and no peer is linked"},
                            status_code=500)

    async def test_kv_pull(request: Request) -> Response:
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            return error(400, "Content-Type must be application/json", "Bad Request")
        try:
            body = await _read_body(request, 4096, body_ms / 1000)
        except ClientDisconnect:
            return error(400, "the client disconnected before sending the whole body", "Bad Request")
        except asyncio.TimeoutError:
            return _timed_out(body_ms)
        if body is None:
            return error(413, "request body too large", "Payload Too Large")
        try:
            data = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return error(400, "request body is not valid JSON", "Bad Request")
        target = data.get("target") if isinstance(data, dict) else None
        if not isinstance(target, int) or isinstance(target, bool) or not 0 <= target < constants.ANY_CLUSTER:
            return error(422, "target must be a peer instance id (unsigned integer)", "Input validation error")
        try:
            return JSONResponse(await run_in_threadpool(node.test_pull, target))
        except Unavailable as e:
            return error(503, str(e), "Service Unavailable")
        except Fenced as e:
            return error(409, str(e), "Conflict")
        except LLMException as e:
            return engine_error(e)
        except ValueError as e:
            return error(500, f"KV verification failed: {e}", "Verification Failed")

    async def small_body(request: Request) -> tuple[int, str] | Any:
        """The decoded JSON body of a switch post (at most ``SWITCH_BODY_LIMIT`` bytes, within
        ``bodyTimeoutMs``), or ``(status, why)``: 413, 408, or 0 for a body that is not JSON."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in ("", "application/json"):
            return 0, f"Content-Type must be application/json, got {ctype!r}"
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > SWITCH_BODY_LIMIT:
            return 413, f"request body of {length} bytes exceeds {SWITCH_BODY_LIMIT} bytes"
        try:
            raw = await _read_body(request, SWITCH_BODY_LIMIT, body_ms / 1000)
        except ClientDisconnect:
            return 0, "the client disconnected before sending the whole body"
        except asyncio.TimeoutError:
            return 408, f"the request body was not received within bodyTimeoutMs ({body_ms} ms)"
        if raw is None:
            return 413, f"request body exceeds {SWITCH_BODY_LIMIT} bytes"
        try:
            return [json.loads(raw.decode("utf-8"), parse_constant=_no_constant)]
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            return 0, f"request body is not valid JSON: {e}"

    def vllm_error(status: int, message: str, error_type: str) -> JSONResponse:
        # vLLM (FastAPI) answers {"detail": ...}; ours carry error and error_type too
        return JSONResponse({"detail": message, "error": message, "error_type": error_type}, status_code=status)

    async def pd_role_get(request: Request) -> Response:
        if settings.infer_mode != "dmi":
            return vllm_error(404, "Runtime P/D role switching is not enabled (ServerConfig.inferMode is 'standard')",
                              "NotFoundError")
        return JSONResponse(node.pd_role())

    async def pd_role_post(request: Request) -> Response:
        got = await small_body(request)
        if isinstance(got, tuple):
            status, why = got
            return vllm_error(status or 422, why, "Input validation error" if not status else
                              ("Payload Too Large" if status == 413 else "Request Timeout"))
        data = got[0]
        if not isinstance(data, dict):
            return vllm_error(422, "the request body must be a JSON object", "Input validation error")
        role = data.get("role")
        if not isinstance(role, str) or role not in ROLES:
            return vllm_error(422, f"role must be one of {_ROLE_LIST}, got {role!r}", "Input validation error")
        epoch = data.get("expected_epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch <= MAX_EPOCH:
            return vllm_error(422, f"expected_epoch must be an integer >= 0, got {epoch!r}", "Input validation error")
        drain = data.get("drain_timeout", settings.kv.role_drain_timeout_ms / 1000)
        if (not isinstance(drain, (int, float)) or isinstance(drain, bool) or not 0 < drain <= MAX_DRAIN_TIMEOUT_S):
            return vllm_error(422, f"drain_timeout must be a number of seconds in (0, {MAX_DRAIN_TIMEOUT_S:g}], "
                                   f"got {drain!r}", "Input validation error")
        try:
            _, doc = node.pd_switch(role, epoch, float(drain))
        except NotEnabled as e:
            return vllm_error(404, str(e), "NotFoundError")
        except Conflict as e:
            return vllm_error(409, str(e), "Conflict")
        except Unavailable as e:
            return vllm_error(503, str(e), "Service Unavailable")
        return JSONResponse(doc, status_code=202)

    async def pd_role_switch(request: Request) -> Response:
        got = await small_body(request)
        current = node.pd_role()["role"]
        if isinstance(got, tuple):
            status, why = got
            return JSONResponse({"success": False, "message": why, "old_role": current, "new_role": None},
                                status_code=status or 400)
        data = got[0]
        new_role = data.get("new_role") if isinstance(data, dict) else None
        if not isinstance(new_role, str):
            return JSONResponse({"success": False, "message": f"invalid new_role {new_role!r}: must be 'prefill' or "
                                 "'decode'", "old_role": current, "new_role": None}, status_code=400)
        status, doc = await run_in_threadpool(node.sgl_switch, new_role)
        return JSONResponse(doc, status_code=status)

    async def metrics_route(request: Request) -> Response:
        from .metrics import CONTENT_TYPE_LATEST

        return Response(await run_in_threadpool(metrics.render), media_type=CONTENT_TYPE_LATEST)

    return {"role": role, "status": status, "config": config, "health": health, "probe": probe,
            "test_kv_pull": test_kv_pull, "metrics": metrics_route, "pd_role_get": pd_role_get,
            "pd_role_post": pd_role_post, "pd_role_switch": pd_role_switch}


async def _not_found(request: Request, exc: Exception) -> Response:
    return error(404, f"no route for {request.method} {request.url.path}", "NotFoundError")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return await _not_found(request, exc)
    if exc.status_code == 405:
        return error(405, f"method {request.method} is not allowed on {request.url.path}", "Method Not Allowed")
    return error(exc.status_code, str(exc.detail), "Bad Request" if exc.status_code == 400 else "Error")


async def _internal(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error(500, "Server internal error", "Internal Server Error")


def build_apps(settings: Settings, node: Node, metrics: Any, decoder: BodyDecoder) -> list[Any]:
    """One ASGI app per plane of ``settings.planes``, in that order. `decoder` decodes role bodies
    (the caller closes it after the servers stop)."""
    h = _handlers(settings, node, metrics, decoder)
    apps = []
    for plane in settings.planes:
        routes: list[Route] = []
        if "management" in plane.routes:
            routes += [
                Route("/v1/role/{role}", h["role"], methods=["POST"]),
                Route("/v1/status", h["status"], methods=["GET"]),
                Route("/v1/pd_role", h["pd_role_get"], methods=["GET"]),
                Route("/v1/pd_role", h["pd_role_post"], methods=["POST"]),
                Route("/pd_role_switch", h["pd_role_switch"], methods=["POST"]),
                Route("/v1/config", h["config"], methods=["GET"]),
                Route("/health", h["health"], methods=["GET"]),
                Route("/v2/health/live", h["probe"], methods=["GET"]),
                Route("/v2/health/ready", h["probe"], methods=["GET"]),
            ]
            if settings.kv.test_kv.enabled:
                routes.append(Route("/v1/pdlink/test/kv/pull", h["test_kv_pull"], methods=["POST"]))
        if "metrics" in plane.routes:
            routes.append(Route("/metrics", h["metrics"], methods=["GET"]))
        app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, 404: _not_found,
                                                           Exception: _internal})
        # an unknown path is a 404, also with a trailing slash: no 307 to a Location built from the
        # client's Host header
        app.router.redirect_slashes = False
        apps.append(_Headers(app))
    return apps
