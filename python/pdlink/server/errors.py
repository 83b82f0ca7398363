"""The HTTP status of an engine error: one table, ``HTTP_STATUS_OF_CODE``, from every
``LLMStatusCode`` to the status pdlink's own endpoints answer with: 404 what the request names
does not exist, 409 a conflict with the link, request or role state, 422 an invalid argument, 501 a
feature not enabled, 503 a link / device / memory failure, 504 a timeout, 500 anything else.
``POST /v1/role/*`` keeps MindIE's fixed statuses and never reads it. docs/server.md shows the
table; tests/server/test_server_errors.py checks that the two agree. The error body's ``error_type`` is
the code's name.
"""

from __future__ import annotations

from ..status import LLMStatusCode, code_2_status

__all__ = ["http_status", "HTTP_STATUS_OF_CODE"]

_C = LLMStatusCode

HTTP_STATUS_OF_CODE: dict[LLMStatusCode, int] = {
    _C.LLM_KV_CACHE_NOT_EXIST: 404,
    _C.LLM_PREFIX_NOT_EXIST: 404,
    _C.LLM_NOT_YET_LINK: 409,
    _C.LLM_ALREADY_LINK: 409,
    _C.LLM_EXIST_LINK: 409,
    _C.LLM_PROCESSING_LINK: 409,
    _C.LLM_CLUSTER_NUM_EXCEED_LIMIT: 409,
    _C.LLM_REPEAT_REQUEST: 409,
    _C.LLM_REQUEST_ALREADY_COMPLETED: 409,
    _C.LLM_PREFIX_ALREADY_EXIST: 409,
    _C.LLM_STALE_EPOCH: 409,
    _C.LLM_ROLE_SWITCHING: 409,
    _C.LLM_OFFER_RELEASED: 409,
    _C.LLM_PARAM_INVALID: 422,
    _C.LLM_SEQ_LENOVERLIMIT: 422,
    _C.LLM_FEATURE_NOT_ENABLED: 501,
    _C.LLM_LINK_FAILED: 503,
    _C.LLM_UNLINK_FAILED: 503,
    _C.LLM_NOTIFY_PROMPT_UNLINK_FAILED: 503,
    _C.LLM_LINK_BUSY: 503,
    _C.LLM_ENGINE_FINALIZED: 503,
    _C.LLM_DEVICE_OUT_OF_MEMORY: 503,
    _C.LLM_OUT_OF_MEMORY: 503,
    _C.LLM_BLOCKS_OUT_OF_MEMORY: 503,
    _C.LLM_NO_FREE_BLOCK: 503,
    _C.LLM_DEVICE_MEM_ERROR: 503,
    _C.LLM_SUSPECT_REMOTE_ERROR: 503,
    _C.LLM_TIMEOUT: 504,
    _C.LLM_WAIT_PROCESS_TIMEOUT: 504,
    _C.LLM_FAILED: 500,
    _C.LLM_UNKNOWN_ERROR: 500,
    _C.LLM_SUCCESS: 500,
}
"""Every ``LLMStatusCode`` member and its HTTP status (the module's table)."""


def http_status(code: LLMStatusCode | int) -> int:
    """The HTTP status for an engine error with status ``code`` (see the module's table); 500 for a
    code without a member."""
    member = code if isinstance(code, LLMStatusCode) else code_2_status(code)
    return HTTP_STATUS_OF_CODE.get(member, 500)
