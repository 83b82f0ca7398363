"""``DataType`` enum (llm_datadist_api.md §2.3), element sizes, and lazy numpy compatibility maps.

Importing this module does not import numpy. The compatibility names
``dtype_to_np_dtype``, ``np_dtype_to_dtype`` and ``valid_np_dtypes`` are built on first
access through the module-level ``__getattr__`` (numpy is imported at that point).
As in the reference package, ``DT_BF16`` maps to ``np.float16`` in ``dtype_to_np_dtype``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from ...status import LLMException, LLMStatusCode

# The lazy numpy maps are deliberately not in __all__, so that a star-import does not
# import numpy.
__all__ = ["DataType", "itemsize"]


class DataType(Enum):
    """Tensor element types; values are the ``ge::DataType`` integers."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_STRING = 13
    DT_BF16 = 27


# [INF] Bytes per element for a CPU implementation (llm_datadist_api.md §2.3). DT_STRING has no fixed size.
_ITEMSIZE: dict[DataType, int] = {
    DataType.DT_FLOAT: 4,
    DataType.DT_FLOAT16: 2,
    DataType.DT_INT8: 1,
    DataType.DT_INT32: 4,
    DataType.DT_UINT8: 1,
    DataType.DT_INT16: 2,
    DataType.DT_UINT16: 2,
    DataType.DT_UINT32: 4,
    DataType.DT_INT64: 8,
    DataType.DT_UINT64: 8,
    DataType.DT_DOUBLE: 8,
    DataType.DT_BOOL: 1,
    DataType.DT_BF16: 2,
}


def itemsize(dt: DataType) -> int:
    """Bytes per element of ``dt``.

    Raises ``TypeError`` if ``dt`` is not a ``DataType`` and
    ``LLMException(LLM_PARAM_INVALID)`` for ``DT_STRING`` (size not computable).
    """
    if not isinstance(dt, DataType):
        raise TypeError(f"dt only support ['DataType'], but got {type(dt)}.")
    size = _ITEMSIZE.get(dt)
    if size is None:
        raise LLMException(
            f"element size of {dt} is not computable.", status_code=LLMStatusCode.LLM_PARAM_INVALID
        )
    return size


_LAZY_NAMES = ("dtype_to_np_dtype", "np_dtype_to_dtype", "valid_np_dtypes")


def _build_numpy_maps() -> None:
    import numpy as np  # deferred on purpose: importing pdlink must not import numpy

    to_np = {
        DataType.DT_FLOAT: np.float32,
        DataType.DT_FLOAT16: np.float16,
        DataType.DT_BF16: np.float16,  # numpy has no bfloat16; kept as in the reference maps
        DataType.DT_INT8: np.int8,
        DataType.DT_INT16: np.int16,
        DataType.DT_UINT16: np.uint16,
        DataType.DT_UINT8: np.uint8,
        DataType.DT_INT32: np.int32,
        DataType.DT_INT64: np.int64,
        DataType.DT_UINT32: np.uint32,
        DataType.DT_UINT64: np.uint64,
        DataType.DT_BOOL: np.bool_,
        DataType.DT_DOUBLE: np.float64,
        DataType.DT_STRING: np.bytes_,
    }
    # Reverse map keyed by np.dtype; float16 maps back to DT_FLOAT16 (not BF16).
    from_np = {}
    for dt, np_type in to_np.items():
        if dt is DataType.DT_BF16:
            continue
        from_np[np.dtype(np_type)] = dt
    globals()["dtype_to_np_dtype"] = to_np
    globals()["np_dtype_to_dtype"] = from_np
    globals()["valid_np_dtypes"] = list(to_np.values())


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        _build_numpy_maps()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
