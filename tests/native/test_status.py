"""Tests for pdlink.status: status code values, str forms, LLMException, helpers."""

import logging
import pickle
from enum import IntEnum

import pytest

import internals
from internals import handle_llm_status, raise_if_false, raise_if_true
from llm_datadist import Status
from llm_datadist.status import code_2_status
from pdlink import LLMException, LLMStatusCode

EXPECTED_CODES = {
    "LLM_SUCCESS": 0,
    "LLM_FAILED": 4294967295,
    "LLM_WAIT_PROCESS_TIMEOUT": 1343270913,
    "LLM_KV_CACHE_NOT_EXIST": 1343270914,
    "LLM_REPEAT_REQUEST": 1343270915,
    "LLM_REQUEST_ALREADY_COMPLETED": 1343270916,
    "LLM_PARAM_INVALID": 1343270917,
    "LLM_ENGINE_FINALIZED": 1343270918,
    "LLM_NOT_YET_LINK": 1343270919,
    "LLM_ALREADY_LINK": 1343270920,
    "LLM_LINK_FAILED": 1343270921,
    "LLM_UNLINK_FAILED": 1343270922,
    "LLM_NOTIFY_PROMPT_UNLINK_FAILED": 1343270923,
    "LLM_CLUSTER_NUM_EXCEED_LIMIT": 1343270924,
    "LLM_PROCESSING_LINK": 1343270925,
    "LLM_DEVICE_OUT_OF_MEMORY": 1343270926,
    "LLM_PREFIX_ALREADY_EXIST": 1343270927,
    "LLM_PREFIX_NOT_EXIST": 1343270928,
    "LLM_SEQ_LENOVERLIMIT": 1343270929,
    "LLM_NO_FREE_BLOCK": 1343270930,
    "LLM_BLOCKS_OUT_OF_MEMORY": 1343270931,
    "LLM_EXIST_LINK": 1343270936,
    "LLM_FEATURE_NOT_ENABLED": 1343270937,
    "LLM_TIMEOUT": 1343270938,
    "LLM_LINK_BUSY": 1343270939,
    "LLM_OUT_OF_MEMORY": 1343270940,
    "LLM_STALE_EPOCH": 0x5010B101,  # pdlink's own (role epochs): no llm_datadist call raises them
    "LLM_ROLE_SWITCHING": 0x5010B102,
    "LLM_OFFER_RELEASED": 0x5010B103,
    "LLM_DEVICE_MEM_ERROR": 507053,
    "LLM_SUSPECT_REMOTE_ERROR": 507057,
    "LLM_UNKNOWN_ERROR": -1,
}


def test_status_code_is_int_enum():
    assert issubclass(LLMStatusCode, IntEnum)


@pytest.mark.parametrize("name,value", sorted(EXPECTED_CODES.items()))
def test_status_code_values(name, value):
    member = LLMStatusCode[name]
    assert member.value == value
    assert int(member) == value
    assert member == value


def test_status_code_member_set_is_exact():
    assert {m.name for m in LLMStatusCode} == set(EXPECTED_CODES)
    # No aliases: every member has its own value.
    assert len(LLMStatusCode.__members__) == len(EXPECTED_CODES)
    # C++-only names do not exist in Python.
    for missing in ("LLM_WAIT_PROC_TIMEOUT", "LLM_CACHE_INCOMPATIBLE", "LLM_CACHE_KEY_ALREADY_EXIST"):
        assert missing not in LLMStatusCode.__members__


def test_pdlinks_own_codes_are_the_native_modules():
    """pdlink.LLMStatusCode writes the values of pdlink's own codes so that ``import pdlink`` stays
    light; they are the native module's (csrc/core/status.h), and the engine names them."""
    core = internals.core
    assert LLMStatusCode.LLM_STALE_EPOCH == core.LLM_STALE_EPOCH
    assert LLMStatusCode.LLM_ROLE_SWITCHING == core.LLM_ROLE_SWITCHING
    assert LLMStatusCode.LLM_OFFER_RELEASED == core.LLM_OFFER_RELEASED


def test_status_code_hex_values():
    assert LLMStatusCode.LLM_PARAM_INVALID == 0x5010B005
    assert LLMStatusCode.LLM_EXIST_LINK == 0x5010B018
    assert LLMStatusCode.LLM_OUT_OF_MEMORY == 0x5010B01C
    assert LLMStatusCode.LLM_FAILED == 0xFFFFFFFF


@pytest.mark.parametrize("member", list(LLMStatusCode))
def test_status_code_str(member):
    assert str(member) == f"LLMStatusCode.{member.name}"
    assert f"{member}" == f"LLMStatusCode.{member.name}"
    assert format(member, "d") == str(member.value)


def test_code_2_status_known_and_unknown():
    for name, value in EXPECTED_CODES.items():
        if name == "LLM_UNKNOWN_ERROR":
            continue
        assert code_2_status(value) is LLMStatusCode[name]
    assert code_2_status(LLMStatusCode.LLM_TIMEOUT) is LLMStatusCode.LLM_TIMEOUT
    # unknown codes, including C++-only ones and -1, map to LLM_FAILED
    assert code_2_status(12345) is LLMStatusCode.LLM_FAILED
    assert code_2_status(0x5010B014) is LLMStatusCode.LLM_FAILED
    assert code_2_status(-1) is LLMStatusCode.LLM_FAILED


def test_llm_exception_basics():
    exc = LLMException("boom", status_code=LLMStatusCode.LLM_TIMEOUT)
    assert issubclass(type(exc), RuntimeError)  # not isinstance: mypy would narrow exc to RuntimeError
    assert exc.status_code is LLMStatusCode.LLM_TIMEOUT
    assert str(exc) == "boom"
    assert exc.args == ("boom",)
    assert LLMException("x").status_code is LLMStatusCode.LLM_SUCCESS
    with pytest.raises(AttributeError):
        exc.status_code = LLMStatusCode.LLM_FAILED  # type: ignore[misc]
    with pytest.raises(RuntimeError):
        raise exc


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_llm_exception_pickle_keeps_status_code(protocol):
    exc = LLMException("pull failed", "extra", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    restored = pickle.loads(pickle.dumps(exc, protocol=protocol))
    assert type(restored) is LLMException  # exactly the class it was made as, kept by pickling
    assert restored.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert restored.args == ("pull failed", "extra")
    assert str(restored) == str(exc)


def test_llm_exception_subclass_pickle():
    class MyExc(LLMException):
        pass

    # local classes are not picklable by reference; use copy semantics via __reduce__
    exc = MyExc("a", status_code=LLMStatusCode.LLM_LINK_BUSY)
    reduced = exc.__reduce__()
    assert isinstance(reduced, tuple)
    func, args = reduced
    restored = func(*args)
    assert type(restored) is MyExc
    assert restored.status_code is LLMStatusCode.LLM_LINK_BUSY
    assert restored.args == ("a",)


def test_status_class():
    ok = Status(LLMStatusCode.LLM_SUCCESS)
    assert ok.is_ok()
    assert ok.status_code is LLMStatusCode.LLM_SUCCESS
    bad = Status(LLMStatusCode.LLM_FAILED)
    assert not bad.is_ok()
    assert bad.status_code is LLMStatusCode.LLM_FAILED
    assert Status(0).is_ok()


def test_handle_llm_status():
    handle_llm_status(0, "pull_cache", "info")  # no raise
    with pytest.raises(LLMException) as ei:
        handle_llm_status(int(LLMStatusCode.LLM_NOT_YET_LINK), "pull_cache", "cluster_id=1")
    assert ei.value.status_code is LLMStatusCode.LLM_NOT_YET_LINK
    assert str(ei.value) == "pull_cache failed, error code is LLMStatusCode.LLM_NOT_YET_LINK, cluster_id=1."
    with pytest.raises(LLMException) as ei:
        handle_llm_status(99, "link", "x")
    assert ei.value.status_code is LLMStatusCode.LLM_FAILED


def test_raise_if_false_and_true(caplog):
    raise_if_false(True, "never")
    raise_if_true(False, "never")
    with caplog.at_level(logging.ERROR, logger="pdlink"):
        with pytest.raises(LLMException) as ei:
            raise_if_false(False, "bad thing")
    assert ei.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    assert str(ei.value) == "bad thing"
    assert any(r.name == "pdlink" and "bad thing" in r.getMessage() for r in caplog.records)

    with pytest.raises(LLMException) as ei:
        raise_if_true(1, "other", status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
    assert ei.value.status_code is LLMStatusCode.LLM_FEATURE_NOT_ENABLED


def test_raise_if_format_args_and_braces():
    with pytest.raises(LLMException, match=r"index 3 out of range \[0, 2\)"):
        raise_if_false(False, "index {0} out of range [0, {1})", 3, 2)
    # braces are left alone when no format args are given
    with pytest.raises(LLMException) as ei:
        raise_if_true(True, 'bad json {"a": 1}')
    assert str(ei.value) == 'bad json {"a": 1}'
