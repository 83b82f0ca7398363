"""Peer-side code of backends/test_ascend_backend.py: the Ascend loader and backend on the fake vendor
libraries (tests/fake_ascend). The loader runs once per process, so each test starts a fresh peer
with its own environment and calls one of these in it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import numpy as np

import internals
from llm_datadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement
from pdlink import LLMException, LLMStatusCode
from pdlink.device import DeviceMemory, backend_info, open_backend
from peers import fake_ascend


def info() -> dict[str, dict[str, Any]]:
    """``backend_info`` of "ascend" and of "auto" in this process."""
    return {"ascend": backend_info("ascend"), "auto": backend_info("auto")}


def init_engine(backend: str | None = None, mem_pool_cfg: str | None = None) -> None:
    """Initialises a DECODER engine (cluster 2) with the cache manager, on ``backend`` when given
    (the ``pdlink.Backend`` option) and with a DEVICE pool when ``mem_pool_cfg`` is given; raises
    what ``init`` raises."""
    cfg = LLMConfig()
    cfg.enable_cache_manager = True
    if mem_pool_cfg is not None:
        cfg.mem_pool_cfg = mem_pool_cfg
    opts = cfg.generate_options()
    if backend is not None:
        opts["pdlink.Backend"] = backend
    LLMDataDist(LLMRole.DECODER, 2).init(opts)


def open_backend_errors(device_id: int) -> dict[str, list[str]]:
    """What ``open_backend(name, device_id)`` raises for "ascend" and "auto": [status name, text]
    of each that raised an LLMException."""
    res: dict[str, list[str]] = {}
    for name in ("ascend", "auto"):
        try:
            open_backend(name, device_id)
        except LLMException as e:
            res[name] = [LLMStatusCode(e.status_code).name, str(e)]
    return res


def _acl(lib_dir: str) -> Any:
    return ctypes.CDLL(os.path.join(lib_dir, "libascendcl.so"))


def application_runtime(lib_dir: str) -> dict[str, Any]:
    """An application (torch_npu) initialised ACL and bound device 1 on its thread; pdlink then
    works on device 0 from that thread and from a thread of its own. Returns what ACL said before
    and after, and the bytes read back on pdlink's thread."""
    acl = _acl(lib_dir)
    first_init = acl.aclInit(None)
    set_dev = acl.aclrtSetDevice(1)
    mem = DeviceMemory(4096, device_id=0, backend="ascend")
    mem.write(bytes(range(256)) * 16)
    seen: dict[str, list[int]] = {}

    def worker() -> None:
        seen["data"] = mem.read(256).tolist()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    dev = ctypes.c_int32(-1)
    acl.aclrtGetDevice(ctypes.byref(dev))
    out = {"first_init": first_init, "set_dev": set_dev, "dev_after": dev.value,
           "init_again": acl.aclInit(None), "data": seen["data"], "backend": mem.backend}
    mem.free()
    return out


def device_memory_accounting(lib_dir: str) -> dict[str, int]:
    """The fake's device bytes in use before, during and after a ``DeviceMemory``, and after one
    dropped at once (garbage collection frees it)."""
    acl = _acl(lib_dir)
    acl.fake_acl_bytes_in_use.restype = ctypes.c_ulonglong
    before = acl.fake_acl_bytes_in_use(0)
    mem = DeviceMemory(3 << 20, backend="ascend")
    during = acl.fake_acl_bytes_in_use(0)
    mem.free()
    after = acl.fake_acl_bytes_in_use(0)
    DeviceMemory(1 << 20, backend="ascend")  # dropped at once: garbage collection frees it
    return {"before": before, "during": during, "after": after, "after_gc": acl.fake_acl_bytes_in_use(0)}


def local_copies_between_placements() -> dict[str, Any]:
    """swap_blocks in (HOST -> DEVICE) and out (DEVICE -> HOST), copy_blocks inside DEVICE memory;
    whether every tensor of the device cache and of the host destination is, byte for byte, what
    it was with exactly the moved blocks replaced (the device one read through the fake, around
    pdlink), and the engine's backend."""
    cfg = LLMConfig()
    cfg.enable_cache_manager = True
    cfg.mem_pool_cfg = '{"memory_size": 4194304, "page_shift": 12}'
    cfg.host_mem_pool_cfg = '{"memory_size": 4194304, "page_shift": 12}'
    dd = LLMDataDist(LLMRole.DECODER, 2)
    dd.init(cfg.generate_options())
    cm = dd.cache_manager

    def desc(p: Placement) -> CacheDesc:
        return CacheDesc(2, [8, 256], DataType.DT_UINT8, p)

    host_in = cm.allocate_blocks_cache(desc(Placement.HOST))
    dev = cm.allocate_blocks_cache(desc(Placement.DEVICE))
    host_out = cm.allocate_blocks_cache(desc(Placement.HOST))

    def view(a: int) -> np.ndarray:
        return np.frombuffer(memoryview((ctypes.c_uint8 * 2048).from_address(a)), dtype=np.uint8)

    def device(a: int) -> np.ndarray:
        out = np.empty((8, 256), dtype=np.uint8)
        read = fake_ascend.peek(a, out.ctypes.data, out.nbytes)
        assert read, "the device cache is not in the fake's device memory"
        return out

    for t, a in enumerate(host_in.tensor_addrs):
        view(a)[:] = (np.arange(2048) * 7 + t) % 251
        view(host_out.tensor_addrs[t])[:] = (np.arange(2048) * 3 + t + 1) % 253  # not what moves in
    src = [view(a).reshape(8, 256).copy() for a in host_in.tensor_addrs]
    dev_expected = [device(a) for a in dev.tensor_addrs]
    out_expected = [view(a).reshape(8, 256).copy() for a in host_out.tensor_addrs]
    cm.swap_blocks(host_in, dev, {0: 3, 5: 1})
    cm.copy_blocks(dev, {3: [6]})
    cm.swap_blocks(dev, host_out, {3: 0, 1: 1, 6: 2})
    for t in range(2):
        dev_expected[t][[3, 1, 6]] = src[t][[0, 5, 0]]
        out_expected[t][[0, 1, 2]] = src[t][[0, 5, 0]]
    ok = all(np.array_equal(device(a), e) for a, e in zip(dev.tensor_addrs, dev_expected)) and all(
        np.array_equal(view(a).reshape(8, 256), e) for a, e in zip(host_out.tensor_addrs, out_expected)) and all(
        np.array_equal(view(a).reshape(8, 256), s) for a, s in zip(host_in.tensor_addrs, src))
    out = {"ok": bool(ok), "backend": internals.backend_name(dd)}
    dd.finalize()
    return out
