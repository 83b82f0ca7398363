"""``pdlink.environment``: the one reader of the ``PDLINK_*`` variables in Python, and
``core/environment.cc`` the one in C++. Every variable the sources name is one of theirs, nothing
else reads the environment for one, each read gives the variable, else its default, an option in
code wins over both, and ``pdlink env`` shows them all."""

from __future__ import annotations

import os
import re

import pytest

from internals import parse_engine_options
from pdlink import EngineOptions, environment
from pdlink.cli import main
from where import REPO

PYTHON = str(REPO / "python" / "pdlink")
NATIVE_READS = {v.name for v in environment.native_variables()}  # the C++ core reads these
# The C++ library's sources (the test programs and the fuzz harness read variables of their own).
LIBRARY = [REPO / "csrc" / d for d in ("core", "engine", "transport", "backends", "bindings")]


def _sources() -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(PYTHON):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                out[os.path.relpath(path, PYTHON)] = open(path, encoding="utf-8").read()
    return out


def test_every_variable_the_sources_name_is_the_modules_or_the_cores():
    names = {v.name for v in environment.VARIABLES}
    assert len(names) == len(environment.VARIABLES)
    named = {m for text in _sources().values() for m in re.findall(r"PDLINK_[A-Z0-9_]+", text)}
    assert named - NATIVE_READS <= names, named - NATIVE_READS - names


def test_only_the_module_reads_a_pdlink_variable():
    read = re.compile(r"(environ(\.get)?|getenv)\(?\[?\s*[\"']PDLINK_")
    readers = sorted(path for path, text in _sources().items() if read.search(text))
    assert readers == [], readers


@pytest.mark.parametrize("variable", environment.VARIABLES, ids=lambda v: v.name)
def test_a_read_is_the_variable_else_its_default(variable):
    assert environment.read(variable, {}) == variable.default
    assert environment.read(variable, {variable.name: ""}) == variable.default
    assert environment.read(variable, {variable.name: "7"}) == "7"


def test_the_named_readers_and_their_defaults():
    assert (environment.transport({}), environment.backend({}), environment.link_secret({})) == ("auto", "auto", None)
    assert (environment.hccl_one_sided({}), environment.ucx_trusted_network({}),
            environment.payload_integrity({})) == ("0", "0", "0")
    assert environment.link_port_base({}) == "26800"
    assert environment.limit("max_links", {"PDLINK_MAX_LINKS": "9"}) == "9"
    assert environment.limit("max_links", {}) is None


def test_option_over_variable_over_default(monkeypatch):
    monkeypatch.setenv("PDLINK_TRANSPORT", "tcp")
    monkeypatch.setenv("PDLINK_HCCL_ONE_SIDED", "1")
    monkeypatch.delenv("PDLINK_BACKEND", raising=False)
    resolved = EngineOptions(cluster_id=1).resolved()
    assert (resolved.transport, resolved.hccl_one_sided, resolved.backend) == ("tcp", True, "auto")
    assert EngineOptions(cluster_id=1, transport="cma").resolved().transport == "cma"
    parsed = parse_engine_options({})
    assert parsed["hccl_one_sided"] is True and parsed["backend"] == "auto"
    assert parse_engine_options({"pdlink.HcclOneSided": "0"})["hccl_one_sided"] is False


def _library_sources() -> dict[str, str]:
    return {str(path.relative_to(REPO)): path.read_text(encoding="utf-8")
            for root in LIBRARY for path in sorted(root.rglob("*")) if path.suffix in (".cc", ".h")}


def test_the_core_reads_its_variables_in_one_place():
    reads = {path for path, text in _library_sources().items() if re.search(r"getenv\(\s*\"PDLINK_", text)}
    assert reads == set(), reads
    assert "std::getenv(variable.name)" in (REPO / "csrc" / "core" / "environment.cc").read_text(encoding="utf-8")


def test_every_variable_the_core_names_is_a_variable_pdlink_reads():
    named = {m for text in _library_sources().values()
             for literal in re.findall(r'"[^"\n]*"', text) for m in re.findall(r"PDLINK_[A-Z0-9_]+", literal)}
    assert NATIVE_READS <= named  # each is named in a message where it matters
    assert named <= NATIVE_READS | {v.name for v in environment.VARIABLES}, named


def test_native_variables_keep_an_empty_setting_where_it_means_something():
    auto = {v.name: v for v in environment.native_variables()}["PDLINK_UCX_AUTO_TRANSPORTS"]
    assert auto.empty_is_value and environment.read(auto, {auto.name: ""}) == ""
    assert environment.read(auto, {}) is None  # unset: UCX's RDMA families (docs/ucx.md)
    level = {v.name: v for v in environment.native_variables()}["PDLINK_LOG_LEVEL"]
    assert environment.read(level, {level.name: ""}) == "warn"


def test_pdlink_env_lists_every_variable_hides_the_secret_and_names_a_misspelling(monkeypatch, capsys):
    for name in [n for n in os.environ if n.startswith("PDLINK_")]:  # CI's own (PDLINK_SANITIZER) too
        monkeypatch.delenv(name)
    monkeypatch.setenv("PDLINK_LINK_SECRET", "s3cret-value")
    monkeypatch.setenv("PDLINK_TRANSPORT", "tcp")
    monkeypatch.setenv("PDLINK_TRANSPRT", "cma")
    assert main(["env"]) == 0
    out, err = capsys.readouterr()
    lines = {line.split("=", 1)[0]: line for line in out.splitlines()}
    assert set(lines) == {v.name for v in (*environment.VARIABLES, *environment.native_variables())}
    assert lines["PDLINK_TRANSPORT"].startswith("PDLINK_TRANSPORT='tcp'  [python; default 'auto']")
    assert lines["PDLINK_LOG_LEVEL"].startswith("PDLINK_LOG_LEVEL=unset  [core; default 'warn']")
    assert "s3cret-value" not in out and lines["PDLINK_LINK_SECRET"].startswith("PDLINK_LINK_SECRET=set (not shown)")
    assert err == "pdlink env: PDLINK_TRANSPRT is set, but pdlink reads no variable of that name\n"
