"""vllm-ascend's LLMDataDistCMgrConnector, its own source unchanged, for the connector tests.

The connector (``vllm_ascend/distributed/llmdatadist_c_mgr_connector.py``) was retired upstream in
December 2025 (vllm-ascend #4780); its last release on PyPI is vllm-ascend 0.11.0. ``source_path()``
takes that wheel (``pip download``; or the file ``PDLINK_VLLM_ASCEND_WHEEL`` names), extracts three
files of it (the package's ``__init__.py``, ``envs.py`` and the connector) into a cache folder,
beside the stand-ins of ``connector_shims/`` for what they import and cannot run here (vLLM,
torch_npu), and returns the folders to put first on ``sys.path``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.11.0"
CONNECTOR = "vllm_ascend/distributed/llmdatadist_c_mgr_connector.py"
TAKEN = ("vllm_ascend/__init__.py", "vllm_ascend/envs.py", CONNECTOR)  # from the wheel, unchanged
SHIMS = Path(__file__).resolve().parent / "connector_shims"
NEEDS = ("torch", "msgspec", "zmq")  # what the connector imports and is installed for real


def missing_modules() -> list[str]:
    """The connector's real dependencies that are not installed."""
    import importlib.util

    return [m for m in NEEDS if importlib.util.find_spec(m) is None]


def _cache() -> Path:
    base = os.environ.get("PDLINK_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pdlink-tests")
    return Path(base) / f"vllm-ascend-{VERSION}"


def _wheel(into: Path) -> Path:
    given = os.environ.get("PDLINK_VLLM_ASCEND_WHEEL")
    if given:
        return Path(given)
    found = sorted(into.glob("vllm_ascend-*.whl"))
    if found:
        return found[0]
    # Any CPython build of the wheel holds the same .py files: name one so that pip needs no
    # compatible interpreter and builds nothing.
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                    "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
                    "--platform", "manylinux_2_24_x86_64", "-d", str(into), f"vllm-ascend=={VERSION}"],
                   check=True, timeout=300)
    (wheel,) = into.glob("vllm_ascend-*.whl")
    return wheel


def source_path() -> list[str]:
    """Folders that make ``import vllm_ascend.distributed.llmdatadist_c_mgr_connector`` load
    vllm-ascend's own connector on pdlink (``sys.path`` entries, first to last)."""
    cache = _cache()
    tree = cache / "tree"
    if not (tree / CONNECTOR).is_file():
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cache))
        with zipfile.ZipFile(_wheel(cache)) as z:
            for name in TAKEN:
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
                (staging / name).write_bytes(z.read(name))
        for shim in (SHIMS / "vllm_ascend").rglob("*.py"):
            target = staging / "vllm_ascend" / shim.relative_to(SHIMS / "vllm_ascend")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shim, target)
        shutil.rmtree(tree, ignore_errors=True)
        staging.rename(tree)  # whole or not at all: a concurrent run sees either
    return [str(tree), str(SHIMS)]
