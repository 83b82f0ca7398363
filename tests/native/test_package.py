"""The installed surface: drop-in imports, lazy loading, the CLI, the stubs."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

import fresh_import
from conftest import UCX_WHY_NOT, require_for_ucx

NAMES = ["LLMDataDist", "LLMRole", "LLMConfig", "LlmConfig", "LLMClusterInfo", "LLMStatusCode", "LLMException",
         "Status", "DataType", "Placement", "RegisterMemStatus", "Memtype", "MemInfo", "CacheDesc", "CacheKey",
         "CacheKeyByIdAndIndex", "BlocksCacheKey", "Cache", "KvCache", "LayerSynchronizer", "TransferConfig",
         "TransferWithCacheKeyConfig"]


def test_llm_datadist_drop_in_names_are_pdlinks():
    import llm_datadist
    import pdlink

    for name in NAMES:  # defined in pdlink's compat layer (or its status module), none exported by pdlink
        assert getattr(llm_datadist, name).__module__.startswith(("pdlink.compat.llm_datadist.", "pdlink.status")), name
        assert name in ("LLMStatusCode", "LLMException") or not hasattr(pdlink, name), name
    with pytest.raises(AttributeError, match="from llm_datadist import BlocksCacheKey"):
        pdlink.BlocksCacheKey  # noqa: B018
    assert llm_datadist.LLMConfig is llm_datadist.LlmConfig
    with pytest.raises(AttributeError):
        llm_datadist.NoSuchThing  # noqa: B018
    from llm_datadist.configs import LLMRole
    from llm_datadist.status import LLMException, code_2_status

    assert LLMRole is llm_datadist.LLMRole and LLMException is pdlink.LLMException
    assert code_2_status(0x5010B01A) is pdlink.LLMStatusCode.LLM_TIMEOUT
    assert issubclass(pdlink.LLMException, RuntimeError)


def test_import_is_light_and_sets_uc_memory_default():
    out = fresh_import.run(fresh_import.uc_memory_default)
    assert out == {"AUTO_USE_UC_MEMORY": "0", "numpy": False, "pdlink._core": False}


def _installed_in_site_packages() -> bool:
    import sysconfig

    import pdlink

    here = os.path.realpath(os.path.dirname(pdlink.__file__))
    return any(here.startswith(os.path.realpath(sysconfig.get_paths()[k]) + os.sep) for k in ("purelib", "platlib"))


@pytest.mark.skipif(not _installed_in_site_packages(),
                    reason="an editable install's import hook comes before PYTHONPATH, so no other package can win "
                           "over its drop-ins; a regular install (CI's) is what this checks")
def test_cann_packages_on_pythonpath_win_and_ours_stay_reachable(tmp_path):
    """Where CANN is installed its set_env.sh puts its python/site-packages on PYTHONPATH, ahead of
    the virtualenv's site-packages where pdlink installs its drop-ins: CANN's hixl and llm_datadist
    are imported then, and pdlink's stay reachable as pdlink.compat.* (docs/hixl.md)."""
    cann = tmp_path / "cann-site-packages"
    for name in ("hixl", "llm_datadist"):
        (cann / name).mkdir(parents=True)
        (cann / name / "__init__.py").write_text("# stands in for CANN's package\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(cann), os.environ.get("PYTHONPATH")) if p))
    out = fresh_import.run(fresh_import.which_drop_ins, env)
    assert out["hixl"] == str(cann / "hixl" / "__init__.py")
    assert out["llm_datadist"] == str(cann / "llm_datadist" / "__init__.py")
    assert out["ours"] == "pdlink.compat.hixl.hixl"
    ours = fresh_import.run(fresh_import.which_drop_ins)  # without CANN: pdlink's own
    assert ours["hixl"].endswith(os.path.join("hixl", "__init__.py")) and str(cann) not in ours["hixl"]
    assert "site-packages" in ours["hixl"] and "site-packages" in ours["llm_datadist"]


def test_stub_matches_native_module():
    import pdlink
    from internals import core as _core

    stub = os.path.join(os.path.dirname(pdlink.__file__), "_core.pyi")  # the package's (an editable one's too)
    text = open(stub).read()
    public = [n for n in dir(_core.Engine) if not n.startswith("_")]
    for name in public:
        assert f"def {name}(" in text, f"_core.pyi lacks Engine.{name}"
    assert os.path.exists(os.path.join(os.path.dirname(stub), "py.typed"))


def test_cli_version_and_demo():
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-m", "pdlink", "version"], capture_output=True, text=True, check=True,
                         env=env).stdout
    assert out.startswith("pdlink ")
    r = subprocess.run([sys.executable, "-m", "pdlink", "demo", "--size-mib", "2", "--block-kib", "16",
                        "--repeat", "1"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verified byte for byte" in r.stdout and "switched role to LLMRole.PROMPT" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "pdlink", "demo", "--repeat", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--repeat must be > 0" in bad.stderr


def _version_line(prefix: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-m", "pdlink", "version"], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}).stdout
    (line,) = [x for x in out.splitlines() if x.startswith(prefix)]
    return line


def _ucx_line(**env: str) -> str:
    return _version_line("ucx: ", **env)


def test_version_names_the_ucx_network_transports_and_what_auto_picks_between_hosts():
    """With UCX loaded: the lanes of a network worker under this environment's UCX_TLS (tcp here,
    never shared memory), and whether auto picks ucx between hosts: not over tcp alone by default,
    yes once PDLINK_UCX_AUTO_TRANSPORTS lists tcp."""
    require_for_ucx(UCX_WHY_NOT)
    lanes = _version_line("ucx network transports: ", UCX_TLS="tcp").split(": ", 1)[1].split(", ")
    assert lanes and all(lane.startswith("tcp/") for lane in lanes), lanes
    assert _version_line("auto between hosts: ", UCX_TLS="tcp") == (
        "auto between hosts: tcp (no RDMA transport among these; docs/ucx.md)")
    assert _version_line("auto between hosts: ", UCX_TLS="tcp", PDLINK_UCX_AUTO_TRANSPORTS="tcp") == (
        "auto between hosts: ucx (with ucx_trusted_network)")


def test_version_says_where_ucx_came_from_or_why_not(tmp_path):
    import importlib.util

    line = _ucx_line()
    wheel = importlib.util.find_spec("libucx")
    if wheel is not None and wheel.origin:  # pdlink[ucx]: found in the wheel, without importing it
        assert "loaded from " + os.path.join(os.path.dirname(wheel.origin), "lib") in line, line
    else:
        assert "unavailable" in line and 'pip install "pdlink[ucx]"' in line, line
    # an explicit directory without libucp: no fallback, and the message names the variable
    line = _ucx_line(PDLINK_UCX_LIB_DIR=str(tmp_path))
    assert f"unavailable: ucx unavailable: PDLINK_UCX_LIB_DIR={tmp_path} has no libucp.so.0" in line, line


def test_public_methods_have_docstrings():
    from llm_datadist import CacheManager, LLMDataDist

    for cls in (CacheManager, LLMDataDist):
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if not name.startswith("_"):
                assert fn.__doc__, f"{cls.__name__}.{name} has no docstring"


def test_module_surface_submodules_and_lazy_names():
    assert fresh_import.run(fresh_import.module_surface) == "ok"
