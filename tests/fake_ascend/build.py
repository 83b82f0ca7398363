"""Build the fake Ascend vendor libraries (libascendcl.so, libhccl.so) for tests.

``build(variant)`` compiles tests/fake_ascend/*.cc with the system C++ compiler (no cmake) into
``<repo>/build/fake-ascend/<variant>-<hash>/`` and returns that directory. The hash covers the
sources, the headers, the variant, the compiler and the flags, so an edit rebuilds and an unchanged
tree re-uses the previous build. Builds go to a temporary directory that is renamed into place,
under an fcntl lock, so several pytest processes may call ``build`` at once.

Variants:
  "full"         everything.
  "broken"       without the required ACL symbol aclrtMemcpyAsync (FAKE_OMIT_REQUIRED) and the
                 optional aclrtIpcMemGetExportKey (FAKE_OMIT_OPTIONAL), for the loader's error paths.
  "no_optional"  without aclrtIpcMemGetExportKey only: a loadable runtime with one feature off.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
SOURCES = [HERE / "fake_acl.cc", HERE / "fake_hccl.cc"]
HEADERS = [HERE / "fake_control.h", HERE / "fake_internal.h", REPO / "csrc" / "backends" / "ascend" / "ascend_min.h"]
FLAGS = ["-std=c++17", "-O1", "-g", "-fPIC", "-shared", "-pthread", "-Wall", "-Werror", "-fvisibility=hidden"]
VARIANTS = {
    "full": [],
    "broken": ["-DFAKE_OMIT_REQUIRED", "-DFAKE_OMIT_OPTIONAL"],
    "no_optional": ["-DFAKE_OMIT_OPTIONAL"],
}
# Only the vendor names and the control API leave the libraries; C++ template instances that
# -fvisibility=hidden cannot hide (std:: has default visibility) are made local here.
VERSION_SCRIPT = "{ global: acl*; Hccl*; fake_ascend_*; fake_acl_*; local: *; };\n"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set $CXX)")
    return cxx


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"fake Ascend build failed: {' '.join(cmd)}\n{res.stdout}{res.stderr}")


def build(variant: str = "full") -> pathlib.Path:
    """Returns the directory holding libascendcl.so and libhccl.so of `variant`, building if needed.

    ``$FAKE_ASCEND_CXXFLAGS`` adds compiler flags: the sanitizer runs (.ci/sanitizers.sh) build the
    fakes with the same sanitizer as pdlink, so that it sees the fakes' threads and locks too.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {sorted(VARIANTS)}")
    cxx = _compiler()
    flags = FLAGS + VARIANTS[variant] + os.environ.get("FAKE_ASCEND_CXXFLAGS", "").split()
    h = hashlib.sha256()
    for part in [variant, cxx, *flags, VERSION_SCRIPT]:
        h.update(part.encode() + b"\0")
    for f in SOURCES + HEADERS:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    out = REPO / "build" / "fake-ascend" / f"{variant}-{h.hexdigest()[:16]}"
    if (out / "libhccl.so").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "libhccl.so").is_file():  # another process built it while we waited
            return out
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{variant}-", dir=out.parent))
        try:
            _compile(cxx, flags, tmp)
            tmp.chmod(0o755)  # mkdtemp made it private
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def _compile(cxx: str, flags: list[str], tmp: pathlib.Path) -> None:
    (tmp / "exports.map").write_text(VERSION_SCRIPT)
    common = [cxx, *flags, f"-I{REPO / 'csrc'}", f"-Wl,--version-script={tmp / 'exports.map'}"]
    acl = common + [str(HERE / "fake_acl.cc"), "-o", str(tmp / "libascendcl.so"), "-Wl,-soname,libascendcl.so"]
    # The HCCL object compiles while the ACL library builds; only its link needs libascendcl.so.
    hccl_obj = [cxx, *[f for f in flags if f != "-shared"], f"-I{REPO / 'csrc'}", "-c",
                str(HERE / "fake_hccl.cc"), "-o", str(tmp / "fake_hccl.o")]
    with ThreadPoolExecutor(2) as pool:
        for fut in [pool.submit(_run, acl), pool.submit(_run, hccl_obj)]:
            fut.result()
    # $ORIGIN: libhccl.so finds the libascendcl.so next to it, whatever directory the test uses.
    _run(common + [str(tmp / "fake_hccl.o"), "-o", str(tmp / "libhccl.so"), "-Wl,-soname,libhccl.so",
                   f"-L{tmp}", "-lascendcl", "-Wl,-rpath,$ORIGIN"])
    (tmp / "fake_hccl.o").unlink()


def exported_symbols(path: str | os.PathLike) -> set[str]:
    """Names of the functions and data a shared library defines in its dynamic symbol table."""
    res = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    names = set()
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            names.add(parts[2].split("@")[0])
    return names


if __name__ == "__main__":
    import sys

    for v in sys.argv[1:] or ["full"]:
        print(build(v))
