"""Deprecated v1 ``TensorDesc`` / ``Tensor`` (llm_datadist_api.md §7.12).

``KvCacheManager.get_cache_tensors`` returns ``Tensor`` objects that **view** the memory of a
live KV cache: ``numpy()`` gives an array over the cache bytes, so writes through it land in
the cache and a later pull is visible through it. Users may also wrap their own numpy arrays.

numpy is imported inside the functions that need it, so importing this module stays light.

Differences from llm_datadist (documented in docs/compatibility.md):
  * string tensors (``DT_STRING``) are not supported (``RuntimeError``);
  * ``Tensor(int)`` (a native tensor handle) is not accepted (``TypeError``): pdlink has no
    native tensor objects;
  * ``Tensor(other_tensor)`` makes an independent copy of the other tensor's bytes (a clone).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...status import LLMException, LLMStatusCode
from ._utils import check_isinstance, check_list_of, llm_api, raising_as
from .data_type import DataType, itemsize

if TYPE_CHECKING:
    from ...engine import Engine

__all__ = ["TensorDesc", "Tensor"]


def _storage_dtype(dt: DataType) -> Any:
    """numpy dtype holding the raw elements of ``dt`` (BF16 is kept as its uint16 bit pattern)."""
    import numpy as np

    if dt is DataType.DT_BF16:
        return np.dtype(np.uint16)
    from . import data_type

    return np.dtype(data_type.dtype_to_np_dtype[dt])


class TensorDesc:
    """Element type and shape of a ``Tensor``.

    ``dtype`` must be a ``DataType`` and ``shape`` a list or tuple of ints (``TypeError``
    otherwise). ``shape`` is stored as a new list.
    """

    def __init__(self, dtype: DataType, shape: list[int] | tuple[int, ...]) -> None:
        check_isinstance("dtype", dtype, DataType, allow_none=False)
        check_list_of("shape", shape, int)
        self._dtype = dtype
        self._shape = list(shape)

    @property
    def dtype(self) -> DataType:
        """Element type."""
        return self._dtype

    @property
    def shape(self) -> list[int]:
        """Dimensions."""
        return self._shape

    def __str__(self) -> str:
        return f"TensorDesc(dtype={self._dtype}, shape={self._shape})"

    __repr__ = __str__


@llm_api
class Tensor:
    """A tensor over a numpy array or over KV-cache memory (deprecated v1 API, llm_datadist_api.md §7.12).

    ``Tensor(data, tensor_desc=None)``:
      * ``data``: a C-contiguous ``numpy.ndarray`` (kept, not copied) or another ``Tensor``
        (its bytes are copied); anything else is a ``TypeError``;
      * ``tensor_desc``: optional ``TensorDesc``; when given, the array's shape and dtype must
        match it (``RuntimeError`` otherwise, as in llm_datadist).

    Tensors from ``get_cache_tensors`` keep their cache handle alive (so it is not
    auto-deallocated while a view exists); once the cache is deallocated explicitly (or its
    ``LLMDataDist`` finalized), ``numpy()`` raises ``LLMException(LLM_PARAM_INVALID)``. An array
    obtained earlier with ``copy=False`` must not be used after that: its memory is gone.
    """

    _tensor_desc: TensorDesc
    _array: Any  # a numpy.ndarray, or None for a view of cache memory

    def __init__(self, data: Any, tensor_desc: TensorDesc | None = None) -> None:
        import numpy as np

        check_isinstance("data", data, [np.ndarray, Tensor], allow_none=False)
        check_isinstance("tensor_desc", tensor_desc, TensorDesc)
        self._array = None
        self._addr = 0
        self._owner: Any = None
        self._device_engine: Engine | None = None
        if isinstance(data, Tensor):
            self._tensor_desc = TensorDesc(data._tensor_desc.dtype, data._tensor_desc.shape)
            self._array = data._raw().copy()
            return
        self._init_by_ndarray(data, tensor_desc)

    def _init_by_ndarray(self, data: Any, tensor_desc: TensorDesc | None) -> None:
        import numpy as np

        from . import data_type

        if np.issubdtype(data.dtype, np.str_) or np.issubdtype(data.dtype, np.bytes_):
            raise RuntimeError("string tensors are not supported by pdlink")
        if tensor_desc is not None:
            if list(data.shape) != tensor_desc.shape:
                raise RuntimeError(f"The shape of data:{data.shape} is not same as tensor_desc shape:"
                                   f"{tensor_desc.shape}")
            if tensor_desc.dtype is DataType.DT_STRING:
                raise RuntimeError("string tensors are not supported by pdlink")
            expected = np.dtype(data_type.dtype_to_np_dtype[tensor_desc.dtype])
            if data.dtype != expected:
                raise RuntimeError(f"The dtype of data:{data.dtype} is not same as tensor_desc dtype:"
                                   f"{tensor_desc.dtype}")
            desc = tensor_desc
        else:
            dt = data_type.np_dtype_to_dtype.get(data.dtype)
            if dt is None or dt is DataType.DT_STRING:
                raise RuntimeError(f"The dtype of data:{data.dtype} is not valid, "
                                   f"only support {data_type.valid_np_dtypes}")
            desc = TensorDesc(dt, list(data.shape))
        if not data.flags.c_contiguous:
            raise RuntimeError("The data is not c_contiguous")
        self._tensor_desc = desc
        self._array = data

    @classmethod
    def _view(cls, addr: int, desc: TensorDesc, owner: Any, device_engine: Engine | None = None) -> Tensor:
        """Internal: a tensor over ``prod(shape) * itemsize`` bytes at ``addr``, valid while
        ``owner`` (a KvCache) is. ``device_engine``: the engine whose backend holds ``addr`` when
        it is device memory the host cannot address (Ascend); the data is then read through it,
        as a copy."""
        t = cls.__new__(cls)
        t._array = None
        t._addr = addr
        t._owner = owner
        t._tensor_desc = desc
        t._device_engine = device_engine
        return t

    @property
    def tensor_desc(self) -> TensorDesc:
        """Element type and shape (pdlink extension; llm_datadist keeps it private)."""
        return self._tensor_desc

    def _raw(self) -> Any:
        """The elements in their storage dtype (a view, never a copy; a copy for device memory)."""
        import ctypes

        import numpy as np

        desc = self._tensor_desc
        storage = _storage_dtype(desc.dtype)
        if self._array is not None:
            return self._array.view(storage)
        owner = self._owner
        manager = getattr(owner, "_manager", None)
        if not getattr(owner, "_valid", False) or manager is None or not manager.is_initialized():
            raise LLMException("Tensor.numpy failed: the cache behind this tensor was deallocated "
                               "(or its LLMDataDist finalized)", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        count = 1
        for dim in desc.shape:
            count *= dim
        nbytes = count * itemsize(desc.dtype)
        if self._device_engine is not None:
            host = np.empty(nbytes, dtype=np.uint8)
            with raising_as("copy"):  # device -> host
                self._device_engine.copy(host.ctypes.data, self._addr, nbytes, src_placement="DEVICE")
            return host.view(storage).reshape(desc.shape)
        buf = (ctypes.c_uint8 * nbytes).from_address(self._addr)
        # ctypes arrays export the buffer protocol; numpy's stubs only list concrete buffer types
        return np.frombuffer(buf, dtype=storage).reshape(desc.shape)  # type: ignore[call-overload]

    def numpy(self, copy: bool = False) -> Any:
        """The data as a numpy array: a view of the memory unless ``copy=True``.

        ``DT_BF16`` data is returned as a new float32 array (numpy has no bfloat16), as in
        llm_datadist.
        """
        import numpy as np

        check_isinstance("copy", copy, bool)
        raw = self._raw()
        if self._tensor_desc.dtype is DataType.DT_BF16:
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.copy() if copy else raw

    def __str__(self) -> str:
        try:
            data = self.numpy(copy=True)
        except LLMException:
            data = "<deallocated>"
        return f"Tensor({data},tensor_desc={self._tensor_desc})"
