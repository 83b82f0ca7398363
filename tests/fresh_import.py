"""Import checks in a fresh interpreter: ``python -m fresh_import CHECK`` runs one check and prints
its result as one JSON line (a failed assertion exits non-zero with its traceback on stderr).

What an import loads is only exact in an interpreter that has imported nothing else, so these run
as ``python -m`` (``run``), not in a peer: a spawned peer has already imported multiprocessing,
pickle, socket, the peer machinery (and pytest, under the ``pytest`` script) before its first call,
and takes its ``sys.path`` from the test process rather than from ``PYTHONPATH``. This module
imports only ``sys`` and ``os`` at the top (what ``python -c "import sys, os; ..."`` had); each
check imports what it tests, in the order the checks always have, and ``json`` is imported after the
check, to print its result.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing is more than the checks had
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def uc_memory_default() -> dict[str, Any]:
    """Imports llm_datadist and pdlink with AUTO_USE_UC_MEMORY unset: the default they set, and
    whether numpy or the native module got imported."""
    os.environ.pop("AUTO_USE_UC_MEMORY", None)
    import llm_datadist  # noqa: F401
    import pdlink  # noqa: F401

    return {"AUTO_USE_UC_MEMORY": os.environ["AUTO_USE_UC_MEMORY"], "numpy": "numpy" in sys.modules,
            "pdlink._core": "pdlink._core" in sys.modules}


def module_surface() -> str:
    """The llm_datadist module surface: lazy submodules, lazy names, the v2 and status modules;
    "ok", or an AssertionError."""
    import llm_datadist

    compat = "pdlink.compat.llm_datadist."
    assert compat + "kv_cache_manager" not in sys.modules and compat + "tensor" not in sys.modules
    from llm_datadist import KvCacheManager, TensorDesc, Tensor, CacheTask  # noqa: F401, I001 - in this order
    from pdlink.compat.llm_datadist import kv_cache_manager, tensor, transfer

    assert KvCacheManager is kv_cache_manager.KvCacheManager and TensorDesc is tensor.TensorDesc
    assert CacheTask is transfer.CacheTask
    from llm_datadist.v2.llm_types import RegisterMemStatus, Cache, Memtype, MemInfo  # noqa: F401, I001
    from llm_datadist.v2.cache_manager import CacheManager  # noqa: F401
    from llm_datadist.v2.llm_datadist import LLMDataDist  # noqa: F401
    from llm_datadist import v2_list

    assert "LLMDataDist" in v2_list and all(hasattr(llm_datadist, n) for n in v2_list)
    from llm_datadist.status import LLMStatusCode, LLMException, Status, code_2_status, handle_llm_status  # noqa: I001
    from llm_datadist.status import raise_if_false, raise_if_true  # noqa: F401
    from llm_datadist.configs import LLMRole, LLMClusterInfo, LlmConfig  # noqa: F401
    from llm_datadist.data_type import DataType  # noqa: F401

    assert code_2_status(12345) is LLMStatusCode.LLM_FAILED
    assert Status(LLMStatusCode.LLM_SUCCESS).is_ok() and not Status(LLMStatusCode.LLM_TIMEOUT).is_ok()
    try:
        handle_llm_status(int(LLMStatusCode.LLM_TIMEOUT), "pull_cache", "slow peer")
    except LLMException as e:
        assert e.status_code is LLMStatusCode.LLM_TIMEOUT and str(e).startswith("pull_cache failed")
    else:
        raise AssertionError("handle_llm_status did not raise")
    try:
        llm_datadist.Nope  # noqa: B018
    except AttributeError:
        pass
    else:
        raise AssertionError("unknown attribute did not raise")
    return "ok"


def pdlink_imports_numpy() -> bool:
    """Whether ``import pdlink`` imports numpy."""
    import pdlink  # noqa: F401

    return "numpy" in sys.modules


def light_modules_import_numpy() -> bool:
    """Whether the modules that must not need numpy (status, _utils, data_type, configs,
    llm_types), and a star-import of data_type, import it."""
    import pdlink.status  # noqa: I001 - in the order the check always had
    import pdlink.compat.llm_datadist._utils
    import pdlink.compat.llm_datadist.data_type
    import pdlink.compat.llm_datadist.configs
    import pdlink.compat.llm_datadist.llm_types  # noqa: F401
    import star_import_data_type  # noqa: F401 - `from pdlink.compat.llm_datadist.data_type import *`

    return "numpy" in sys.modules


HEAVY_SERVER_MODULES = ("starlette", "uvicorn", "prometheus_client", "anyio", "h11")


def server_modules_stay_light() -> list[str]:
    """Imports pdlink, its client, CLI, and the server's config, validation and tls modules; the
    server dependencies that got imported (none should)."""
    import pdlink  # noqa: I001 - in the order the check always had
    import pdlink.client
    import pdlink.cli
    import pdlink.server
    import pdlink.server.config
    import pdlink.server.validation
    import pdlink.server.tls  # noqa: F401

    return [m for m in HEAVY_SERVER_MODULES if m in sys.modules]


def which_drop_ins() -> dict[str, Any]:
    """Where ``import hixl`` and ``import llm_datadist`` come from, and whether pdlink's own hixl is
    still reachable by its full name."""
    import hixl
    import llm_datadist
    import pdlink.compat.hixl as ours

    return {"hixl": hixl.__file__, "llm_datadist": llm_datadist.__file__, "ours": ours.Hixl.__module__}


CHECKS: dict[str, Callable[[], Any]] = {f.__name__: f for f in (
    uc_memory_default, module_surface, pdlink_imports_numpy, light_modules_import_numpy, server_modules_stay_light,
    which_drop_ins)}

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def run(check: Callable[[], Any], env: dict[str, str] | None = None, timeout: float = 30.0) -> Any:
    """Runs ``check`` (one of ``CHECKS``) in a fresh ``python -m fresh_import`` and returns its result;
    an AssertionError with the child's stderr if it fails. ``env``: the child's environment (this
    process's by default); this directory is appended to its PYTHONPATH so ``-m`` finds the module."""
    import json
    import subprocess

    full = dict(os.environ if env is None else env)
    full["PYTHONPATH"] = os.pathsep.join(p for p in (full.get("PYTHONPATH", ""), _TESTS_DIR) if p)
    res = subprocess.run([sys.executable, "-m", "fresh_import", check.__name__], capture_output=True, text=True,
                         env=full, timeout=timeout)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    result = CHECKS[argv[0]]()
    import json

    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
