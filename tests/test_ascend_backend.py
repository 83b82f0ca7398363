"""The Ascend backend's loader and backend on the fake vendor libraries (tests/fake_ascend).

The loader runs once per process, so each case runs in a fresh Python process with its own
environment. End-to-end transfers on this backend are the `[ascend]` cases of the shared suite.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from fake_ascend.build import build, exported_symbols
from internals import core as _core
from pdlink import LLMException, LLMStatusCode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def fakes():
    return str(build("full"))


RUN_TIMEOUT = 60.0


def run_py(code: str, timeout: float = RUN_TIMEOUT, **env: str) -> dict:
    """Runs `code` in a fresh interpreter with only the given Ascend/pdlink variables set; the
    code prints one JSON object, which is returned."""
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("PDLINK_", "ASCEND_", "FAKE_ASCEND_", "HCCL_"))}
    e.update(env)
    prelude = "import json, os, sys\nimport numpy as np\n"
    res = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=e, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


INFO = """
from pdlink.device import backend_info
print(json.dumps({"ascend": backend_info("ascend"), "auto": backend_info("auto")}))
"""


def copy_libs(src: str | os.PathLike[str], dst: str) -> None:
    os.makedirs(dst)
    for name in ("libascendcl.so", "libhccl.so"):
        shutil.copy(os.path.join(src, name), dst)


# ------------------------------------------------------------------------------------------ loader

def test_unavailable_without_libraries_names_where_it_looked(tmp_path):
    out = run_py(INFO, PDLINK_ASCEND_LIB_DIR=str(tmp_path))
    assert out["ascend"]["name"] is None
    assert "LLM_FEATURE_NOT_ENABLED" in out["ascend"]["error"]
    assert f"PDLINK_ASCEND_LIB_DIR={tmp_path} has no libascendcl.so" in out["ascend"]["error"]
    assert out["ascend"]["ascend"]["loaded"] is False
    assert out["auto"]["name"] == "cpu" and out["auto"]["error"] == ""


def test_default_loader_path_is_searched_last(tmp_path):
    # No variable set: the plain soname goes through the loader's default path (LD_LIBRARY_PATH).
    out = run_py(INFO)
    if not out["ascend"]["ascend"]["loaded"]:
        assert "searched the dynamic loader's default path" in out["ascend"]["error"]
    lib = tmp_path / "ld"
    copy_libs(build("full"), str(lib))
    out = run_py(INFO, LD_LIBRARY_PATH=str(lib))
    assert out["ascend"]["name"] == "ascend" and out["ascend"]["ascend"]["library_dir"] == ""


@pytest.mark.parametrize("var", ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"])
def test_toolkit_variables_are_searched(tmp_path, fakes, var):
    copy_libs(fakes, str(tmp_path / "cann" / "lib64"))
    out = run_py(INFO, RUN_TIMEOUT, **{var: str(tmp_path / "cann")})  # timeout given: the dict holds variables only
    assert out["ascend"]["name"] == "ascend", out
    assert out["ascend"]["ascend"]["library_dir"] == str(tmp_path / "cann" / "lib64")
    assert out["auto"]["name"] == "ascend"


def test_explicit_directory_wins_over_toolkit_variables(tmp_path, fakes):
    copy_libs(build("broken"), str(tmp_path / "cann" / "lib64"))
    out = run_py(INFO, PDLINK_ASCEND_LIB_DIR=fakes, ASCEND_HOME_PATH=str(tmp_path / "cann"))
    assert out["ascend"]["name"] == "ascend"
    assert out["ascend"]["ascend"]["library_dir"] == fakes


def test_missing_required_symbol_is_a_clear_error():
    out = run_py(INFO, PDLINK_ASCEND_LIB_DIR=str(build("broken")))
    err = out["ascend"]["error"]
    assert "lack required symbols: aclrtMemcpyAsync" in err and "LLM_FEATURE_NOT_ENABLED" in err
    assert out["auto"]["name"] == "cpu"  # auto falls back; an explicit "ascend" fails init:
    out = run_py("""
        from llm_datadist import LLMDataDist, LLMRole, LLMConfig, LLMException
        cfg = LLMConfig(); cfg.enable_cache_manager = True
        opts = cfg.generate_options(); opts["pdlink.Backend"] = "ascend"
        try:
            LLMDataDist(LLMRole.DECODER, 2).init(opts)
        except LLMException as e:
            print(json.dumps({"code": e.status_code.name, "msg": str(e)}))
    """, PDLINK_ASCEND_LIB_DIR=str(build("broken")))
    assert out["code"] == "LLM_FEATURE_NOT_ENABLED" and "aclrtMemcpyAsync" in out["msg"]


def test_missing_optional_symbol_switches_its_feature_off():
    out = run_py(INFO, PDLINK_ASCEND_LIB_DIR=str(build("no_optional")))
    assert out["ascend"]["name"] == "ascend"
    assert out["ascend"]["features"]["ipc"] is False
    assert "aclrtIpcMemGetExportKey" in out["ascend"]["ascend"]["missing_optional"]
    full = run_py(INFO, PDLINK_ASCEND_LIB_DIR=str(build("full")))
    assert full["ascend"]["features"] == {"error_text": True, "ipc": True, "one_sided": True, "sync_timeout": True}
    assert full["ascend"]["ascend"]["missing_optional"] == []


def test_fakes_export_the_whole_symbol_table(fakes):
    header = open(os.path.join(REPO, "csrc", "backends", "ascend", "ascend_api.h")).read()
    table = set(re.findall(r"^\s*PDLINK_ACL_FN\((\w+)\)", header, re.M))
    assert len(table) > 30
    exported = exported_symbols(os.path.join(fakes, "libascendcl.so")) | exported_symbols(
        os.path.join(fakes, "libhccl.so"))
    assert table <= exported, sorted(table - exported)


def test_unknown_backend_name():
    with pytest.raises(LLMException) as e:
        _core.open_backend("npu", 0)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert "available: auto, cpu, ascend" in str(e.value)


# ------------------------------------------------------------------------------------------ devices

def test_no_device_means_cpu_for_auto_and_an_error_for_ascend(fakes):
    out = run_py(INFO, PDLINK_ASCEND_LIB_DIR=fakes, FAKE_ASCEND_DEVICE_COUNT="0")
    assert out["auto"]["name"] == "cpu"
    assert "the runtime reports no device" in out["ascend"]["error"]


def test_device_id_out_of_range_is_param_invalid_even_for_auto(fakes):
    out = run_py("""
        from pdlink.device import open_backend
        from pdlink.status import LLMException
        res = {}
        for name in ("ascend", "auto"):
            try:
                open_backend(name, 2)
            except LLMException as e:
                res[name] = [e.status_code.name, str(e)]
        print(json.dumps(res))
    """, PDLINK_ASCEND_LIB_DIR=fakes, FAKE_ASCEND_DEVICE_COUNT="2")
    for name in ("ascend", "auto"):
        assert out[name][0] == "LLM_PARAM_INVALID" and "device_id 2 out of range" in out[name][1]


def test_application_runtime_and_thread_device_are_left_as_they_were(fakes):
    # An application (torch_npu) initialised ACL and bound device 1 on its thread; pdlink works on
    # device 0 from that thread and from a thread of its own, then the application's thread is
    # still on device 1 and ACL is still initialised (pdlink finalises nothing).
    out = run_py(f"""
        import ctypes, threading
        acl = ctypes.CDLL({os.path.join(fakes, "libascendcl.so")!r})
        first_init = acl.aclInit(None)
        set_dev = acl.aclrtSetDevice(1)
        from pdlink.device import DeviceMemory
        mem = DeviceMemory(4096, device_id=0, backend="ascend")
        mem.write(bytes(range(256)) * 16)
        seen = {{}}
        def worker():
            seen["data"] = mem.read(256).tolist()
        t = threading.Thread(target=worker); t.start(); t.join()
        dev = ctypes.c_int32(-1)
        acl.aclrtGetDevice(ctypes.byref(dev))
        print(json.dumps({{"first_init": first_init, "set_dev": set_dev, "dev_after": dev.value,
                          "init_again": acl.aclInit(None), "data": seen["data"], "backend": mem.backend}}))
        mem.free()
    """, PDLINK_ASCEND_LIB_DIR=fakes)
    assert out["first_init"] == 0 and out["set_dev"] == 0
    assert out["backend"] == "ascend" and out["data"] == list(range(256))
    assert out["dev_after"] == 1
    assert out["init_again"] == 100002  # ACL_ERROR_REPEAT_INITIALIZE: still initialised


def test_device_memory_is_device_memory_and_freed(fakes):
    out = run_py(f"""
        import ctypes
        acl = ctypes.CDLL({os.path.join(fakes, "libascendcl.so")!r})
        acl.fake_acl_bytes_in_use.restype = ctypes.c_ulonglong
        from pdlink.device import DeviceMemory
        before = acl.fake_acl_bytes_in_use(0)
        mem = DeviceMemory(3 << 20, backend="ascend")
        during = acl.fake_acl_bytes_in_use(0)
        mem.free()
        after = acl.fake_acl_bytes_in_use(0)
        DeviceMemory(1 << 20, backend="ascend")  # dropped at once: garbage collection frees it
        print(json.dumps({{"before": before, "during": during, "after": after,
                          "after_gc": acl.fake_acl_bytes_in_use(0)}}))
    """, PDLINK_ASCEND_LIB_DIR=fakes)
    assert out["during"] - out["before"] >= 3 << 20
    assert out["after"] == out["before"] == out["after_gc"]


def test_device_memory_api_on_the_cpu_backend():
    from internals import DeviceMemory

    with DeviceMemory(64, backend="cpu") as m:
        m.write(bytes(range(16)), offset=48)
        assert m.read(16, offset=48).tolist() == list(range(16)) and m.backend == "cpu"
        with pytest.raises(ValueError, match="outside the 64-byte allocation"):
            m.read(8, offset=60)
        with pytest.raises(ValueError, match="outside"):
            m.write(b"x" * 65)
    with pytest.raises(ValueError, match="was freed"):
        m.read()
    m.free()  # idempotent
    with pytest.raises(ValueError, match="positive int"):
        DeviceMemory(0, backend="cpu")


def test_malloc_failure_is_device_out_of_memory(fakes):
    out = run_py("""
        from llm_datadist import LLMDataDist, LLMRole, LLMConfig, LLMException
        cfg = LLMConfig(); cfg.enable_cache_manager = True
        cfg.mem_pool_cfg = '{"memory_size": 4194304, "page_shift": 16}'
        try:
            LLMDataDist(LLMRole.DECODER, 2).init(cfg.generate_options())
        except LLMException as e:
            print(json.dumps({"code": e.status_code.name, "msg": str(e)}))
    """, PDLINK_ASCEND_LIB_DIR=fakes, PDLINK_BACKEND="ascend", FAKE_ASCEND_INJECT="aclrtMalloc:207001:0:-1")
    assert out["code"] == "LLM_DEVICE_OUT_OF_MEMORY"
    assert "aclrtMalloc failed: ACL_ERROR_RT_MEMORY_ALLOCATION (207001)" in out["msg"]


def test_local_copies_between_placements(fakes):
    # swap_blocks in (HOST -> DEVICE) and out (DEVICE -> HOST), copy_blocks inside DEVICE memory:
    # the copy kinds come from each cache's placement.
    out = run_py("""
        import ctypes
        from llm_datadist import (LLMDataDist, LLMRole, LLMConfig, CacheDesc, DataType, Placement)
        cfg = LLMConfig(); cfg.enable_cache_manager = True
        cfg.mem_pool_cfg = '{"memory_size": 4194304, "page_shift": 12}'
        cfg.host_mem_pool_cfg = '{"memory_size": 4194304, "page_shift": 12}'
        dd = LLMDataDist(LLMRole.DECODER, 2); dd.init(cfg.generate_options()); cm = dd.cache_manager
        def desc(p): return CacheDesc(2, [8, 256], DataType.DT_UINT8, p)
        host_in = cm.allocate_blocks_cache(desc(Placement.HOST))
        dev = cm.allocate_blocks_cache(desc(Placement.DEVICE))
        host_out = cm.allocate_blocks_cache(desc(Placement.HOST))
        view = lambda a: np.frombuffer((ctypes.c_uint8 * 2048).from_address(a), dtype=np.uint8)
        for t, a in enumerate(host_in.tensor_addrs):
            view(a)[:] = (np.arange(2048) * 7 + t) % 251
        cm.swap_blocks(host_in, dev, {0: 3, 5: 1})
        cm.copy_blocks(dev, {3: [6]})
        cm.swap_blocks(dev, host_out, {3: 0, 1: 1, 6: 2})
        ok = all(
            (view(o)[0:256] == view(i)[0:256]).all() and (view(o)[256:512] == view(i)[1280:1536]).all()
            and (view(o)[512:768] == view(i)[0:256]).all()
            for i, o in zip(host_in.tensor_addrs, host_out.tensor_addrs))
        print(json.dumps({"ok": bool(ok), "backend": dd._engine.backend}))
        dd.finalize()
    """, PDLINK_ASCEND_LIB_DIR=fakes, PDLINK_BACKEND="ascend")
    assert out == {"ok": True, "backend": "ascend"}


# ------------------------------------------------------------------------------------------ codes

@pytest.mark.parametrize("lib,rc,code", [
    ("acl", 0, "LLM_SUCCESS"),
    ("acl", 100000, "LLM_PARAM_INVALID"),
    ("acl", 107001, "LLM_PARAM_INVALID"),
    ("acl", 207001, "LLM_DEVICE_OUT_OF_MEMORY"),
    ("acl", 207018, "LLM_DEVICE_OUT_OF_MEMORY"),
    ("acl", 507046, "LLM_TIMEOUT"),
    ("acl", 207000, "LLM_FEATURE_NOT_ENABLED"),
    ("acl", 507000, "LLM_FAILED"),
    ("acl", 107002, "LLM_FAILED"),
    ("hccl", 1, "LLM_PARAM_INVALID"),
    ("hccl", 9, "LLM_TIMEOUT"),
    ("hccl", 13, "LLM_LINK_FAILED"),
    ("hccl", 21, "LLM_LINK_FAILED"),
    ("hccl", 24, "LLM_DEVICE_OUT_OF_MEMORY"),
    ("hccl", 5, "LLM_FEATURE_NOT_ENABLED"),
    ("hccl", 4, "LLM_FAILED"),
])
def test_vendor_codes_map_to_llm_status_codes(lib, rc, code):
    assert LLMStatusCode(_core._map_vendor_code(lib, rc)).name == code


def test_demo_runs_on_the_ascend_backend(fakes):
    # `pdlink demo` allocates its KV through the engine's backend: here NPU memory moved over HCCL.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDLINK_", "ASCEND_"))}
    env.update(PDLINK_BACKEND="ascend", PDLINK_ASCEND_LIB_DIR=fakes)
    res = subprocess.run([sys.executable, "-c", "from pdlink.demo import run; raise SystemExit(run(4, 64, 4, 2))"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("backend ascend: KV in device memory, moved over HCCL") == 1
    assert res.stdout.count("verified byte for byte") == 2 and "OK: KV moved" in res.stdout


@pytest.mark.parametrize("options,env,match", [
    ({"pdlink.Backend": "npu"}, {}, "pdlink.Backend (or PDLINK_BACKEND) must be one of"),
    ({}, {"PDLINK_BACKEND": "gpu"}, "got 'gpu'"),
    ({"ge.exec.deviceId": "x"}, {}, "ge.exec.deviceId must be a device id, got 'x'"),
    ({"ge.exec.deviceId": ""}, {}, "ge.exec.deviceId must be a device id"),
    ({"pdlink.HcclOneSided": "yes"}, {}, "must be '0' or '1'"),
])
def test_bad_backend_options_are_param_invalid(monkeypatch, options, env, match):
    from internals import parse_engine_options
    from pdlink import LLMException

    for k in ("PDLINK_BACKEND", "PDLINK_HCCL_ONE_SIDED"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(LLMException) as e:
        parse_engine_options(options)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and match in str(e.value)


def test_backend_options_pick_backend_and_device(monkeypatch):
    from internals import parse_engine_options

    monkeypatch.delenv("PDLINK_BACKEND", raising=False)
    assert parse_engine_options({})["backend"] == "auto"
    cfg = parse_engine_options({"pdlink.Backend": "ascend", "ge.exec.deviceId": "3"})
    assert (cfg["backend"], cfg["device_id"]) == ("ascend", 3)
    monkeypatch.setenv("PDLINK_BACKEND", "cpu")
    assert parse_engine_options({})["backend"] == "cpu"
    assert parse_engine_options({"pdlink.Backend": "ascend"})["backend"] == "ascend"  # the option wins
