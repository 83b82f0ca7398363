"""Tests for pdlink.compat.llm_datadist._utils validation helpers and pdlink.compat.llm_datadist.data_type."""

import os
from enum import Enum

import pytest

import fresh_import
from internals import itemsize
from internals import validation_utils as u
from llm_datadist import DataType
from pdlink import LinkError, LLMException, LLMStatusCode
from where import REPO

_PYTHON_DIR = str(REPO / "python")


# ---------------------------------------------------------------------------- constants


def test_constants():
    assert u.UINT64_MAX == 2**64 - 1
    assert u.INVALID_ID == 2**64 - 1
    assert u.INT64_MAX == 2**63 - 1
    assert u.INT64_MIN == -(2**63)
    assert u.UINT32_MAX == 2**32 - 1
    assert u.INT32_MAX == 2**31 - 1
    assert u.INT32_MIN == -(2**31)
    assert u.UINT16_MAX == 2**16 - 1
    assert u.UINT8_MAX == 2**8 - 1


# ---------------------------------------------------------------------------- check_isinstance


def test_check_isinstance_message():
    with pytest.raises(TypeError) as ei:
        u.check_isinstance("req_id", "1", int)
    assert str(ei.value) == "req_id only support ['int'], but got <class 'str'>."
    with pytest.raises(TypeError) as ei:
        u.check_isinstance("x", 1.0, [str, int])
    assert str(ei.value) == "x only support ['str', 'int'], but got <class 'float'>."
    with pytest.raises(TypeError) as ei:
        u.check_isinstance("x", 1.0, (str, int), extra_fmt="The first param ")
    assert str(ei.value) == "The first param x only support ['str', 'int'], but got <class 'float'>."


def test_check_isinstance_none_handling():
    assert u.check_isinstance("x", None, int) is None
    with pytest.raises(TypeError) as ei:
        u.check_isinstance("x", None, int, allow_none=False)
    assert str(ei.value) == "x only support ['int'], but got <class 'NoneType'>."
    # allow_none is the 4th positional parameter
    with pytest.raises(TypeError):
        u.check_isinstance("x", None, int, False)


def test_check_isinstance_bool_is_not_int():
    with pytest.raises(TypeError) as ei:
        u.check_isinstance("n", True, int)
    assert str(ei.value) == "n only support ['int'], but got <class 'bool'>."
    assert u.check_isinstance("b", True, bool) is True
    assert u.check_isinstance("b", False, [bool, int]) is False
    assert u.check_isinstance("n", 5, [bool, int]) == 5


def test_check_isinstance_returns_value_and_subclasses():
    class Color(Enum):
        RED = 1

    assert u.check_isinstance("c", Color.RED, Color) is Color.RED
    from enum import IntEnum

    class Small(IntEnum):
        A = 1

    assert u.check_isinstance("n", Small.A, int) is Small.A


def test_check_isinstance_inner_types():
    assert u.check_isinstance("l", [1, 2], list, inner_types=int) == [1, 2]
    with pytest.raises(TypeError) as ei:
        u.check_isinstance("l", [1, "2"], list, inner_types=int)
    assert str(ei.value) == "l inner type only support ['int'], but got <class 'str'>."
    with pytest.raises(TypeError):
        u.check_isinstance("l", [1, True], list, inner_types=int)


def test_check_list_of():
    assert u.check_list_of("s", (1, 2), int) == (1, 2)
    assert u.check_list_of("s", [], int) == []
    with pytest.raises(TypeError):
        u.check_list_of("s", None, int)
    assert u.check_list_of("s", None, int, allow_none=True) is None
    with pytest.raises(TypeError):
        u.check_list_of("s", {1, 2}, int)
    with pytest.raises(TypeError):
        u.check_list_of("s", (1, 2), int, seq_types=list)
    with pytest.raises(TypeError):
        u.check_list_of("s", [1, 2.0], int)


def test_check_dict():
    assert u.check_dict("d", {"a": "b"}, str, str) == {"a": "b"}
    with pytest.raises(TypeError, match=r"d dict key only support \['str'\]"):
        u.check_dict("d", {1: "b"}, str, str)
    with pytest.raises(TypeError, match=r"d dict value only support \['str'\]"):
        u.check_dict("d", {"a": 1}, str, str)
    with pytest.raises(TypeError, match=r"d only support \['dict'\]"):
        u.check_dict("d", [("a", "b")], str, str)
    assert u.check_dict("d", None, str, str, allow_none=True) is None
    with pytest.raises(TypeError):
        u.check_dict("d", None, str, str)


# ---------------------------------------------------------------------------- range checks

RANGE_CASES = [
    (u.check_uint8, "uint8", 0, 2**8 - 1),
    (u.check_uint16, "uint16", 0, 2**16 - 1),
    (u.check_int32, "int32", -(2**31), 2**31 - 1),
    (u.check_uint32, "uint32", 0, 2**32 - 1),
    (u.check_int64, "int64", -(2**63), 2**63 - 1),
    (u.check_uint64, "uint64", 0, 2**64 - 1),
]


@pytest.mark.parametrize("checker,word,low,high", RANGE_CASES)
def test_range_checks(checker, word, low, high):
    assert checker("v", low) == low
    assert checker("v", high) == high
    with pytest.raises(ValueError) as ei:
        checker("v", high + 1)
    assert str(ei.value) == f"v's value is out of range,{high + 1} is not a {word} value."
    with pytest.raises(ValueError) as ei:
        checker("v", low - 1)
    assert str(ei.value) == f"v's value is out of range,{low - 1} is not a {word} value."
    with pytest.raises(TypeError) as ti:
        checker("v", "1")
    assert str(ti.value) == "v only support ['int'], but got <class 'str'>."
    with pytest.raises(TypeError):
        checker("v", None)
    with pytest.raises(TypeError):
        checker("v", True)
    with pytest.raises(TypeError):
        checker("v", 1.0)


def test_list_range_checks():
    assert u.check_list_uint64("a", [0, 2**64 - 1]) == [0, 2**64 - 1]
    with pytest.raises(ValueError, match="is not a uint64 value"):
        u.check_list_uint64("a", [1, -1])
    with pytest.raises(TypeError):
        u.check_list_uint64("a", [1, "2"])
    with pytest.raises(TypeError):
        u.check_list_uint64("a", 5)
    assert u.check_list_uint64("a", None, allow_none=True) is None
    with pytest.raises(ValueError, match="is not a int64 value"):
        u.check_list_int64("a", (2**63,))
    with pytest.raises(ValueError, match="is not a int32 value"):
        u.check_list_int32("a", [2**31])
    with pytest.raises(ValueError, match="is not a uint32 value"):
        u.check_list_uint32("a", [-1])


def test_check_layer_range():
    assert u.check_layer_range("r", None) is None
    r = range(0, 3)
    assert u.check_layer_range("r", r) is r
    with pytest.raises(TypeError, match=r"r only support \['range'\]"):
        u.check_layer_range("r", None, allow_none=False)
    with pytest.raises(TypeError):
        u.check_layer_range("r", [0, 1])
    for bad in (range(0, 4, 2), range(2, 2), range(3, 1), range(-1, 2)):
        with pytest.raises(LLMException) as ei:
            u.check_layer_range("r", bad)
        assert ei.value.status_code is LLMStatusCode.LLM_PARAM_INVALID


def test_is_valid_id():
    assert u.is_valid_id(0)
    assert u.is_valid_id(2**64 - 2)
    assert not u.is_valid_id(2**64 - 1)
    assert not u.is_valid_id(-1)
    assert not u.is_valid_id(True)
    assert not u.is_valid_id("1")


def test_raise_helpers_reexported():
    with pytest.raises(LLMException) as ei:
        u.raise_if_false(False, "x")
    assert ei.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException):
        u.raise_if_true(True, "x")


def test_raising_as_gives_engine_errors_llm_datadists_format():
    """An engine error (pdlink.Engine's class, the engine's message and words) leaves ``raising_as(op)``
    as llm_datadist raises it: exactly LLMException, "<op> failed, error code is <code>, <detail>."."""
    engine_error = LinkError("no link to cluster 5; connect first", status_code=LLMStatusCode.LLM_NOT_YET_LINK)
    with pytest.raises(LLMException) as ei:
        with u.raising_as("pull_blocks"):
            raise engine_error
    assert type(ei.value) is LLMException and ei.value.status_code is LLMStatusCode.LLM_NOT_YET_LINK
    assert str(ei.value) == ("pull_blocks failed, error code is LLMStatusCode.LLM_NOT_YET_LINK, "
                             "no link to cluster 5; call link_clusters first.")
    assert ei.value.__cause__ is None and ei.value.__suppress_context__
    with u.raising_as("pull_blocks"):  # nothing raised: nothing to do
        pass
    with pytest.raises(ValueError, match="^plain$"):  # not an engine error: it passes as it is
        with u.raising_as("pull_blocks"):
            raise ValueError("plain")


# ---------------------------------------------------------------------------- data_type

EXPECTED_DT = {
    "DT_FLOAT": (0, 4),
    "DT_FLOAT16": (1, 2),
    "DT_INT8": (2, 1),
    "DT_INT32": (3, 4),
    "DT_UINT8": (4, 1),
    "DT_INT16": (6, 2),
    "DT_UINT16": (7, 2),
    "DT_UINT32": (8, 4),
    "DT_INT64": (9, 8),
    "DT_UINT64": (10, 8),
    "DT_DOUBLE": (11, 8),
    "DT_BOOL": (12, 1),
    "DT_STRING": (13, None),
    "DT_BF16": (27, 2),
}


def test_data_type_values_and_itemsize():
    assert {m.name for m in DataType} == set(EXPECTED_DT)
    assert not issubclass(DataType, int)
    for name, (value, size) in EXPECTED_DT.items():
        member = DataType[name]
        assert member.value == value
        assert DataType(value) is member
        assert str(member) == f"DataType.{name}"
        if size is not None:
            assert itemsize(member) == size


def test_itemsize_errors():
    with pytest.raises(LLMException) as ei:
        itemsize(DataType.DT_STRING)
    assert ei.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    assert "not computable" in str(ei.value)
    with pytest.raises(TypeError):
        itemsize(1)  # type: ignore[arg-type]


def test_numpy_maps():
    np = pytest.importorskip("numpy")
    from internals import data_type_module as data_type

    assert data_type.dtype_to_np_dtype[DataType.DT_BF16] is np.float16
    assert data_type.dtype_to_np_dtype[DataType.DT_FLOAT] is np.float32
    assert data_type.np_dtype_to_dtype[np.dtype(np.float16)] is DataType.DT_FLOAT16
    assert data_type.np_dtype_to_dtype[np.dtype(np.int64)] is DataType.DT_INT64
    assert np.float16 in data_type.valid_np_dtypes
    assert len(data_type.valid_np_dtypes) == len(DataType)
    for dt, np_t in data_type.dtype_to_np_dtype.items():
        if dt is not DataType.DT_STRING:
            assert np.dtype(np_t).itemsize == itemsize(dt)
    with pytest.raises(AttributeError):
        data_type.no_such_name  # noqa: B018


def test_import_does_not_pull_numpy():
    env = dict(os.environ)
    env["PYTHONPATH"] = _PYTHON_DIR + os.pathsep + env.get("PYTHONPATH", "")
    if fresh_import.run(fresh_import.pdlink_imports_numpy, env) is True:
        pytest.skip("the pdlink package itself imports numpy")
    assert fresh_import.run(fresh_import.light_modules_import_numpy, env) is False
