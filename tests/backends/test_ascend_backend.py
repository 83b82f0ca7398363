"""The Ascend backend's loader and backend on the fake vendor libraries (tests/fake_ascend).

The loader runs once per process, so each case runs in a new peer process (tests/peer.py: none has
run the loader before, the fork server included) with its own environment, calling functions of
tests/peers/ascend_backend.py. LD_LIBRARY_PATH takes a fresh interpreter (peer.py does that).
End-to-end transfers on this backend are the `[ascend]` cases of the shared suite.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from fake_ascend.build import build, exported_symbols
from internals import core as _core
from pdlink import LLMException, LLMStatusCode
from peer import Peer
from peers import ascend_backend as ab
from where import REPO

R = TypeVar("R")



@pytest.fixture(scope="module")
def fakes():
    return str(build("full"))


RUN_TIMEOUT = 60.0
SCRUBBED = ("PDLINK_", "ASCEND_", "FAKE_ASCEND_", "HCCL_")


def fresh(peers: Callable[..., Peer], **env: str) -> Peer:
    """A new peer process with only the given Ascend/pdlink variables set (every PDLINK_, ASCEND_,
    FAKE_ASCEND_ and HCCL_ variable of this process left out)."""
    scrubbed: dict[str, str | None] = {k: None for k in os.environ if k.startswith(SCRUBBED)}
    return peers("ascend-loader", env=scrubbed | env)


def run_fresh(peers: Callable[..., Peer], fn: Callable[..., R], *args: Any, **env: str) -> R:
    """``fn(*args)`` in a fresh peer (``fresh``) with the given variables."""
    return fresh(peers, **env).call_within(RUN_TIMEOUT, fn, *args)


def copy_libs(src: str | os.PathLike[str], dst: str) -> None:
    os.makedirs(dst)
    for name in ("libascendcl.so", "libhccl.so"):
        shutil.copy(os.path.join(src, name), dst)


# ------------------------------------------------------------------------------------------ loader

def test_unavailable_without_libraries_names_where_it_looked(peers, tmp_path):
    out = run_fresh(peers, ab.info, PDLINK_ASCEND_LIB_DIR=str(tmp_path))
    assert out["ascend"]["name"] is None
    assert "LLM_FEATURE_NOT_ENABLED" in out["ascend"]["error"]
    assert f"PDLINK_ASCEND_LIB_DIR={tmp_path} has no libascendcl.so" in out["ascend"]["error"]
    assert out["ascend"]["ascend"]["loaded"] is False
    assert out["auto"]["name"] == "cpu" and out["auto"]["error"] == ""


def test_default_loader_path_is_searched_last(peers, tmp_path):
    # No variable set: the plain soname goes through the loader's default path (LD_LIBRARY_PATH).
    out = run_fresh(peers, ab.info)
    if not out["ascend"]["ascend"]["loaded"]:
        assert "searched the dynamic loader's default path" in out["ascend"]["error"]
    lib = tmp_path / "ld"
    copy_libs(build("full"), str(lib))
    out = run_fresh(peers, ab.info, LD_LIBRARY_PATH=str(lib))
    assert out["ascend"]["name"] == "ascend" and out["ascend"]["ascend"]["library_dir"] == ""


@pytest.mark.parametrize("var", ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"])
def test_toolkit_variables_are_searched(peers, tmp_path, fakes, var):
    copy_libs(fakes, str(tmp_path / "cann" / "lib64"))
    out = run_fresh(peers, ab.info, **{var: str(tmp_path / "cann")})
    assert out["ascend"]["name"] == "ascend", out
    assert out["ascend"]["ascend"]["library_dir"] == str(tmp_path / "cann" / "lib64")
    assert out["auto"]["name"] == "ascend"


def test_explicit_directory_wins_over_toolkit_variables(peers, tmp_path, fakes):
    copy_libs(build("broken"), str(tmp_path / "cann" / "lib64"))
    out = run_fresh(peers, ab.info, PDLINK_ASCEND_LIB_DIR=fakes, ASCEND_HOME_PATH=str(tmp_path / "cann"))
    assert out["ascend"]["name"] == "ascend"
    assert out["ascend"]["ascend"]["library_dir"] == fakes


def test_missing_required_symbol_is_a_clear_error(peers):
    out = run_fresh(peers, ab.info, PDLINK_ASCEND_LIB_DIR=str(build("broken")))
    err = out["ascend"]["error"]
    assert "lack required symbols: aclrtMemcpyAsync" in err and "LLM_FEATURE_NOT_ENABLED" in err
    assert out["auto"]["name"] == "cpu"  # auto falls back; an explicit "ascend" fails init:
    with pytest.raises(LLMException) as e:
        run_fresh(peers, ab.init_engine, "ascend", PDLINK_ASCEND_LIB_DIR=str(build("broken")))
    assert e.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED and "aclrtMemcpyAsync" in str(e.value)


def test_missing_optional_symbol_switches_its_feature_off(peers):
    out = run_fresh(peers, ab.info, PDLINK_ASCEND_LIB_DIR=str(build("no_optional")))
    assert out["ascend"]["name"] == "ascend"
    assert out["ascend"]["features"]["ipc"] is False
    assert "aclrtIpcMemGetExportKey" in out["ascend"]["ascend"]["missing_optional"]
    full = run_fresh(peers, ab.info, PDLINK_ASCEND_LIB_DIR=str(build("full")))
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

def test_no_device_means_cpu_for_auto_and_an_error_for_ascend(peers, fakes):
    out = run_fresh(peers, ab.info, PDLINK_ASCEND_LIB_DIR=fakes, FAKE_ASCEND_DEVICE_COUNT="0")
    assert out["auto"]["name"] == "cpu"
    assert "the runtime reports no device" in out["ascend"]["error"]


def test_device_id_out_of_range_is_param_invalid_even_for_auto(peers, fakes):
    out = run_fresh(peers, ab.open_backend_errors, 2, PDLINK_ASCEND_LIB_DIR=fakes, FAKE_ASCEND_DEVICE_COUNT="2")
    for name in ("ascend", "auto"):
        assert out[name][0] == "LLM_PARAM_INVALID" and "device_id 2 out of range" in out[name][1]


def test_application_runtime_and_thread_device_are_left_as_they_were(peers, fakes):
    # An application (torch_npu) initialised ACL and bound device 1 on its thread; pdlink works on
    # device 0 from that thread and from a thread of its own, then the application's thread is
    # still on device 1 and ACL is still initialised (pdlink finalises nothing).
    out = run_fresh(peers, ab.application_runtime, fakes, PDLINK_ASCEND_LIB_DIR=fakes)
    assert out["first_init"] == 0 and out["set_dev"] == 0
    assert out["backend"] == "ascend" and out["data"] == list(range(256))
    assert out["dev_after"] == 1
    assert out["init_again"] == 100002  # ACL_ERROR_REPEAT_INITIALIZE: still initialised


def test_device_memory_is_device_memory_and_freed(peers, fakes):
    out = run_fresh(peers, ab.device_memory_accounting, fakes, PDLINK_ASCEND_LIB_DIR=fakes)
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


def test_malloc_failure_is_device_out_of_memory(peers, fakes):
    with pytest.raises(LLMException) as e:
        run_fresh(peers, ab.init_engine, None, '{"memory_size": 4194304, "page_shift": 16}',
                  PDLINK_ASCEND_LIB_DIR=fakes, PDLINK_BACKEND="ascend", FAKE_ASCEND_INJECT="aclrtMalloc:207001:0:-1")
    assert e.value.status_code == LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
    assert "aclrtMalloc failed: ACL_ERROR_RT_MEMORY_ALLOCATION (207001)" in str(e.value)


def test_local_copies_between_placements(peers, fakes):
    # swap_blocks in (HOST -> DEVICE) and out (DEVICE -> HOST), copy_blocks inside DEVICE memory:
    # the copy kinds come from each cache's placement.
    out = run_fresh(peers, ab.local_copies_between_placements, PDLINK_ASCEND_LIB_DIR=fakes, PDLINK_BACKEND="ascend")
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
    res = subprocess.run([sys.executable, "-m", "pdlink", "demo", "--size-mib", "4", "--block-kib", "64",
                          "--tensors", "4", "--repeat", "2"], env=env, capture_output=True, text=True, timeout=120)
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
