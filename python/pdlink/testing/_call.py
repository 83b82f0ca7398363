"""Run one module-level function in this process and hand back its result (``Host.run`` /
``Host.spawn`` of ``pdlink.testing.hosts``); run as a script inside a host.

Reads one pickle from stdin: ``(sys_path, function, args, kwargs)``. Writes one pickle to the file
descriptor named by ``argv[1]`` (or nowhere when ``-``): ``("ok", result)`` or ``("error",
exception, traceback_text)``; an exception that does not pickle travels as a RuntimeError naming its
type and message. Exit status 0 when the function returned, 1 when it raised.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from typing import Any


def main() -> None:
    out_fd = None if sys.argv[1] == "-" else int(sys.argv[1])
    stream = sys.stdin.buffer
    sys_path = pickle.load(stream)  # first, so the function's module imports
    sys.path[:] = [p for p in sys_path if p] + [p for p in sys.path if p not in sys_path]
    try:
        function, args, kwargs = pickle.load(stream)
    except BaseException as e:  # noqa: BLE001
        raise SystemExit(_report(out_fd, e)) from None
    raise SystemExit(_run(out_fd, function, args, kwargs))


def _report(out_fd: int | None, e: BaseException) -> int:
    text = traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(e))
        result: tuple = ("error", e, text)
    except Exception:  # noqa: BLE001
        result = ("error", RuntimeError(f"{type(e).__name__}: {e}"), text)
    _write(out_fd, result)
    return 1


def _write(out_fd: int | None, result: tuple) -> None:
    if out_fd is not None:
        blob = pickle.dumps(result)
        with os.fdopen(out_fd, "wb") as f:
            f.write(blob)


def _run(out_fd: int | None, function: Any, args: tuple, kwargs: dict) -> int:
    try:
        result = function(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
        return _report(out_fd, e)
    _write(out_fd, ("ok", result))
    return 0


if __name__ == "__main__":
    main()
