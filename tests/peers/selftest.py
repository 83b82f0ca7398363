"""Peer-side functions for the tests of the test plumbing itself (tests/test_plumbing.py)."""

from __future__ import annotations

import os
import threading
from typing import Any

from llm_datadist import LLMException, LLMStatusCode


def echo(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    return args, kwargs, os.getpid()


def fail_with(code: LLMStatusCode, message: str) -> None:
    raise LLMException(message, status_code=code)


def unpicklable() -> Any:
    return threading.Lock()


def block() -> None:
    threading.Event().wait()  # never set: only the caller's bound ends this call


def die(code: int) -> None:
    os._exit(code)
