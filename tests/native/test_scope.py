"""What a failure concerns (``pdlink.Scope``, csrc/core/status.h): the call, one link, or the engine;
and ``Engine.connect_each`` / ``disconnect_each``'s ``pdlink.LinkResult`` per peer."""

import pickle

import pytest

import pdlink
from comm_util import free_port
from internals import core
from pdlink import LLMStatusCode as S
from pdlink import Scope

ANY = pdlink.ANY_CLUSTER


def _engines():
    target = pdlink.Engine(pdlink.EngineOptions(cluster_id=1, listen=("127.0.0.1", 0)))
    dialler = pdlink.Engine(pdlink.EngineOptions(cluster_id=2))
    return target, dialler


def test_scope_and_link_result_are_the_native_modules() -> None:
    assert pdlink.Scope is core.Scope and pdlink.LinkResult is core.LinkResult
    assert list(Scope.__members__) == ["CALL", "LINK", "ENGINE"]


def test_a_bad_argument_concerns_the_call() -> None:
    target, dialler = _engines()
    with target, dialler:
        (result,) = dialler.connect_each([(2, ("127.0.0.1", target.listen_port))])  # its own cluster id
        assert (result.status, result.scope, result.ok) == (S.LLM_PARAM_INVALID, Scope.CALL, False)
        assert "own cluster id 2" in result.message
        with pytest.raises(pdlink.InvalidArgument) as e:
            dialler.connect(("127.0.0.1", target.listen_port), cluster_id=2)
        assert e.value.scope == Scope.CALL and e.value.status_code is S.LLM_PARAM_INVALID


def test_a_closed_port_concerns_that_link_and_the_other_peers_link() -> None:
    target, dialler = _engines()
    with target, dialler:
        dead = free_port()
        results = dialler.connect_each([(None, ("127.0.0.1", dead)), (None, ("127.0.0.1", target.listen_port))],
                                       timeout_ms=3000)
        assert [type(r) for r in results] == [pdlink.LinkResult] * 2
        refused, linked = results
        assert (refused.status, refused.scope, refused.ok) == (S.LLM_LINK_FAILED, Scope.LINK, False)
        assert f"127.0.0.1:{dead}" in refused.message and refused.peer_cluster_id == ANY
        assert (linked.status, linked.scope, linked.ok, linked.message, linked.peer_cluster_id) == \
            (S.LLM_SUCCESS, Scope.CALL, True, "", 1)
        linked.check()  # nothing to raise
        with pytest.raises(pdlink.LinkError) as e:
            refused.check()  # what connect raises for it
        assert (e.value.status_code, e.value.scope, str(e.value)) == (S.LLM_LINK_FAILED, Scope.LINK, refused.message)
        with pytest.raises(pdlink.LinkError) as e:
            dialler.connect(("127.0.0.1", dead), timeout_ms=3000)
        assert e.value.scope == Scope.LINK
        assert [link.peer_cluster_id for link in dialler.links()] == [1]  # the failure touched no other link
        dialler.ping(1)


def test_disconnect_each_reports_each_peer_by_the_id_asked_for() -> None:
    target, dialler = _engines()
    with target, dialler:
        assert dialler.connect(("127.0.0.1", target.listen_port)) == 1
        results = dialler.disconnect_each([1, 7])
        assert [(r.status, r.scope, r.peer_cluster_id, r.ok) for r in results] == \
            [(S.LLM_SUCCESS, Scope.CALL, 1, True), (S.LLM_NOT_YET_LINK, Scope.LINK, 7, False)]
        assert results[1].message == "no link to cluster 7"
        (many,) = dialler.disconnect_each(list(range(3, 20)))  # a call that fails as a whole: one result
        assert (many.status, many.scope, many.peer_cluster_id) == (S.LLM_CLUSTER_NUM_EXCEED_LIMIT, Scope.CALL, ANY)


def test_a_call_on_a_finalised_engine_concerns_the_engine() -> None:
    engine = pdlink.Engine(pdlink.EngineOptions(cluster_id=2))
    engine.close()
    (result,) = engine.connect_each([(None, "127.0.0.1:1"), (None, "127.0.0.1:2")])  # fails as a whole
    assert (result.status, result.scope, result.peer_cluster_id) == (S.LLM_FAILED, Scope.ENGINE, ANY)
    with pytest.raises(pdlink.LLMException) as e:
        engine.ping(1)
    assert (e.value.scope, str(e.value)) == (Scope.ENGINE, "engine is not initialized")


def test_link_result_reads_as_fields_and_is_made_from_them() -> None:
    made = pdlink.LinkResult(S.LLM_TIMEOUT, "slow", 5)  # scope: the code's own
    assert (made.status, made.message, made.peer_cluster_id, made.scope) == (S.LLM_TIMEOUT, "slow", 5, Scope.LINK)
    assert type(made.status) is S
    assert pdlink.LinkResult(S.LLM_OUT_OF_MEMORY, "", 5).scope == Scope.ENGINE
    assert pdlink.LinkResult(S.LLM_PARAM_INVALID, "", 5).scope == Scope.CALL
    assert pdlink.LinkResult(S.LLM_LINK_FAILED, "", 5, Scope.ENGINE).scope == Scope.ENGINE
    assert repr(made) == "LinkResult(LLM_TIMEOUT, scope=LINK, peer_cluster_id=5, message='slow')"
    with pytest.raises(TypeError):
        _code, _message, _peer = made  # type: ignore[misc]  # fields, not a tuple
    with pytest.raises(ValueError, match="unknown status code"):
        pdlink.LinkResult(0x5010B014, "", 5)


def test_an_exceptions_scope_survives_pickling() -> None:
    with pytest.raises(pdlink.TransferTimeout) as e:
        pdlink.LinkResult(S.LLM_TIMEOUT, "slow", 5).check()
    back = pickle.loads(pickle.dumps(e.value))
    assert (type(back), back.scope, back.status_code, str(back)) == (pdlink.TransferTimeout, Scope.LINK,
                                                                       S.LLM_TIMEOUT, "slow")
    assert pdlink.LLMException("made in Python").scope is None
