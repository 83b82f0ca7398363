"""vllm.v1.request: a request and its status (scheduler side)."""

from __future__ import annotations

import enum
from typing import Any


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH_CAPPED = 3
    FINISHED_ABORTED = 4


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], kv_transfer_params: dict[str, Any] | None,
                 status: RequestStatus = RequestStatus.WAITING) -> None:
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.kv_transfer_params, self.status = kv_transfer_params, status
