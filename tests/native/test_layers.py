"""The layers on ``pdlink.Engine`` (the llm_datadist and hixl drop-ins, the REST server) call only
pdlink's public objects: ``pdlink.Engine``, what it returns (``Engine.kv`` and its objects), the
public modules and names of ``pdlink``. None reaches the native module, ``pdlink._core``, or the
raw helpers of ``pdlink.native`` (docs/architecture.md); this reads their source and says where
one does."""

from __future__ import annotations

import ast
import os
import re

import pytest

import pdlink

PACKAGE = os.path.dirname(pdlink.__file__)
LAYERS = ("compat", "server")
# Modules a layer may not import, and names (attributes, variables) it may not use: the native
# module, its loader's raw helpers, and the native engine under a pdlink object.
FORBIDDEN_MODULES = ("pdlink._core", "pdlink.native")
FORBIDDEN_NAMES = frozenset({"_core", "core", "_native", "native_core", "open_engine", "role_of", "transport_of",
                             "placement_of", "transport_names", "backend_names"})


def _layer_modules() -> list[tuple[str, str]]:
    out = []
    for layer in LAYERS:
        for root, _, files in os.walk(os.path.join(PACKAGE, layer)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                    out.append((rel.removesuffix(".__init__"), path))
    return sorted(out)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _forbidden_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in FORBIDDEN_MODULES)


def reaches_below(module: str, path: str) -> list[str]:
    """Where the module at ``path`` (named ``module``) reaches the native module: ``line: what``."""
    tree = ast.parse(open(path).read(), path)
    is_package = path.endswith("__init__.py")
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if _forbidden_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node)
            for a in node.names:
                if _forbidden_module(source) or _forbidden_module(f"{source}.{a.name}") or a.name in FORBIDDEN_NAMES:
                    found.append(f"{line}: from {source} import {a.name}")
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_NAMES:
            found.append(f"{line}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            found.append(f"{line}: {node.id}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _forbidden_module(node.value):
            found.append(f"{line}: {node.value!r}")
    return found


MODULES = _layer_modules()


def test_every_layer_module_is_checked() -> None:
    names = {m for m, _ in MODULES}
    for expected in ("pdlink.compat.llm_datadist.cache_manager", "pdlink.compat.llm_datadist.llm_datadist",
                     "pdlink.compat.llm_datadist.comm", "pdlink.compat.llm_datadist._utils",
                     "pdlink.compat.hixl.hixl", "pdlink.server.node", "pdlink.server.app", "pdlink.server.config",
                     "pdlink.server.validation"):
        assert expected in names, expected


@pytest.mark.parametrize("module,path", MODULES, ids=[m for m, _ in MODULES])
def test_layer_reaches_only_pdlinks_public_objects(module: str, path: str) -> None:
    assert reaches_below(module, path) == [], f"{module} reaches below pdlink.Engine"


def test_the_check_sees_each_way_of_reaching_the_native_module(tmp_path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from ...native import core\nfrom ... import _core\nimport pdlink._core\n"
                   "x = engine._native.links()\ny = engine.kv._native\nimportlib.import_module('pdlink._core')\n"
                   "from pdlink.native import transport_names\n")
    found = reaches_below("pdlink.compat.llm_datadist.bad", str(bad))
    assert [f.split(":")[0] for f in found].count("1") >= 1
    for line in ("2", "3", "4", "5", "6", "7"):
        assert any(f.startswith(line + ":") for f in found), (line, found)


def test_engine_reports_are_the_engines_own_typed_records() -> None:
    """``links()``, ``stats()`` and ``kv.pools()`` pass the engine's records through: a link is the
    bound ``pdlink.LinkInfo`` (read-only, by value, pickles), stats and pools keep their dict form,
    filled from the typed ``EngineStats`` and ``PoolInfo``."""
    import pickle

    from internals import core, native_engine

    options = pdlink.EngineOptions(cluster_id=1, listen="127.0.0.1:0", host_pool=pdlink.MemoryPool(1 << 20))
    with pdlink.Engine(options) as target, pdlink.Engine(pdlink.EngineOptions(cluster_id=2)) as dialler:
        assert dialler.connect(f"127.0.0.1:{target.listen_port}") == 1
        (link,) = dialler.links()
        assert type(link) is pdlink.LinkInfo is core.LinkInfo
        assert (link.peer_cluster_id, link.initiator, link.broken) == (1, True, False)
        assert isinstance(link.device_paths, tuple) and isinstance(link.lanes, tuple)
        assert pickle.loads(pickle.dumps(link)) == link and hash(pickle.loads(pickle.dumps(link))) == hash(link)
        assert list(link.as_dict()) == ["peer_cluster_id", "peer_address", "initiator", "broken", "broken_reason",
                                        "transport", "authenticated", "payload_integrity", "device_paths", "lanes",
                                        "confirmed"]
        with pytest.raises(AttributeError):
            link.broken = True  # type: ignore[misc]
        stats = dialler.stats()  # the engine's typed record itself
        assert type(stats) is core.EngineStats and stats.live_links == 1 and stats.as_dict()["live_links"] == 1
        native = native_engine(dialler).stats()
        assert type(native) is core.EngineStats and native.live_links == 1
        # one field table gives each record its attributes, as_dict, repr, equality and pickling
        assert pickle.loads(pickle.dumps(native)) == native and repr(native).startswith("EngineStats(live_links=1, ")
        assert repr(link) == "LinkInfo(" + ", ".join(f"{k}={getattr(link, k)!r}" for k in link.as_dict()) + ")"
        with pytest.raises(TypeError):
            core.LinkInfo()  # a record comes from the engine (or pickle), not from a constructor
        (pool,) = target.kv.pools()
        assert (pool["placement"], pool["capacity"], pool["used"]) == (core.Placement.HOST, 1 << 20, 0)
        (native_pool,) = native_engine(target).pools()
        assert native_pool.as_dict() == pool and pickle.loads(pickle.dumps(native_pool)) == native_pool
        from pdlink import kv

        handle = target.kv.allocate(kv.CacheLayout(2, 4096, 1, False, kv.placement("HOST")), [], None)
        assert type(handle) is kv.CacheHandle and len(handle.addresses) == 2 and target.kv.count == 1
        cache_id, addresses = handle  # unpacks as the (cache_id, addresses) it was
        assert (cache_id, addresses) == (handle.cache_id, list(handle.addresses))
        assert target.kv.pools()[0]["used"] > 0
        target.kv.deallocate(cache_id, False)
        assert target.kv.count == 0


def test_an_address_is_a_string_or_a_pair_passed_on_as_it_is() -> None:
    """``connect``, ``connect_each``, ``add_listener`` and ``EngineOptions.listen`` take
    ``"ip:port"`` or ``(ip, port)``; the layers pass pairs, never a string joined to be split again.
    A pair is refused as its string would be."""
    with pdlink.Engine(pdlink.EngineOptions(cluster_id=1, listen=("127.0.0.1", 0))) as target, \
            pdlink.Engine(pdlink.EngineOptions(cluster_id=2)) as dialler:
        port = target.listen_port
        assert port > 0
        assert dialler.connect(("127.0.0.1", port)) == 1
        second = target.add_listener(("127.0.0.1", 0))
        assert second > 0 and second != port
        (result,) = dialler.connect_each([(None, ("127.0.0.1", port))])
        assert (result.status, result.peer_cluster_id) == (pdlink.LLMStatusCode.LLM_ALREADY_LINK, 1)
        dialler.disconnect(1)
        assert dialler.connect(f"127.0.0.1:{second}") == 1
        for bad, shown in ((("127.0.0.1", 70000), "'127.0.0.1:70000'"), (("", 5), "':5'"),
                           (("127.0.0.1", -1), "'127.0.0.1:-1'"), (("a", 1, 2), "('a', 1, 2)")):
            with pytest.raises(ValueError, match="address must be 'ip:port'.*got " + re.escape(shown)) as refused:
                dialler.connect(bad)  # type: ignore[arg-type]
            if isinstance(bad, tuple) and len(bad) == 2:  # as the joined string is refused, word for word
                with pytest.raises(ValueError) as as_string:
                    dialler.connect(f"{bad[0]}:{bad[1]}")
                assert str(refused.value) == str(as_string.value)
