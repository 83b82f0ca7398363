"""Tests of the fake Ascend vendor libraries (tests/fake_ascend) through ctypes.

pdlink's Ascend backend is tested on CPU against these fakes, so they must behave like the real
libascendcl.so / libhccl.so where the backend could get it wrong: per-thread contexts, device memory
the host cannot read, strict memcpy checks, deferred stream work, HCCL between real processes
(timeouts, remote failures, peer death), IPC memory sharing, and fault injection.

Run as ``python3 backends/test_fake_ascend.py child <build dir>``, this file is also the peer process of the
cross-process tests: it reads one JSON-encoded Python snippet per line from stdin, runs it, and
answers with the value of ``_`` (or the traceback).
"""

from __future__ import annotations

import ctypes as C
import errno
import json
import os
import pathlib
import queue
import random
import signal
import subprocess
import sys
import threading
import traceback
from typing import TYPE_CHECKING, Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, when run as a child
from fake_ascend.build import build, exported_symbols  # noqa: E402

# ACL / HCCL values (ascend_min.h).
H2H, H2D, D2H, D2D, DEFAULT = range(5)
ACL_ERROR_INVALID_PARAM, ACL_ERROR_UNINITIALIZE, ACL_ERROR_REPEAT_INITIALIZE = 100000, 100001, 100002
ACL_ERROR_REPEAT_FINALIZE = 100037
ACL_ERROR_RT_INVALID_DEVICEID, ACL_ERROR_RT_CONTEXT_NULL = 107001, 107002
ACL_ERROR_RT_MEMORY_ALLOCATION, ACL_ERROR_RT_NO_PERMISSION = 207001, 207006
ACL_ERROR_RT_INTERNAL_ERROR, ACL_ERROR_RT_STREAM_SYNC_TIMEOUT = 507000, 507046
NOT_READY, COMPLETE = 0, 1
HCCL_SUCCESS, HCCL_E_PARA, HCCL_E_PTR, HCCL_E_INTERNAL, HCCL_E_NOT_SUPPORT = 0, 1, 2, 4, 5
HCCL_E_TIMEOUT, HCCL_E_TCP_TRANSFER, HCCL_E_RUNTIME, HCCL_E_REMOTE = 9, 13, 15, 21
HCCL_SEND, HCCL_RECV, UINT8, FP16 = 0, 1, 7, 3
NO_PID_CHECK = 1  # ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION
SIZES = [1, 4096, 65536 + 3, 1 << 20, (3 << 20) + 5]  # block sizes of the two-way batch test

ACL_TABLE = {
    "aclInit", "aclFinalize", "aclrtSetDevice", "aclrtResetDevice", "aclrtGetDevice", "aclrtGetDeviceCount",
    "aclrtGetCurrentContext", "aclrtSetCurrentContext", "aclrtCreateStream", "aclrtDestroyStream",
    "aclrtSynchronizeStream", "aclrtSynchronizeStreamWithTimeout", "aclrtMalloc", "aclrtFree", "aclrtMallocHost",
    "aclrtFreeHost", "aclrtMemcpy", "aclrtMemcpyAsync", "aclrtCreateEvent", "aclrtRecordEvent",
    "aclrtSynchronizeEvent", "aclrtQueryEventStatus", "aclrtDestroyEvent", "aclGetRecentErrMsg",
    "aclrtGetPhyDevIdByLogicDevId", "aclrtIpcMemGetExportKey", "aclrtIpcMemSetImportPid", "aclrtIpcMemImportByKey",
    "aclrtIpcMemClose", "aclrtDeviceGetBareTgid",
}
CONTROL = {"fake_ascend_inject", "fake_ascend_calls", "fake_acl_bytes_in_use", "fake_acl_peek", "fake_acl_poke",
           "fake_ascend_hooks"}
HCCL_TABLE = {
    "HcclGetRootInfo", "HcclCommInitRootInfo", "HcclCommDestroy", "HcclSend", "HcclRecv", "HcclBatchSendRecv",
    "HcclGetErrorString", "HcclGetCommAsyncError",
    "HcclRegisterGlobalMem", "HcclDeregisterGlobalMem", "HcclCommBindMem", "HcclCommUnbindMem", "HcclCommPrepare",
    "HcclBatchPut", "HcclBatchGet",
}

vp, sz, i32, u32, u64, cint = C.c_void_p, C.c_size_t, C.c_int32, C.c_uint32, C.c_uint64, C.c_int
P = C.POINTER


class RootInfo(C.Structure):
    _fields_ = [("internal", C.c_char * 4108)]


class Item(C.Structure):  # HcclSendRecvItem
    _fields_ = [("type", cint), ("buf", vp), ("count", u64), ("dtype", cint), ("remoteRank", u32)]


class CommMem(C.Structure):
    _fields_ = [("type", cint), ("addr", vp), ("size", u64)]


class OneSideDesc(C.Structure):  # HcclOneSideOpDesc
    _fields_ = [("localAddr", vp), ("remoteAddr", vp), ("count", u64), ("dtype", cint)]


assert C.sizeof(Item) == 32 and C.sizeof(CommMem) == 24 and C.sizeof(OneSideDesc) == 32

SIGNATURES = {  # name: (restype, argtypes)
    "aclInit": (cint, [C.c_char_p]), "aclFinalize": (cint, []),
    "aclrtSetDevice": (cint, [i32]), "aclrtResetDevice": (cint, [i32]), "aclrtGetDevice": (cint, [P(i32)]),
    "aclrtGetDeviceCount": (cint, [P(u32)]), "aclrtGetCurrentContext": (cint, [P(vp)]),
    "aclrtSetCurrentContext": (cint, [vp]), "aclrtCreateStream": (cint, [P(vp)]), "aclrtDestroyStream": (cint, [vp]),
    "aclrtSynchronizeStream": (cint, [vp]), "aclrtSynchronizeStreamWithTimeout": (cint, [vp, i32]),
    "aclrtMalloc": (cint, [P(vp), sz, cint]), "aclrtFree": (cint, [vp]),
    "aclrtMallocHost": (cint, [P(vp), sz]), "aclrtFreeHost": (cint, [vp]),
    "aclrtMemcpy": (cint, [vp, sz, vp, sz, cint]), "aclrtMemcpyAsync": (cint, [vp, sz, vp, sz, cint, vp]),
    "aclrtCreateEvent": (cint, [P(vp)]), "aclrtRecordEvent": (cint, [vp, vp]), "aclrtSynchronizeEvent": (cint, [vp]),
    "aclrtQueryEventStatus": (cint, [vp, P(cint)]), "aclrtDestroyEvent": (cint, [vp]),
    "aclGetRecentErrMsg": (C.c_char_p, []), "aclrtGetPhyDevIdByLogicDevId": (cint, [i32, P(i32)]),
    "aclrtIpcMemGetExportKey": (cint, [vp, sz, C.c_char_p, sz, u64]),
    "aclrtIpcMemSetImportPid": (cint, [C.c_char_p, P(i32), sz]),
    "aclrtIpcMemImportByKey": (cint, [P(vp), C.c_char_p, u64]), "aclrtIpcMemClose": (cint, [C.c_char_p]),
    "aclrtDeviceGetBareTgid": (cint, [P(i32)]),
    "fake_ascend_inject": (cint, [C.c_char_p, cint, cint, cint]), "fake_ascend_calls": (C.c_long, [C.c_char_p]),
    "fake_acl_bytes_in_use": (C.c_ulonglong, [cint]),
    "HcclGetRootInfo": (cint, [P(RootInfo)]), "HcclCommInitRootInfo": (cint, [u32, P(RootInfo), u32, P(vp)]),
    "HcclCommDestroy": (cint, [vp]), "HcclSend": (cint, [vp, u64, cint, u32, vp, vp]),
    "HcclRecv": (cint, [vp, u64, cint, u32, vp, vp]), "HcclBatchSendRecv": (cint, [P(Item), u32, vp, vp]),
    "HcclGetErrorString": (C.c_char_p, [cint]), "HcclGetCommAsyncError": (cint, [vp, P(cint)]),
    "HcclRegisterGlobalMem": (cint, [P(CommMem), P(vp)]), "HcclDeregisterGlobalMem": (cint, [vp]),
    "HcclCommBindMem": (cint, [vp, vp]), "HcclCommUnbindMem": (cint, [vp, vp]),
    "HcclCommPrepare": (cint, [vp, vp, i32]),
    "HcclBatchPut": (cint, [vp, u32, P(OneSideDesc), u32, vp]),
    "HcclBatchGet": (cint, [vp, u32, P(OneSideDesc), u32, vp]),
}


def pattern(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def address(p: C.c_void_p) -> int:
    """The pointer a successful call stored in `p` (ctypes reads NULL as None)."""
    assert p.value is not None, "NULL pointer"
    return p.value


class Fake:
    """Both fake libraries with typed entry points, plus helpers that raise on failure."""

    def __init__(self, lib_dir):
        lib_dir = pathlib.Path(lib_dir)
        self.acl = C.CDLL(str(lib_dir / "libascendcl.so"))
        self.hccl = C.CDLL(str(lib_dir / "libhccl.so"))  # finds the same libascendcl.so via $ORIGIN
        for name, (res, args) in SIGNATURES.items():
            fn = getattr(self.hccl if name.startswith("Hccl") else self.acl, name)
            fn.restype, fn.argtypes = res, args
            setattr(self, name, fn)

    if TYPE_CHECKING:  # the entry points of SIGNATURES, set in __init__
        def __getattr__(self, name: str) -> Any: ...

    def err(self) -> str:
        return (self.aclGetRecentErrMsg() or b"").decode()

    def check(self, rc, what="call"):
        if rc != 0:
            raise AssertionError(f"{what} returned {rc}: {self.err()}")

    def malloc(self, n: int) -> int:
        p = vp()
        self.check(self.aclrtMalloc(C.byref(p), n, 0), "aclrtMalloc")
        return address(p)

    def upload(self, data: bytes) -> int:
        p = self.malloc(len(data))
        self.check(self.aclrtMemcpy(p, len(data), data, len(data), H2D), "aclrtMemcpy H2D")
        return p

    def download(self, p: int, n: int) -> bytes:
        buf = C.create_string_buffer(n)
        self.check(self.aclrtMemcpy(buf, n, p, n, D2H), "aclrtMemcpy D2H")
        return buf.raw

    def stream(self) -> int:
        s = vp()
        self.check(self.aclrtCreateStream(C.byref(s)), "aclrtCreateStream")
        return address(s)

    def root_info(self) -> RootInfo:
        root = RootInfo()
        self.check(self.HcclGetRootInfo(C.byref(root)), "HcclGetRootInfo")
        return root

    def init(self, blob: bytes, rank: int) -> tuple[int, int | None]:
        root = RootInfo()
        C.memmove(C.addressof(root), blob, len(blob))
        comm = vp()
        return self.HcclCommInitRootInfo(2, C.byref(root), rank, C.byref(comm)), comm.value

    def join(self, blob: bytes, rank: int) -> int:
        rc, comm = self.init(blob, rank)
        self.check(rc, "HcclCommInitRootInfo")
        assert comm is not None
        return comm

    def batch(self, comm, peer, sends=(), recvs=(), stream=None, dtype=UINT8) -> int:
        """HcclBatchSendRecv of (ptr, count) sends and receives, interleaved send/recv."""
        items = [(HCCL_SEND, p, n) for p, n in sends]
        for i, (p, n) in enumerate(recvs):
            items.insert(2 * i + 1, (HCCL_RECV, p, n))
        arr = (Item * len(items))(*[Item(t, p, n, dtype, peer) for t, p, n in items])
        return self.HcclBatchSendRecv(arr, len(items), comm, stream)

    def async_error(self, comm) -> int:
        e = cint(-1)
        self.check(self.HcclGetCommAsyncError(comm, C.byref(e)), "HcclGetCommAsyncError")
        return e.value

    def export(self, p, n, flags) -> str:
        key = C.create_string_buffer(65)
        self.check(self.aclrtIpcMemGetExportKey(p, n, key, 65, flags), "aclrtIpcMemGetExportKey")
        return key.value.decode()


def compact_root(root: RootInfo) -> str:
    return bytes(root).rstrip(b"\0").hex()  # the blob is mostly zero padding


# --------------------------------------------------------------------------- peer processes

def child_main(lib_dir: str) -> None:
    fk = Fake(lib_dir)
    fk.check(fk.aclInit(None))
    fk.check(fk.aclrtSetDevice(0))
    ns = {"fk": fk, "C": C, "pattern": pattern, "os": os, "CommMem": CommMem, "OneSideDesc": OneSideDesc}
    ns.update({k: v for k, v in globals().items() if k.isupper()})
    for line in sys.stdin:
        try:
            ns["_"] = None
            exec(json.loads(line), ns)
            out = {"ok": True, "value": ns["_"]}
        except BaseException:
            out = {"ok": False, "error": traceback.format_exc()}
        print(json.dumps(out), flush=True)


class Peer:
    """A child process running child_main; every wait on it is bounded."""

    def __init__(self, lib_dir, env=None):
        full_env = dict(os.environ, **(env or {}))
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "child", str(lib_dir)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=full_env, text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both are pipes
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, code: str) -> None:
        self.stdin.write(json.dumps(code) + "\n")
        self.stdin.flush()

    def reply(self, timeout=15.0):
        line = self.lines.get(timeout=timeout)
        if line is None:
            raise EOFError(f"peer exited with {self.proc.wait(5)}")
        out = json.loads(line)
        if not out["ok"]:
            raise AssertionError("peer failed:\n" + out["error"])
        return out["value"]

    def __call__(self, code: str, timeout=15.0):
        self.send(code)
        return self.reply(timeout)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.stdin.close()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    child_main(sys.argv[2])
    sys.exit(0)

import pytest  # noqa: E402  (not needed by the peer processes, which start faster without it)

# ------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def lib_dir():
    return build("full")


@pytest.fixture(scope="module")
def fk(lib_dir):
    f = Fake(lib_dir)
    # Another test module may have loaded the same library into this process and initialised it.
    assert f.aclInit(None) in (0, ACL_ERROR_REPEAT_INITIALIZE)
    yield f


@pytest.fixture(autouse=True)
def _device0(request):
    if "fk" in request.fixturenames:
        f = request.getfixturevalue("fk")
        f.check(f.aclrtSetDevice(0))
        yield
        f.fake_ascend_inject(None, 0, 0, 0)
    else:
        yield


@pytest.fixture
def stream(fk):
    s = fk.stream()
    yield s
    fk.aclrtDestroyStream(s)


@pytest.fixture
def peers(lib_dir):
    made = []

    def make(env=None) -> Peer:
        made.append(Peer(lib_dir, env))
        return made[-1]

    yield make
    for p in made:
        p.close()


def run_in_thread(fn, timeout=10.0):
    out = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            out["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "thread did not finish in time"
    if "error" in out:
        raise out["error"]
    return out["value"]


# ------------------------------------------------------------------------------ exports

def test_exports_match_the_table_exactly(lib_dir):
    assert exported_symbols(lib_dir / "libascendcl.so") == ACL_TABLE | CONTROL
    assert exported_symbols(lib_dir / "libhccl.so") == HCCL_TABLE
    broken = build("broken")
    assert exported_symbols(broken / "libascendcl.so") == (ACL_TABLE | CONTROL) - {"aclrtMemcpyAsync",
                                                                                    "aclrtIpcMemGetExportKey"}
    assert exported_symbols(broken / "libhccl.so") == HCCL_TABLE
    assert exported_symbols(build("no_optional") / "libascendcl.so") == (ACL_TABLE | CONTROL) - {
        "aclrtIpcMemGetExportKey"}
    assert build("full") == lib_dir  # re-used, not rebuilt


# ------------------------------------------------------------------------------ ACL runtime

def test_init_is_once_per_process_and_finalize_undoes_it(fk):
    assert fk.aclInit(None) == ACL_ERROR_REPEAT_INITIALIZE
    try:
        assert fk.aclFinalize() == 0
        assert fk.aclFinalize() == ACL_ERROR_REPEAT_FINALIZE
        p = vp()
        assert fk.aclrtMalloc(C.byref(p), 64, 0) == ACL_ERROR_UNINITIALIZE
        assert "aclInit" in fk.err()
    finally:
        assert fk.aclInit(None) == 0


def test_devices_count_and_physical_ids(peers):
    # A fresh process: the device layout is read at the first aclInit.
    peer = peers({"FAKE_ASCEND_DEVICE_COUNT": "3", "FAKE_ASCEND_PHY_OFFSET": "4"})
    assert peer("n, phy, tgid = C.c_uint32(), C.c_int32(), C.c_int32()\n"
                "fk.check(fk.aclrtGetDeviceCount(C.byref(n)))\n"
                "fk.check(fk.aclrtGetPhyDevIdByLogicDevId(2, C.byref(phy)))\n"
                "fk.check(fk.aclrtDeviceGetBareTgid(C.byref(tgid)))\n"
                "_ = [n.value, phy.value, tgid.value == os.getpid(), fk.aclrtSetDevice(3), fk.aclrtSetDevice(-1),\n"
                "     fk.aclrtGetPhyDevIdByLogicDevId(3, C.byref(phy)), fk.aclrtSetDevice(2)]") == \
        [3, 6, True, ACL_ERROR_RT_INVALID_DEVICEID, ACL_ERROR_RT_INVALID_DEVICEID, ACL_ERROR_RT_INVALID_DEVICEID, 0]


def test_context_is_per_thread(fk):
    ctx0 = vp()
    fk.check(fk.aclrtGetCurrentContext(C.byref(ctx0)))
    assert ctx0.value

    def worker():
        p, dev, ctx, s = vp(), i32(), vp(), vp()
        out = {"malloc": fk.aclrtMalloc(C.byref(p), 64, 0), "msg": fk.err(),
               "getdev": fk.aclrtGetDevice(C.byref(dev)), "stream": fk.aclrtCreateStream(C.byref(s)),
               "sync": fk.aclrtSynchronizeStream(None), "hccl": fk.HcclGetRootInfo(C.byref(RootInfo()))}
        fk.check(fk.aclrtSetDevice(1))
        fk.check(fk.aclrtGetCurrentContext(C.byref(ctx)))
        out["ctx1_differs"] = ctx.value != ctx0.value
        fk.check(fk.aclrtSetCurrentContext(ctx0))  # adopt the main thread's context
        fk.check(fk.aclrtGetDevice(C.byref(dev)))
        out["dev"] = dev.value
        fk.check(fk.aclrtMalloc(C.byref(p), 64, 0))
        fk.check(fk.aclrtFree(p))
        fk.check(fk.aclrtResetDevice(0))  # unbinds this thread only
        out["after_reset"] = fk.aclrtMalloc(C.byref(p), 64, 0)
        return out

    out = run_in_thread(worker)
    assert out["malloc"] == out["getdev"] == out["stream"] == out["sync"] == ACL_ERROR_RT_CONTEXT_NULL
    assert "aclrtMalloc" in out["msg"] and "no current device" in out["msg"]
    assert out["hccl"] == HCCL_E_RUNTIME
    assert out["ctx1_differs"] and out["dev"] == 0
    assert out["after_reset"] == ACL_ERROR_RT_CONTEXT_NULL
    dev = i32()
    fk.check(fk.aclrtGetDevice(C.byref(dev)))  # the main thread is still bound
    assert dev.value == 0
    assert fk.aclrtSetCurrentContext(vp(12345)) == ACL_ERROR_INVALID_PARAM


def test_malloc_free_alignment_and_accounting(fk):
    base = fk.fake_acl_bytes_in_use(0)
    p = vp()
    assert fk.aclrtMalloc(C.byref(p), 0, 0) == ACL_ERROR_INVALID_PARAM
    assert fk.aclrtMalloc(None, 64, 0) == ACL_ERROR_INVALID_PARAM
    small, big = fk.malloc(100), fk.malloc(3 << 20)
    assert small % 512 == 0 and big % (2 << 20) == 0
    assert fk.fake_acl_bytes_in_use(0) == base + 100 + (3 << 20)
    assert fk.aclrtFree(small + 1) == ACL_ERROR_INVALID_PARAM  # not the start of an allocation
    assert fk.aclrtFree(C.addressof(C.create_string_buffer(8))) == ACL_ERROR_INVALID_PARAM
    fk.check(fk.aclrtFree(small))
    fk.check(fk.aclrtFree(big))
    assert fk.aclrtFree(big) == ACL_ERROR_INVALID_PARAM  # double free
    assert fk.fake_acl_bytes_in_use(0) == base
    assert fk.aclrtMalloc(C.byref(p), 9 << 30, 0) == ACL_ERROR_RT_MEMORY_ALLOCATION  # > 8 GiB arena
    assert fk.malloc(100) == small  # first fit re-uses the freed range
    fk.check(fk.aclrtFree(small))
    h = vp()
    fk.check(fk.aclrtMallocHost(C.byref(h), 4096))
    C.memset(h, 7, 4096)  # host memory is host-accessible
    fk.check(fk.aclrtFreeHost(h))
    assert fk.aclrtFreeHost(h) == ACL_ERROR_INVALID_PARAM


def test_device_memory_is_not_host_accessible(fk, peers):
    p = fk.malloc(4096)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= p < hi:
                    assert line.split()[1] == "---s", line
                    break
            else:
                pytest.fail("device pointer not mapped at all")

        class IoVec(C.Structure):
            _fields_ = [("base", vp), ("len", sz)]

        libc = C.CDLL(None, use_errno=True)
        buf = C.create_string_buffer(64)
        local, remote = IoVec(C.addressof(buf), 64), IoVec(p, 64)
        libc.process_vm_readv.restype = C.c_ssize_t
        assert libc.process_vm_readv(os.getpid(), C.byref(local), 1, C.byref(remote), 1, 0) == -1
        if C.get_errno() not in (errno.EPERM, errno.ENOSYS):  # unless a sandbox forbids the call
            assert C.get_errno() == errno.EFAULT  # as for real device memory
    finally:
        fk.check(fk.aclrtFree(p))
    # Under AddressSanitizer (.ci/sanitizers.sh) the child must die of the signal itself, not be
    # caught and reported by ASan's SEGV handler: the fault is the point of this test.
    asan = os.environ.get("ASAN_OPTIONS")
    peer = peers({"ASAN_OPTIONS": f"{asan}:handle_segv=0"} if asan else None)
    peer("p = fk.upload(b'x' * 64)")
    peer.send("import resource; resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"  # no core file
              "C.string_at(p, 1)")  # a host read of device memory
    with pytest.raises(EOFError):
        peer.reply()
    assert peer.proc.wait(5) == -signal.SIGSEGV


def test_memcpy_checks(fk):
    d = fk.malloc(256)
    host = C.create_string_buffer(256)
    assert fk.aclrtMemcpy(d, 64, host, 100, H2D) == ACL_ERROR_INVALID_PARAM
    assert "count 100 > destMax 64" in fk.err()
    assert fk.aclrtMemcpy(d, 256, d, 256, H2D) == ACL_ERROR_INVALID_PARAM  # src is device memory
    assert fk.aclrtMemcpy(host, 256, host, 256, H2D) == ACL_ERROR_INVALID_PARAM  # dst is host memory
    assert fk.aclrtMemcpy(host, 256, d, 256, H2H) == ACL_ERROR_INVALID_PARAM
    assert fk.aclrtMemcpy(d + 128, 256, host, 256, H2D) == ACL_ERROR_INVALID_PARAM  # runs past the allocation
    assert fk.aclrtMemcpy(d, 256, None, 256, H2D) == ACL_ERROR_INVALID_PARAM
    fk.check(fk.aclrtMemcpy(d, 256, host, 256, DEFAULT))  # kind inferred from the pointers
    fk.check(fk.aclrtMemcpy(d + 128, 128, d, 128, D2D))
    fk.check(fk.aclrtFree(d))
    assert fk.aclrtMemcpy(host, 256, d, 256, D2H) == ACL_ERROR_INVALID_PARAM  # freed


def test_round_trip_is_byte_exact_across_devices(fk):
    data = pattern(1, (3 << 20) + 123)
    n = len(data)
    a = fk.upload(data)
    fk.check(fk.aclrtSetDevice(1))
    b = fk.malloc(n)
    fk.check(fk.aclrtMemcpy(b, n, a, n, D2D))  # device 0 -> device 1: peer access is modelled as on
    assert fk.download(b, n) == data
    fk.check(fk.aclrtMemcpy(b + 1000, 5000, a + 7, 5000, D2D))
    assert fk.download(b + 1000, 5000) == data[7:5007]
    fk.check(fk.aclrtFree(b))
    fk.check(fk.aclrtSetDevice(0))
    fk.check(fk.aclrtFree(a))


def test_async_copy_lands_only_when_the_stream_runs(fk, monkeypatch):
    s = fk.stream()
    data = pattern(2, 4096)
    src = C.create_string_buffer(data, 4096)
    d = fk.upload(bytes(4096))
    ev = vp()
    fk.check(fk.aclrtCreateEvent(C.byref(ev)))
    assert fk.aclrtMemcpyAsync(d, 64, src, 100, H2D, s) == ACL_ERROR_INVALID_PARAM  # checked at once
    monkeypatch.setenv("FAKE_ASCEND_STREAM_DELAY_US", "200000")  # read before each stream task
    fk.check(fk.aclrtMemcpyAsync(d, 4096, src, 4096, H2D, s))
    fk.check(fk.aclrtRecordEvent(ev, s))
    status = cint(-1)
    fk.check(fk.aclrtQueryEventStatus(ev, C.byref(status)))
    assert status.value == NOT_READY
    assert fk.download(d, 4096) == bytes(4096)  # no synchronize yet: stale data
    fk.check(fk.aclrtSynchronizeEvent(ev))
    fk.check(fk.aclrtQueryEventStatus(ev, C.byref(status)))
    assert status.value == COMPLETE
    assert fk.download(d, 4096) == data
    monkeypatch.delenv("FAKE_ASCEND_STREAM_DELAY_US")
    # Destroying a stream drains it first.
    zeros = bytes(4096)  # must outlive the queued copy (AddressSanitizer caught a temporary here)
    fk.check(fk.aclrtMemcpyAsync(d, 4096, zeros, 4096, H2D, s))
    fk.check(fk.aclrtDestroyStream(s))
    assert fk.download(d, 4096) == zeros
    assert fk.aclrtSynchronizeStream(s) == ACL_ERROR_INVALID_PARAM
    fk.check(fk.aclrtDestroyEvent(ev))
    fk.check(fk.aclrtFree(d))


def test_sync_with_timeout_expires_and_keeps_the_work(fk, monkeypatch):
    s = fk.stream()
    data = pattern(3, 1000)
    d = fk.malloc(1000)
    monkeypatch.setenv("FAKE_ASCEND_STREAM_DELAY_US", "300000")
    fk.check(fk.aclrtMemcpyAsync(d, 1000, data, 1000, H2D, s))
    # the copy takes 300 ms: a 50 ms wait can only end in the timeout, and the work stays queued
    assert fk.aclrtSynchronizeStreamWithTimeout(s, 50) == ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
    fk.check(fk.aclrtSynchronizeStreamWithTimeout(s, -1))
    monkeypatch.delenv("FAKE_ASCEND_STREAM_DELAY_US")
    assert fk.download(d, 1000) == data
    fk.check(fk.aclrtDestroyStream(s))
    fk.check(fk.aclrtFree(d))


def test_fault_injection_and_call_counts(fk, stream):
    calls0 = fk.fake_ascend_calls(b"aclrtMalloc")
    fk.fake_ascend_inject(b"aclrtMalloc", ACL_ERROR_RT_MEMORY_ALLOCATION, 1, 1)
    a = fk.malloc(64)  # the first call is let through
    p = vp()
    assert fk.aclrtMalloc(C.byref(p), 64, 0) == ACL_ERROR_RT_MEMORY_ALLOCATION
    assert "injected" in fk.err()
    b = fk.malloc(64)  # only once
    assert fk.fake_ascend_calls(b"aclrtMalloc") == calls0 + 3
    fk.fake_ascend_inject(b"aclrtSynchronizeStream", ACL_ERROR_RT_STREAM_SYNC_TIMEOUT, 0, -1)
    assert fk.aclrtSynchronizeStream(stream) == ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
    assert fk.aclrtSynchronizeStream(stream) == ACL_ERROR_RT_STREAM_SYNC_TIMEOUT  # forever
    fk.fake_ascend_inject(None, 0, 0, 0)
    fk.check(fk.aclrtSynchronizeStream(stream))
    for q in (a, b):
        fk.check(fk.aclrtFree(q))


# ------------------------------------------------------------------------------------ HCCL

def test_hccl_local_checks_and_rendezvous(fk, monkeypatch):
    assert fk.HcclGetErrorString(HCCL_E_TIMEOUT) == b"HCCL_E_TIMEOUT"
    assert fk.HcclGetErrorString(HCCL_E_REMOTE) == b"HCCL_E_REMOTE"
    assert fk.HcclGetErrorString(999) == b"HCCL_E_UNKNOWN"
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "0.3")
    root, comm = fk.root_info(), vp()
    assert fk.HcclCommInitRootInfo(3, C.byref(root), 0, C.byref(comm)) == HCCL_E_NOT_SUPPORT
    assert fk.HcclCommInitRootInfo(2, C.byref(root), 2, C.byref(comm)) == HCCL_E_PARA
    assert fk.HcclCommInitRootInfo(2, C.byref(root), 0, C.byref(comm)) == HCCL_E_TIMEOUT  # nobody joins
    # an injected failure is returned as injected (another code than the wait would give)
    fk.fake_ascend_inject(b"HcclCommInitRootInfo", HCCL_E_REMOTE, 0, 1)
    assert fk.HcclCommInitRootInfo(2, C.byref(root), 0, C.byref(comm)) == HCCL_E_REMOTE

    blob = bytearray(bytes(root))
    blob[20:120] = b"no-such-listener".ljust(100, b"\0")  # RootBlob.name
    nowhere = RootInfo.from_buffer_copy(blob)
    assert fk.HcclCommInitRootInfo(2, C.byref(nowhere), 0, C.byref(comm)) == HCCL_E_PARA  # not created here
    assert fk.HcclCommInitRootInfo(2, C.byref(nowhere), 1, C.byref(comm)) == HCCL_E_TIMEOUT

    # A joiner with the wrong nonce is refused; the root info stays usable for the right one.
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "5")
    wrong = bytearray(bytes(root))
    wrong[8] ^= 0xFF
    out = {}

    def rank1():
        fk.check(fk.aclrtSetDevice(0))
        c = vp()
        out["wrong"] = fk.HcclCommInitRootInfo(2, C.byref(RootInfo.from_buffer_copy(wrong)), 1, C.byref(c))
        out["comm"] = fk.join(bytes(root), 1)

    t = threading.Thread(target=rank1)
    t.start()
    fk.check(fk.HcclCommInitRootInfo(2, C.byref(root), 0, C.byref(comm)))
    t.join(10)
    assert out["wrong"] == HCCL_E_PARA and out["comm"]
    comm0, comm1 = comm.value, out["comm"]

    d = fk.malloc(256)
    host = C.create_string_buffer(256)
    assert fk.HcclSend(d, 256, UINT8, 0, comm0, None) == HCCL_E_PARA  # rank 0 to itself
    assert fk.HcclSend(host, 256, UINT8, 1, comm0, None) == HCCL_E_PTR
    assert fk.HcclSend(d, 257, UINT8, 1, comm0, None) == HCCL_E_PTR  # past the allocation
    assert fk.HcclSend(d, 16, 99, 1, comm0, None) == HCCL_E_PARA
    assert fk.HcclSend(d, 16, UINT8, 1, vp(4242), None) == HCCL_E_PARA
    assert fk.async_error(comm0) == HCCL_SUCCESS

    # Send/Recv between two threads of one process; fp16 counts are elements.
    data = pattern(4, 256)
    fk.check(fk.aclrtMemcpy(d, 256, data, 256, H2D))

    def recv():
        fk.check(fk.aclrtSetDevice(0))
        r = fk.malloc(256)
        fk.check(fk.HcclRecv(r, 128, FP16, 0, comm1, None))
        fk.check(fk.aclrtSynchronizeStream(None))
        got = fk.download(r, 256)
        fk.check(fk.aclrtFree(r))
        return got

    s = fk.stream()
    fk.check(fk.HcclSend(d, 128, FP16, 1, comm0, s))
    assert run_in_thread(recv) == data
    fk.check(fk.aclrtSynchronizeStream(s))
    fk.check(fk.aclrtDestroyStream(s))
    fk.check(fk.HcclCommDestroy(comm0))
    fk.check(fk.HcclCommDestroy(comm1))
    assert fk.HcclCommDestroy(comm0) == HCCL_E_PARA
    fk.check(fk.aclrtFree(d))


def connect(fk, peer) -> int:
    """A communicator between this process (rank 0) and `peer` (rank 1, variable `comm` there)."""
    root = fk.root_info()
    peer.send(f"comm = fk.join(bytes.fromhex('{compact_root(root)}'), 1)")
    comm = vp()
    fk.check(fk.HcclCommInitRootInfo(2, C.byref(root), 0, C.byref(comm)), "HcclCommInitRootInfo")
    peer.reply()
    return address(comm)


def test_hccl_batch_both_directions_at_once(fk, peers, stream, monkeypatch):
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "10")
    peer = peers()
    comm = connect(fk, peer)
    sends = [fk.upload(pattern(100 + i, n)) for i, n in enumerate(SIZES)]
    recvs = [fk.malloc(n) for n in SIZES]
    peer("send = [fk.upload(pattern(200 + i, n)) for i, n in enumerate(SIZES)]\n"
         "recv = [fk.malloc(n) for n in SIZES]")
    peer.send("fk.check(fk.batch(comm, 0, list(zip(send, SIZES)), list(zip(recv, SIZES))))\n"
              "fk.check(fk.aclrtSynchronizeStream(None))\n"
              "_ = [fk.download(p, n) == pattern(100 + i, n) for i, (p, n) in enumerate(zip(recv, SIZES))]")
    fk.check(fk.batch(comm, 1, list(zip(sends, SIZES)), list(zip(recvs, SIZES)), stream))
    fk.check(fk.aclrtSynchronizeStreamWithTimeout(stream, 20000))
    assert peer.reply() == [True] * len(SIZES)
    for i, (p, n) in enumerate(zip(recvs, SIZES)):
        assert fk.download(p, n) == pattern(200 + i, n), f"block {i}"
    assert fk.async_error(comm) == HCCL_SUCCESS
    assert peer("_ = fk.async_error(comm); fk.check(fk.HcclCommDestroy(comm))") == HCCL_SUCCESS
    fk.check(fk.HcclCommDestroy(comm))
    for p in sends + recvs:
        fk.check(fk.aclrtFree(p))


def test_hccl_count_mismatch_fails_both_sides(fk, peers, stream):
    peer = peers({"HCCL_EXEC_TIMEOUT": "10"})
    # Rank 0 must be the process that created the root info.
    assert peer(f"_ = fk.init(bytes.fromhex('{compact_root(fk.root_info())}'), 0)[0]") == HCCL_E_PARA
    comm = connect(fk, peer)
    r = fk.malloc(100)
    peer("s = fk.upload(bytes(100))")
    peer.send("fk.check(fk.HcclSend(s, 50, UINT8, 0, comm, None))\n"
              "_ = [fk.aclrtSynchronizeStream(None), fk.async_error(comm)]")
    fk.check(fk.HcclRecv(r, 100, UINT8, 1, comm, stream))
    assert fk.aclrtSynchronizeStreamWithTimeout(stream, 10000) == ACL_ERROR_RT_INTERNAL_ERROR
    assert "HcclRecv" in fk.err()
    assert fk.async_error(comm) == HCCL_E_PARA
    assert peer.reply() == [ACL_ERROR_RT_INTERNAL_ERROR, HCCL_E_TCP_TRANSFER]  # the sender fails too
    # The communicator stays broken.
    fk.check(fk.HcclRecv(r, 100, UINT8, 1, comm, stream))
    assert fk.aclrtSynchronizeStreamWithTimeout(stream, 10000) == ACL_ERROR_RT_INTERNAL_ERROR
    fk.check(fk.HcclCommDestroy(comm))
    fk.check(fk.aclrtFree(r))


def test_hccl_exec_timeout_when_the_sender_stalls(fk, peers, stream, monkeypatch):
    peer = peers({"HCCL_EXEC_TIMEOUT": "10"})
    comm = connect(fk, peer)
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "0.5")
    sizes = [1000, 2000, 3000]
    recvs = [fk.upload(bytes(n)) for n in sizes]
    peer("fk.fake_ascend_inject(b'hccl.stall', HCCL_E_TIMEOUT, 1, 1)\n"  # the second item never leaves
         "send = [fk.upload(pattern(300 + i, n)) for i, n in enumerate([1000, 2000, 3000])]")
    peer.send("fk.check(fk.batch(comm, 0, list(zip(send, [1000, 2000, 3000]))))\n"
              "_ = [fk.aclrtSynchronizeStream(None), fk.async_error(comm)]")
    fk.check(fk.batch(comm, 1, recvs=list(zip(recvs, sizes)), stream=stream))
    assert fk.aclrtSynchronizeStreamWithTimeout(stream, 10000) == ACL_ERROR_RT_INTERNAL_ERROR
    assert fk.async_error(comm) == HCCL_E_TIMEOUT
    assert fk.download(recvs[0], 1000) == pattern(300, 1000)
    assert fk.download(recvs[1], 2000) == bytes(2000)
    assert peer.reply() == [ACL_ERROR_RT_INTERNAL_ERROR, HCCL_E_TCP_TRANSFER]  # woken by our hang-up
    fk.check(fk.HcclCommDestroy(comm))
    for p in recvs:
        fk.check(fk.aclrtFree(p))


def test_hccl_remote_error_mid_batch(fk, peers, stream):
    # Armed through the environment, as for a peer that cannot be reached by ctypes first.
    peer = peers({"HCCL_EXEC_TIMEOUT": "10", "FAKE_ASCEND_INJECT": f"hccl.remote_error:{HCCL_E_INTERNAL}:2:1"})
    comm = connect(fk, peer)
    sizes = [512, 1024, 2048, 4096]
    recvs = [fk.upload(bytes(n)) for n in sizes]
    sends = [fk.upload(bytes(n)) for n in sizes]  # both directions at once, as in a real exchange
    peer(f"send = [fk.upload(pattern(400 + i, n)) for i, n in enumerate({sizes})]\n"
         f"recv = [fk.malloc(n) for n in {sizes}]")
    peer.send(f"fk.check(fk.batch(comm, 0, list(zip(send, {sizes})), list(zip(recv, {sizes}))))\n"
              "_ = [fk.aclrtSynchronizeStream(None), fk.async_error(comm), fk.fake_ascend_calls(b'hccl.remote_error')]")
    fk.check(fk.batch(comm, 1, list(zip(sends, sizes)), list(zip(recvs, sizes)), stream))
    assert fk.aclrtSynchronizeStreamWithTimeout(stream, 10000) == ACL_ERROR_RT_INTERNAL_ERROR
    assert fk.async_error(comm) == HCCL_E_REMOTE
    assert [fk.download(p, n) == pattern(400 + i, n) for i, (p, n) in enumerate(zip(recvs, sizes))] == \
        [True, True, False, False]
    assert peer.reply() == [ACL_ERROR_RT_INTERNAL_ERROR, HCCL_E_INTERNAL, 3]
    fk.check(fk.HcclCommDestroy(comm))
    for p in recvs + sends:
        fk.check(fk.aclrtFree(p))


def test_hccl_peer_death_fails_pending_and_later_work(fk, peers, stream):
    peer = peers()
    comm = connect(fk, peer)  # HCCL_EXEC_TIMEOUT stays at its 120 s default: only EOF can end this
    r = fk.malloc(4096)
    fk.check(fk.HcclRecv(r, 4096, UINT8, 1, comm, stream))
    peer.proc.kill()
    # the receive can only end by the peer's EOF (ACL_ERROR_RT_INTERNAL_ERROR); a wait for data
    # would end in the sync timeout instead (ACL_ERROR_RT_STREAM_SYNC_TIMEOUT)
    assert fk.aclrtSynchronizeStreamWithTimeout(stream, 10000) == ACL_ERROR_RT_INTERNAL_ERROR
    assert fk.async_error(comm) == HCCL_E_TCP_TRANSFER
    fk.check(fk.HcclSend(r, 4096, UINT8, 1, comm, stream))  # queued, then fails: the link is gone
    assert fk.aclrtSynchronizeStreamWithTimeout(stream, 10000) == ACL_ERROR_RT_INTERNAL_ERROR
    fk.check(fk.HcclCommDestroy(comm))
    fk.check(fk.aclrtFree(r))


def test_hccl_one_sided_put_and_get(fk, peers, stream):
    peer = peers()
    comm = connect(fk, peer)
    mine = fk.upload(pattern(500, 8192))
    h = vp()
    fk.check(fk.HcclRegisterGlobalMem(C.byref(CommMem(0, mine, 8192)), C.byref(h)))
    fk.check(fk.HcclCommBindMem(comm, h))
    remote = peer("pad = fk.malloc(100)\n"  # so the segment does not start on a page boundary
                  "seg = fk.upload(pattern(501, 8192))\n"
                  "h = C.c_void_p()\n"
                  "fk.check(fk.HcclRegisterGlobalMem(C.byref(CommMem(0, seg, 8192)), C.byref(h)))\n"
                  "fk.check(fk.HcclCommBindMem(comm, h))\n"
                  "_ = seg")
    peer.send("_ = fk.HcclCommPrepare(comm, None, 10)")
    fk.check(fk.HcclCommPrepare(comm, None, 10))
    assert peer.reply() == HCCL_SUCCESS
    local = fk.upload(bytes(4096))
    get = (OneSideDesc * 1)(OneSideDesc(local, remote + 100, 4096, UINT8))
    fk.check(fk.HcclBatchGet(comm, 1, get, 1, stream))
    put = (OneSideDesc * 1)(OneSideDesc(mine, remote + 4096, 2048, FP16))
    fk.check(fk.HcclBatchPut(comm, 1, put, 1, stream))
    bad = (OneSideDesc * 1)(OneSideDesc(local, remote + 8000, 4096, UINT8))
    assert fk.HcclBatchGet(comm, 1, bad, 1, stream) == HCCL_E_PTR  # outside the peer's segment
    fk.check(fk.aclrtSynchronizeStream(stream))
    assert fk.download(local, 4096) == pattern(501, 8192)[100:4196]
    assert peer("_ = fk.download(seg + 4096, 4096).hex()") == pattern(500, 4096).hex()
    fk.check(fk.HcclCommUnbindMem(comm, h))
    fk.check(fk.HcclDeregisterGlobalMem(h))
    assert fk.HcclDeregisterGlobalMem(h) == HCCL_E_PARA
    fk.check(fk.HcclCommDestroy(comm))
    for p in (mine, local):
        fk.check(fk.aclrtFree(p))


# ------------------------------------------------------------------------------------- IPC

def test_ipc_export_import_across_processes(fk, peers):
    peer = peers()
    key = peer("pad = fk.malloc(100)\n"  # the exported range does not start on a page boundary
               "src = fk.upload(pattern(7, 8192))\n"
               "_ = key = fk.export(src, 8192, NO_PID_CHECK)")
    assert len(key) < 65
    p = vp()
    fk.check(fk.aclrtIpcMemImportByKey(C.byref(p), key.encode(), 1), "import")
    assert fk.download(p.value, 8192) == pattern(7, 8192)
    local = fk.upload(pattern(8, 4096))
    fk.check(fk.aclrtMemcpy(address(p) + 1000, 4096, local, 4096, D2D))  # write into the peer's memory
    assert fk.aclrtMemcpy(address(p) + 8000, 4096, local, 4096, D2D) == ACL_ERROR_INVALID_PARAM  # past the region
    assert peer("_ = fk.download(src + 1000, 4096) == pattern(8, 4096)") is True
    fk.check(fk.aclrtIpcMemClose(key.encode()))
    assert fk.aclrtMemcpy(local, 16, p.value, 16, D2D) == ACL_ERROR_INVALID_PARAM  # unmapped
    assert fk.aclrtIpcMemClose(key.encode()) == ACL_ERROR_INVALID_PARAM

    # With pid validation (the default) only whitelisted importers get in.
    key2 = peer("_ = key2 = fk.export(src, 4096, 0)").encode()
    assert fk.aclrtIpcMemImportByKey(C.byref(p), key2, 0) == ACL_ERROR_RT_NO_PERMISSION
    peer(f"fk.check(fk.aclrtIpcMemSetImportPid(key2.encode(), (C.c_int32 * 1)({os.getpid()}), 1))")
    fk.check(fk.aclrtIpcMemImportByKey(C.byref(p), key2, 0))
    assert fk.download(p.value, 1000) == pattern(7, 1000)
    fk.check(fk.aclrtIpcMemClose(key2))
    peer("fk.check(fk.aclrtIpcMemClose(key2.encode()))")  # the exporter stops exporting
    assert fk.aclrtIpcMemImportByKey(C.byref(p), key2, 0) == ACL_ERROR_INVALID_PARAM
    assert fk.aclrtIpcMemImportByKey(C.byref(p), b"fakeipc:999999999:0:0:10:0", 0) == ACL_ERROR_INVALID_PARAM
    assert fk.aclrtIpcMemImportByKey(C.byref(p), b"garbage", 0) == ACL_ERROR_INVALID_PARAM
    # Export checks run in the exporter.
    small = C.create_string_buffer(65)
    assert fk.aclrtIpcMemGetExportKey(local, 8192, small, 65, 0) == ACL_ERROR_INVALID_PARAM  # > allocation
    assert fk.aclrtIpcMemGetExportKey(local, 4096, small, 8, 0) == ACL_ERROR_INVALID_PARAM  # key buffer
    fk.check(fk.aclrtFree(local))
