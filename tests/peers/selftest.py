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


def identity(names: list[str]) -> dict[str, Any]:
    """What tells a forked peer from a new interpreter: its parent, the address of a module the
    fork server imported, four ports drawn by tests/ports.py, the given variables."""
    import numpy

    import ports

    return {
        "ppid": os.getppid(),
        "numpy_at": id(numpy),
        "ports": ports.free_ports(4),
        "env": {name: os.environ.get(name) for name in names},
    }
