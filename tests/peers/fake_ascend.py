"""Peer-side control of the fake Ascend vendor libraries (tests/fake_ascend/fake_control.h): call
counters that show which path moved the bytes, injected faults that make one call fail, the device
memory a process holds, and reads and writes of device memory that bypass pdlink (the fake's own
view of it, so an offset bug in pdlink cannot cancel out between writing test data and checking it).

Only in a peer whose engine runs on the Ascend backend over the fakes (``PDLINK_ASCEND_LIB_DIR``).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any


@functools.lru_cache(maxsize=1)
def lib() -> Any:
    """The fake libascendcl.so pdlink loaded (dlopen of the same path returns the same library, so
    the counters are the ones pdlink's calls moved); it carries the control API of both fakes."""
    acl = ctypes.CDLL(os.path.join(os.environ["PDLINK_ASCEND_LIB_DIR"], "libascendcl.so"))
    acl.fake_ascend_calls.restype = ctypes.c_long
    acl.fake_ascend_calls.argtypes = [ctypes.c_char_p]
    acl.fake_ascend_inject.restype = ctypes.c_int
    acl.fake_ascend_inject.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    acl.fake_acl_bytes_in_use.restype = ctypes.c_ulonglong
    acl.fake_acl_bytes_in_use.argtypes = [ctypes.c_int]
    for name in ("fake_acl_peek", "fake_acl_poke"):
        fn = getattr(acl, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return acl


def calls(fn: str) -> int:
    """How many times this process called ``fn`` (an exported ACL/HCCL name, or a pseudo-name such
    as ``hccl.remote_error``, counted per item this process sent)."""
    return int(lib().fake_ascend_calls(fn.encode()))


def call_counts(*fns: str) -> dict[str, int]:
    """``calls`` of each of ``fns``, in one round trip."""
    return {fn: calls(fn) for fn in fns}


def inject(fn: str, rc: int, after_n: int = 0, times: int = 1) -> None:
    """Calls of ``fn`` fail with ``rc`` after ``after_n`` calls let through, ``times`` times."""
    rc_set = lib().fake_ascend_inject(fn.encode(), rc, after_n, times)
    assert rc_set == 0, f"fake_ascend_inject({fn!r}) refused"


def bytes_in_use(device: int = 0) -> int:
    """Bytes this process holds allocated with aclrtMalloc on ``device``."""
    return int(lib().fake_acl_bytes_in_use(device))


def peek(addr: int, dst: int, nbytes: int) -> bool:
    """Copies [addr, +nbytes) of device memory to host address ``dst``; False unless the range lies
    inside one live device allocation."""
    return bool(lib().fake_acl_peek(addr, dst, nbytes) == 0)


def poke(addr: int, src: int, nbytes: int) -> bool:
    """Copies ``nbytes`` from host address ``src`` into device memory at ``addr``; False as ``peek``."""
    return bool(lib().fake_acl_poke(addr, src, nbytes) == 0)
