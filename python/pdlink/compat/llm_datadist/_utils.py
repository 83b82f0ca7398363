"""Argument validation helpers shared by the pure-Python layer (llm_datadist_api.md §3.2).

Error conventions:

* wrong Python type (or wrong element type in a list/dict) -> ``TypeError``
  ``"<name> only support ['int'], but got <class 'str'>."``;
* an int outside its C range -> ``ValueError``
  ``"<name>'s value is out of range,<v> is not a uint64 value."``;
* semantic problems -> ``LLMException(status_code=LLM_PARAM_INVALID)`` through
  ``raise_if_false`` / ``raise_if_true`` (defined in ``pdlink.status``, re-exported here);
* a failed engine call -> ``LLMException`` (exactly that class) with llm_datadist's message,
  ``"<op> failed, error code is <LLMStatusCode.X>, <detail>."``: the call runs in ``raising_as(op)``,
  which turns the engine's error (``pdlink.Engine``'s class and words) into it; ``handle_llm_status``
  raises the same for a return code.

``bool`` is a subclass of ``int`` in Python, but ``True``/``False`` are never accepted
where an ``int`` is required: a bool only matches when ``bool`` itself is among the
accepted types.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from ...status import LLMException, LLMStatusCode, as_llm_exception, code_2_status, raise_if_false, raise_if_true

if TYPE_CHECKING:  # what the module __getattr__ below returns
    from ...constants import INVALID_ID  # noqa: F401

__all__ = [
    "UINT8_MAX",
    "UINT16_MAX",
    "INT32_MIN",
    "INT32_MAX",
    "UINT32_MAX",
    "INT64_MIN",
    "INT64_MAX",
    "UINT64_MAX",
    "INVALID_ID",
    "invalid_id",
    "check_isinstance",
    "check_list_of",
    "check_dict",
    "check_uint8",
    "check_uint16",
    "check_int32",
    "check_uint32",
    "check_int64",
    "check_uint64",
    "check_list_int32",
    "check_list_uint32",
    "check_list_int64",
    "check_list_uint64",
    "check_layer_range",
    "is_valid_id",
    "llm_api",
    "llm_words",
    "llm_exception",
    "llm_failure",
    "handle_llm_status",
    "raising_as",
    "raise_if_false",
    "raise_if_true",
    "LLMException",
    "LLMStatusCode",
]

logger = logging.getLogger("pdlink")

UINT8_MAX = 2**8 - 1
UINT16_MAX = 2**16 - 1
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1  # the top of the uint64 range check_uint64 accepts


@functools.cache
def invalid_id() -> int:
    """The marker for "no id" (default prefix_id, padding req_id): ``pdlink.INVALID_ID``, read
    once, on first use (every CacheKey asks). ``INVALID_ID`` (module attribute) reads it too."""
    from ... import constants

    return constants.INVALID_ID


def __getattr__(name: str) -> Any:
    if name == "INVALID_ID":  # read on first use, so that importing this module does not load the engine
        return invalid_id()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

TypeSpec = type | Sequence[type]
_C = TypeVar("_C", bound=type)


# The engine's advice in pdlink.Engine's words (csrc/), and the same advice in llm_datadist's.
_LLM_WORDS = (
    ("disconnect, then connect again", "call unlink_clusters, then link_clusters again"),
    ("disconnect them first", "call unlink_clusters first"),
    ("disconnect on that side too", "call unlink_clusters on that side too"),
    ("connect on that side too", "call link_clusters on that side too"),
    ("; connect first", "; call link_clusters first"),
    ("close the engine and open a new one", "finalize and init again"),
)


def llm_words(message: str) -> str:
    """An engine message with its advice in llm_datadist's words (``call link_clusters first``)."""
    for native, ours in _LLM_WORDS:
        message = message.replace(native, ours)
    return message


def in_llm_words(error: LLMException) -> LLMException:
    """``error`` as llm_datadist raises it: exactly an ``LLMException`` (``as_llm_exception``),
    whose advice names llm_datadist's calls (``link_clusters``) rather than ``pdlink.Engine``'s."""
    plain = as_llm_exception(error)
    if plain.args and isinstance(plain.args[0], str):
        plain.args = (llm_words(plain.args[0]), *plain.args[1:])
    return plain


def llm_exception(ret: int, func_name: str, info: Any) -> LLMException:
    """The ``LLMException`` (exactly that class) for native return code ``ret``, with llm_datadist's
    message format, ``"<func_name> failed, error code is <LLMStatusCode.NAME>, <info>."``."""
    code = code_2_status(ret)
    return LLMException(f"{func_name} failed, error code is {code!s}, {info}.", status_code=code)


def handle_llm_status(ret: int, func_name: str, info: Any) -> None:
    """Raise ``LLMException`` for a non-zero native return code; do nothing for 0.

    The message is ``"<func_name> failed, error code is <LLMStatusCode.NAME>, <info>."`` and
    ``status_code`` is ``code_2_status(ret)``.
    """
    if int(ret) != int(LLMStatusCode.LLM_SUCCESS):
        raise llm_exception(ret, func_name, info)


def llm_failure(op: str, error: LLMException) -> LLMException:
    """What llm_datadist raises when an engine call made for ``op`` raised ``error`` (``pdlink.Engine``'s,
    any class of its hierarchy, its message the engine's): ``llm_exception(code, op, detail)``, the
    engine's advice in llm_datadist's words (``llm_words``), with ``error``'s traceback. Raise it
    ``from None``. ``raising_as`` is the usual way; hot paths call this from an ``except``."""
    detail = llm_words(str(error.args[0])) if error.args else ""
    return llm_exception(error.status_code, op, detail).with_traceback(error.__traceback__)


class raising_as:  # noqa: N801 - used as a function: ``with raising_as("pull_blocks"):``
    """Runs engine calls as llm_datadist's ``op``: an ``LLMException`` raised inside leaves as
    ``llm_failure(op, error)``. Keeps no state: one may serve any number of threads. Only engine
    calls belong inside: an error llm_datadist raised itself would be wrapped twice."""

    __slots__ = ("op",)

    def __init__(self, op: str) -> None:
        self.op = op

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if isinstance(error, LLMException):
            raise llm_failure(self.op, error) from None


def _plain_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except LLMException as e:
            plain = in_llm_words(e)
            if plain is e:
                raise
            raise plain from None

    return call


def llm_api(cls: _C) -> _C:
    """Class decorator for the llm_datadist classes: every public method and property (and
    ``__init__``) raises what CANN's raises, an ``LLMException`` of exactly that class, never one of
    ``pdlink.Engine``'s subclasses (``InvalidArgument`` is also a ``ValueError``: a connector's
    ``except (TypeError, ValueError)`` before ``except LLMException`` would take the wrong branch)."""
    for name, attr in list(vars(cls).items()):
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(attr, property):
            fget, fset, fdel = (None if f is None else _plain_errors(f) for f in (attr.fget, attr.fset, attr.fdel))
            setattr(cls, name, property(fget, fset, fdel, attr.__doc__))
        elif isinstance(attr, (staticmethod, classmethod)):
            setattr(cls, name, type(attr)(_plain_errors(attr.__func__)))
        elif inspect.isfunction(attr):
            setattr(cls, name, _plain_errors(attr))
    return cls


def _as_type_tuple(types: TypeSpec) -> tuple[type, ...]:
    if isinstance(types, type):
        return (types,)
    return tuple(types)


def _type_names(types: tuple[type, ...]) -> list:
    return [getattr(t, "__name__", str(t)) for t in types]


def _matches(value: Any, types: tuple[type, ...]) -> bool:
    # bool is a subclass of int; True/False must not pass as an int (or as an
    # IntEnum-compatible int). A bool only matches when bool (or object) is listed.
    if isinstance(value, bool) and bool not in types and object not in types:
        return False
    return isinstance(value, types)


def check_isinstance(
    arg_name: str,
    arg_value: Any,
    types: TypeSpec,
    allow_none: bool = True,
    *,
    inner_types: TypeSpec | None = None,
    extra_fmt: str = "",
) -> Any:
    """Check that ``arg_value`` is an instance of one of ``types`` and return it.

    * ``types``: one type or a list/tuple of types.
    * ``allow_none``: when True (default), ``None`` is accepted without further checks.
    * ``inner_types``: when given, every element of ``arg_value`` (an iterable) must be an
      instance of one of these types.
    * ``extra_fmt``: prefix prepended to the error message.

    Raises ``TypeError(f"{extra_fmt}{arg_name} only support {names}, but got {type(arg_value)}.")``
    where ``names`` is the list of accepted type names, e.g. ``['int']``. For a bad element the
    message is ``"{arg_name} inner type only support {names}, but got {type(elem)}."``.
    A ``bool`` never matches ``int`` unless ``bool`` is listed.
    """
    if arg_value is None and allow_none:
        return arg_value
    if type(arg_value) is types and inner_types is None and types is not int:  # hot path: exact type
        return arg_value
    type_tuple = _as_type_tuple(types)
    if not _matches(arg_value, type_tuple):
        raise TypeError(
            f"{extra_fmt}{arg_name} only support {_type_names(type_tuple)}, but got {type(arg_value)}."
        )
    if inner_types is not None:
        inner_tuple = _as_type_tuple(inner_types)
        for elem in arg_value:
            if not _matches(elem, inner_tuple):
                raise TypeError(
                    f"{extra_fmt}{arg_name} inner type only support {_type_names(inner_tuple)}, "
                    f"but got {type(elem)}."
                )
    return arg_value


def check_list_of(
    arg_name: str,
    seq: Any,
    elem_types: TypeSpec,
    seq_types: TypeSpec = (list, tuple),
    allow_none: bool = False,
) -> Any:
    """Check that ``seq`` is one of ``seq_types`` (default list or tuple) whose elements are all
    instances of ``elem_types``; return ``seq``. ``TypeError`` on any mismatch. ``None`` is
    rejected unless ``allow_none``."""
    if elem_types is int and type(seq) in (list, tuple) and seq_types == (list, tuple):
        # Hot path (block lists of up to 100k entries): a C-level scan, no Python call per element.
        if all(type(x) is int for x in seq):
            return seq
    return check_isinstance(arg_name, seq, seq_types, allow_none, inner_types=elem_types)


def check_dict(
    arg_name: str,
    value: Any,
    key_types: TypeSpec,
    value_types: TypeSpec,
    allow_none: bool = False,
) -> Any:
    """Check that ``value`` is a dict whose keys are ``key_types`` and values ``value_types``.

    Raises ``TypeError`` with ``"{arg_name} dict key only support ..."`` or
    ``"{arg_name} dict value only support ..."``. Returns ``value``.
    """
    if value is None and allow_none:
        return value
    check_isinstance(arg_name, value, dict, allow_none=False)
    key_tuple = _as_type_tuple(key_types)
    value_tuple = _as_type_tuple(value_types)
    for k, v in value.items():
        if not _matches(k, key_tuple):
            raise TypeError(
                f"{arg_name} dict key only support {_type_names(key_tuple)}, but got {type(k)}."
            )
        if not _matches(v, value_tuple):
            raise TypeError(
                f"{arg_name} dict value only support {_type_names(value_tuple)}, but got {type(v)}."
            )
    return value


def _check_int_range(arg_name: str, arg_value: Any, low: int, high: int, type_word: str) -> int:
    check_isinstance(arg_name, arg_value, int, allow_none=False)
    if arg_value < low or arg_value > high:
        raise ValueError(f"{arg_name}'s value is out of range,{arg_value} is not a {type_word} value.")
    return arg_value


def check_uint8(arg_name: str, arg_value: Any) -> int:
    """``int`` in [0, 2**8-1]; ``TypeError`` / ``ValueError`` otherwise. Returns the value."""
    return _check_int_range(arg_name, arg_value, 0, UINT8_MAX, "uint8")


def check_uint16(arg_name: str, arg_value: Any) -> int:
    """``int`` in [0, 2**16-1]; ``TypeError`` / ``ValueError`` otherwise. Returns the value."""
    return _check_int_range(arg_name, arg_value, 0, UINT16_MAX, "uint16")


def check_int32(arg_name: str, arg_value: Any) -> int:
    """``int`` in [-2**31, 2**31-1]; ``TypeError`` / ``ValueError`` otherwise. Returns the value."""
    return _check_int_range(arg_name, arg_value, INT32_MIN, INT32_MAX, "int32")


def check_uint32(arg_name: str, arg_value: Any) -> int:
    """``int`` in [0, 2**32-1]; ``TypeError`` / ``ValueError`` otherwise. Returns the value."""
    return _check_int_range(arg_name, arg_value, 0, UINT32_MAX, "uint32")


def check_int64(arg_name: str, arg_value: Any) -> int:
    """``int`` in [-2**63, 2**63-1]; ``TypeError`` / ``ValueError`` otherwise. Returns the value."""
    return _check_int_range(arg_name, arg_value, INT64_MIN, INT64_MAX, "int64")


def check_uint64(arg_name: str, arg_value: Any) -> int:
    """``int`` in [0, 2**64-1]; ``TypeError`` / ``ValueError`` otherwise. Returns the value."""
    return _check_int_range(arg_name, arg_value, 0, UINT64_MAX, "uint64")


def _check_list_range(arg_name: str, seq: Any, checker, allow_none: bool) -> Any:
    if seq is None and allow_none:
        return seq
    check_list_of(arg_name, seq, int)
    for v in seq:
        checker(arg_name, v)
    return seq


def check_list_int32(arg_name: str, seq: Any, allow_none: bool = False) -> Any:
    """list/tuple whose elements are all int32 (``TypeError`` / ``ValueError``). Returns ``seq``."""
    return _check_list_range(arg_name, seq, check_int32, allow_none)


def check_list_uint32(arg_name: str, seq: Any, allow_none: bool = False) -> Any:
    """list/tuple whose elements are all uint32 (``TypeError`` / ``ValueError``). Returns ``seq``."""
    return _check_list_range(arg_name, seq, check_uint32, allow_none)


def check_list_int64(arg_name: str, seq: Any, allow_none: bool = False) -> Any:
    """list/tuple whose elements are all int64 (``TypeError`` / ``ValueError``). Returns ``seq``."""
    return _check_list_range(arg_name, seq, check_int64, allow_none)


def check_list_uint64(arg_name: str, seq: Any, allow_none: bool = False) -> Any:
    """list/tuple whose elements are all uint64 (``TypeError`` / ``ValueError``). Returns ``seq``."""
    return _check_list_range(arg_name, seq, check_uint64, allow_none)


@overload
def check_layer_range(arg_name: str, layer_range: Any, allow_none: Literal[False]) -> range: ...
@overload
def check_layer_range(arg_name: str, layer_range: Any, allow_none: bool = True) -> range | None: ...


def check_layer_range(arg_name: str, layer_range: Any, allow_none: bool = True) -> range | None:
    """Validate a layer range (llm_datadist_api.md §7.8/7.9).

    * ``None`` is accepted when ``allow_none`` (else ``TypeError``); any non-``range`` -> ``TypeError``.
    * ``step`` must be 1 and ``0 <= start < stop`` -> ``LLMException(LLM_PARAM_INVALID)`` otherwise.

    Returns ``layer_range``.
    """
    if layer_range is None and allow_none:
        return None
    check_isinstance(arg_name, layer_range, range, allow_none=False)
    raise_if_false(layer_range.step == 1, f"{arg_name}.step should be 1, but got {layer_range}.")
    raise_if_false(
        0 <= layer_range.start < layer_range.stop,
        f"{arg_name} should satisfy 0 <= start < stop, but got {layer_range}.",
    )
    return layer_range


def is_valid_id(value: Any) -> bool:
    """True when ``value`` is an int in ``[0, 2**64-1)`` (i.e. a real req_id/prefix_id, not the
    ``INVALID_ID`` marker)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < invalid_id()
