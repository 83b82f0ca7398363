"""``pdlink.environment``: the one reader of the ``PDLINK_*`` variables in Python. Every variable
the Python sources name is one of its variables (or one the C++ core reads), nothing else reads
``os.environ`` for one, and each read gives the variable, else its default, and an option in
code wins over both."""

from __future__ import annotations

import os
import re

import pytest

from internals import parse_engine_options
from pdlink import EngineOptions, environment
from where import REPO

PYTHON = str(REPO / "python" / "pdlink")
NATIVE_READS = {"PDLINK_ASCEND_LIB_DIR", "PDLINK_UCX_LIB_DIR", "PDLINK_LIBCRYPTO"}  # the C++ core reads these


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
