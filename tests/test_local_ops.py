"""Memory pools, cache ids and local copies (spec 8.2, 8.6, 10.1), byte for byte.

Each test runs its own engine in a peer process (one LLMDataDist per process), on the CPU backend
and on the Ascend backend over the fake libraries (``backend`` fixture): there DEVICE memory
(pools, registered tensors) is NPU memory and every copy is an aclrtMemcpy of the right kind.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

from backend_env import peer_env
from pdlink import LLMException, LLMStatusCode

S = LLMStatusCode
MiB = 1 << 20


@contextmanager
def llm_error(code, op=None):
    with pytest.raises(LLMException) as info:
        yield info
    assert info.value.status_code == code, f"{info.value.status_code}: {info.value}"
    if op is not None:
        assert str(info.value).startswith(f"{op} failed, error code is {code}"), str(info.value)


def engine(peers, backend, name="local", **opts):
    p = peers(name, env=peer_env(backend))
    args = ", ".join(f"{k}={v!r}" for k, v in opts.items())
    p.exec(f"dd = LLMDataDist(LLMRole.PROMPT, 1); dd.init(options({args})); cm = dd.cache_manager\n"
           "def desc(n, shape, placement=Placement.DEVICE):\n"
           "    return CacheDesc(n, list(shape), DataType.DT_INT8, placement)\n")
    return p


def pattern(shape, seed):
    a = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    return ((a * 7 + seed * 13) % 251 - 125).astype(np.int8)


# ---------------------------------------------------------------------------- pools


def test_allocation_needs_a_pool_of_its_placement(peers, backend):
    p = engine(peers, backend, "nopool")
    for code in ["cm.allocate_cache(desc(1, [2, 64]))",
                 "cm.allocate_blocks_cache(desc(1, [2, 64]))",
                 "cm.allocate_cache(desc(1, [2, 64], Placement.HOST))"]:
        with llm_error(S.LLM_PARAM_INVALID):
            p.exec(code)
    # registration needs no pool
    p.exec("buf = zeros(1, (2, 64), np.int8); r = cm.register_cache(desc(1, [2, 64]), addrs(buf))")
    assert p.eval("r.cache_id") == 1
    p.exec("dd.finalize()")

    # a device pool serves DEVICE only; HOST needs host_mem_pool_cfg
    p.exec("dd.init(options(pool=1 << 20)); cm = dd.cache_manager")
    assert p.eval("cm.allocate_cache(desc(1, [2, 64])).cache_id") == 1  # ids restart with the engine
    for code in ["cm.allocate_cache(desc(1, [2, 64], Placement.HOST))",
                 "cm.allocate_blocks_cache(desc(1, [2, 64], Placement.HOST))"]:
        with llm_error(S.LLM_PARAM_INVALID):
            p.exec(code)
    p.exec("dd.finalize()")

    p.exec("dd.init(options(host_pool=1 << 20)); cm = dd.cache_manager")
    p.exec("h = cm.allocate_blocks_cache(desc(2, [4, 64], Placement.HOST))")
    assert p.eval("(h.cache_id, h.is_blocks_cache, len(h.tensor_addrs), h.cache_desc.placement)") == \
        (1, True, 2, p.eval("Placement.HOST"))
    with llm_error(S.LLM_PARAM_INVALID):
        p.exec("cm.allocate_cache(desc(1, [2, 64]))")
    with llm_error(S.LLM_PARAM_INVALID):  # zero tensors
        p.exec("cm.allocate_cache(desc(0, [2, 64], Placement.HOST))")
    # the memory is usable
    p.exec("write_cache(h, 5)")
    data = p.eval("read_cache(h)")
    assert len(data) == 2 and all(d.size == 256 for d in data)
    assert data[1][:4].tolist() == [(0 * 13 + 5 + 505) % 251, (13 + 5 + 505) % 251,
                                    (26 + 5 + 505) % 251, (39 + 5 + 505) % 251]


@pytest.mark.parametrize("placement,pool_kw", [("DEVICE", "pool"), ("HOST", "host_pool")])
def test_pool_exhaustion_and_reuse(peers, backend, placement, pool_kw):
    p = engine(peers, backend, "pool", **{pool_kw: 4 * MiB})
    pl = f"Placement.{placement}"
    full = f"desc(1, [1024, 4096], {pl})"  # exactly the 4 MiB pool
    # the whole pool, twice in a row with a deallocation in between
    p.exec(f"a = cm.allocate_cache({full})")
    with llm_error(S.LLM_OUT_OF_MEMORY, "allocate_cache"):
        p.exec(f"cm.allocate_cache(desc(1, [1, 4096], {pl}))")
    p.exec(f"cm.deallocate_cache(a)\na = cm.allocate_cache({full})\ncm.deallocate_cache(a)")
    # failed allocations leak nothing: a partial fit (first tensor fits, second does not),
    # a request above the pool and a bad key list
    p.exec(f"x = cm.allocate_cache(desc(1, [3, 1024 * 1024 // 4], {pl}))")  # 768 KiB
    for code, code_ in [
        (f"cm.allocate_cache(desc(2, [3, 1024 * 1024], {pl}))", S.LLM_OUT_OF_MEMORY),  # 2 x 3 MiB
        (f"cm.allocate_blocks_cache(desc(1, [8, 1024 * 1024], {pl}))", S.LLM_OUT_OF_MEMORY),
        (f"cm.allocate_cache(desc(1, [1, 2**40], {pl}))", S.LLM_OUT_OF_MEMORY),
    ]:
        with llm_error(code_):
            p.exec(code)
    with llm_error(S.LLM_PARAM_INVALID):
        p.exec(f"cm.allocate_cache(desc(1, [2, 1024 * 1024], {pl}), [CacheKey(1, 1), CacheKey(1, 1)])")
    p.exec("cm.deallocate_cache(x)")
    p.exec(f"a = cm.allocate_cache({full})\ncm.deallocate_cache(a)")
    # an allocate/deallocate loop of big caches keeps fitting
    p.exec(f"for i in range(40):\n"
           f"    c = cm.allocate_blocks_cache(desc(3, [16, 65536], {pl}))\n"
           f"    cm.deallocate_blocks_cache(c)\n")
    # a cache stays alive while a key references it; removing the key frees it
    p.exec(f"k = cm.allocate_cache({full}, [CacheKey(1, 7)])\ncm.deallocate_cache(k)")
    assert p.eval("k.tensor_addrs") == []
    with llm_error(S.LLM_OUT_OF_MEMORY):
        p.exec(f"cm.allocate_cache(desc(1, [1, 4096], {pl}))")
    p.exec("cm.remove_cache_key(CacheKey(1, 7))")
    p.exec(f"a = cm.allocate_cache({full})")


def test_pool_frees_coalesce_and_allocations_do_not_overlap(peers, backend):
    p = engine(peers, backend, "coalesce", pool=4 * MiB, host_pool=MiB)
    # four 1 MiB caches fill the pool; free them out of order, then the whole pool fits again
    p.exec("cs = [cm.allocate_cache(desc(1, [256, 4096])) for _ in range(4)]")
    with llm_error(S.LLM_OUT_OF_MEMORY):
        p.exec("cm.allocate_cache(desc(1, [1, 4096]))")
    p.exec("h = cm.allocate_cache(desc(1, [256, 4096], Placement.HOST))")  # the host pool is separate
    p.exec("for i in (1, 3, 0, 2): cm.deallocate_cache(cs[i])")
    p.exec("big = cm.allocate_cache(desc(1, [1024, 4096])); cm.deallocate_cache(big)")
    # many small caches of several tensors: every tensor has its own memory
    p.exec("small = [cm.allocate_cache(desc(3, [2, 100 + 7 * i])) for i in range(40)]\n"
           "for i, c in enumerate(small): write_cache(c, i)")
    for i, data in enumerate(p.eval("[read_cache(c) for c in small]")):
        for t, got in enumerate(data):
            want = (np.arange(got.size, dtype=np.int64) * 13 + t * 5 + i * 101) % 251
            assert got.tobytes() == want.astype(np.uint8).tobytes(), (i, t)
    spans = sorted((a, a + 2 * (100 + 7 * i)) for i, data in enumerate(p.eval("[c.tensor_addrs for c in small]"))
                   for a in data)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    p.exec("for c in small: cm.deallocate_cache(c)\nbig = cm.allocate_cache(desc(1, [1024, 4096]))")


def test_cache_ids_count_from_one_in_call_order(peers, backend):
    p = engine(peers, backend, "ids", pool=MiB, host_pool=MiB)
    p.exec("buf = zeros(2, (4, 64), np.int8)")
    ids = p.eval("[cm.register_cache(desc(2, [4, 64]), addrs(buf)).cache_id,"
                 " cm.allocate_cache(desc(1, [2, 64])).cache_id,"
                 " cm.register_blocks_cache(desc(2, [4, 64]), addrs(buf), BlocksCacheKey(1, 0)).cache_id,"
                 " cm.allocate_blocks_cache(desc(1, [4, 64], Placement.HOST)).cache_id,"
                 " cm.allocate_cache(desc(1, [2, 64])).cache_id]")
    assert ids == [1, 2, 3, 4, 5]
    # ids are never reused, even after deallocation / unregistration
    p.exec("c = cm.allocate_cache(desc(1, [2, 64])); cm.deallocate_cache(c); cm.unregister_cache(1)")
    assert p.eval("c.cache_id") == 6
    assert p.eval("cm.allocate_cache(desc(1, [2, 64])).cache_id") == 7
    assert p.eval("Cache.create_cpu_cache(desc(1, [2, 64], Placement.HOST), addrs(buf[:1])).cache_id") == -1
    assert p.eval("cm.allocate_cache(desc(1, [2, 64])).cache_id") == 8


# ---------------------------------------------------------------------------- local copies


def test_copy_cache(peers, backend):
    p = engine(peers, backend, "copy", pool=MiB)
    p.exec("src = tensors(2, (2, 64), seed=3, dtype=np.int8)\n"
           "dst = zeros(2, (3, 64), np.int8)\n"
           "cs = cm.register_cache(desc(2, [2, 64]), addrs(src))\n"
           "cd = cm.register_cache(desc(2, [3, 64]), addrs(dst))\n"
           "cm.copy_cache(cd, cs, 2, 1)")
    src, dst = p.eval("src"), p.eval("dst")
    for s, d in zip(src, dst):
        assert d[2].tobytes() == s[1].tobytes() and not d[:2].any()
    p.exec("cm.copy_cache(cd, cs, 0, 0, offset=16, size=32, req_id=99)")
    for s, d in zip(src, p.eval("dst")):
        assert d[0, 16:48].tobytes() == s[0, 16:48].tobytes() and not d[0, :16].any() and not d[0, 48:].any()
    p.exec("cm.copy_cache(cd, cs, 1, 0, offset=60)")  # the rest of the slot from the offset
    for s, d in zip(src, p.eval("dst")):
        assert d[1, 60:].tobytes() == s[0, 60:].tobytes() and not d[1, :60].any()
    # allocated <-> registered, default indices
    p.exec("ca = cm.allocate_cache(desc(2, [2, 64])); cm.copy_cache(ca, cs, 1, 0); cm.copy_cache(cd, ca, 0, 1)")
    for s, d in zip(src, p.eval("dst")):
        assert d[0].tobytes() == s[0].tobytes()
    before = p.eval("dst")
    p.exec("kv = zeros(2, (4, 64), np.int8); blk = cm.register_blocks_cache(desc(2, [4, 64]), addrs(kv))\n"
           "one = cm.allocate_cache(desc(1, [2, 64]))")
    for code in [
        "cm.copy_cache(cd, cs, 3, 0)",  # dst index out of range
        "cm.copy_cache(cd, cs, 0, 2)",  # src index out of range
        "cm.copy_cache(cd, cs, 0, 0, offset=64)",  # nothing left after the offset
        "cm.copy_cache(cd, cs, 0, 0, offset=48, size=17)",  # beyond the slot
        "cm.copy_cache(cd, cs, 0, 0, offset=-1)",
        "cm.copy_cache(cd, cs, 0, 0, size=0)",
        "cm.copy_cache(cd, cs, 0, 0, size=65)",
        "cm.copy_cache(blk, cs, 0, 0)",
        "cm.copy_cache(cd, blk, 0, 0)",
        "cm.copy_cache(one, cs, 0, 0)",  # different num_tensors
    ]:
        with llm_error(S.LLM_PARAM_INVALID):
            p.exec(code)
    with pytest.raises(TypeError):
        p.exec("cm.copy_cache(cd, cs, 0, 0, req_id='r')")
    p.exec("cm.deallocate_cache(one)")
    with llm_error(S.LLM_PARAM_INVALID):  # a deallocated handle is dead
        p.exec("cm.copy_cache(one, one)")
    assert [a.tobytes() for a in p.eval("dst")] == [a.tobytes() for a in before]


def test_copy_blocks(peers, backend):
    p = engine(peers, backend, "copyblk", pool=MiB)
    p.exec("kv = tensors(3, (8, 32), seed=4, dtype=np.int8)\n"
           "blk = cm.register_blocks_cache(desc(3, [8, 32]), addrs(kv))\n"
           "orig = [a.copy() for a in kv]\n"
           "cm.copy_blocks(blk, {0: [3, 5], 2: [7], 6: []})")
    orig, kv = p.eval("orig"), p.eval("kv")
    for o, k in zip(orig, kv):
        assert k[3].tobytes() == k[5].tobytes() == o[0].tobytes() and k[7].tobytes() == o[2].tobytes()
        for untouched in (0, 1, 2, 4, 6):
            assert k[untouched].tobytes() == o[untouched].tobytes()
    # allocated blocks cache, same semantics
    p.exec("ab = cm.allocate_blocks_cache(desc(1, [4, 128])); write_cache(ab, 6); a0 = read_cache(ab)[0]\n"
           "cm.copy_blocks(ab, {3: [0]})")
    a0, a1 = p.eval("a0"), p.eval("read_cache(ab)[0]")
    assert a1[:128].tobytes() == a0[384:].tobytes() and a1[128:].tobytes() == a0[128:].tobytes()
    p.exec("c = cm.register_cache(desc(3, [8, 32]), addrs(kv))")
    for code in ["cm.copy_blocks(blk, {0: [8]})", "cm.copy_blocks(blk, {8: [0]})", "cm.copy_blocks(blk, {-1: [0]})",
                 "cm.copy_blocks(blk, {0: [-1]})", "cm.copy_blocks(blk, {1: [2], 0: [9]})",
                 "cm.copy_blocks(c, {0: [1]})"]:
        with llm_error(S.LLM_PARAM_INVALID):
            p.exec(code)
    assert [a.tobytes() for a in p.eval("kv")] == [a.tobytes() for a in kv]  # rejected calls wrote nothing


def test_swap_blocks_between_device_and_cpu_cache(peers, backend):
    p = engine(peers, backend, "swap", pool=MiB, host_pool=MiB)
    p.exec("dev_mem = tensors(2, (6, 48), seed=7, dtype=np.int8)\n"
           "dev = cm.register_blocks_cache(desc(2, [6, 48]), addrs(dev_mem))\n"
           "host_mem = zeros(2, (4, 48), np.int8, host=True)\n"
           "host = Cache.create_cpu_cache(desc(2, [4, 48], Placement.HOST), addrs(host_mem))\n"
           "cm.swap_blocks(dev, host, {1: 0, 5: 2})")  # swap out
    dev, host = p.eval("dev_mem"), p.eval("host_mem")
    for d, h in zip(dev, host):
        assert h[0].tobytes() == d[1].tobytes() and h[2].tobytes() == d[5].tobytes()
        assert not h[1].any() and not h[3].any()
    p.exec("host_mem[0][3] = 11; host_mem[1][3] = -11\ncm.swap_blocks(host, dev, {3: 0, 0: 4})")  # swap in
    dev2 = p.eval("dev_mem")
    for i, (d, d2) in enumerate(zip(dev, dev2)):
        assert (d2[0] == (11 if i == 0 else -11)).all() and d2[4].tobytes() == d[1].tobytes()
        for untouched in (1, 2, 3, 5):
            assert d2[untouched].tobytes() == d[untouched].tobytes()
    # an allocated DEVICE cache and an allocated HOST cache swap too
    p.exec("ad = cm.allocate_blocks_cache(desc(1, [4, 64])); ah = cm.allocate_blocks_cache(desc(1, [2, 64], "
           "Placement.HOST))\nwrite_cache(ad, 8)\ncm.swap_blocks(ad, ah, {2: 1})")
    ad, ah = p.eval("read_cache(ad)[0]"), p.eval("read_cache(ah)[0]")
    assert ah[64:].tobytes() == ad[128:192].tobytes()

    p.exec("host2 = Cache.create_cpu_cache(desc(2, [4, 48], Placement.HOST), addrs(host_mem))\n"
           "dev_b = cm.register_blocks_cache(desc(2, [6, 48]), addrs(dev_mem))\n"
           "wide = Cache.create_cpu_cache(desc(2, [4, 96], Placement.HOST), addrs(host_mem))\n"
           "one = Cache.create_cpu_cache(desc(1, [4, 48], Placement.HOST), addrs(host_mem[:1]))\n"
           "contig = cm.register_cache(desc(2, [6, 48]), addrs(dev_mem))")
    before = p.eval("dev_mem"), p.eval("host_mem")
    for code in [
        "cm.swap_blocks(dev, host, {6: 0})",  # src index out of range
        "cm.swap_blocks(dev, host, {0: 4})",  # dst index out of range
        "cm.swap_blocks(host, dev, {-1: 0})",
        "cm.swap_blocks(dev, host, {0: 0, 1: 9})",
        "cm.swap_blocks(host, host2, {0: 1})",  # HOST -> HOST
        "cm.swap_blocks(dev, dev_b, {0: 1})",  # DEVICE -> DEVICE
        "cm.swap_blocks(dev, wide, {0: 0})",  # different block sizes
        "cm.swap_blocks(dev, one, {0: 0})",  # different num_tensors
        "cm.swap_blocks(contig, host, {0: 0})",  # not a blocks cache
    ]:
        with llm_error(S.LLM_PARAM_INVALID):
            p.exec(code)
    with pytest.raises(AttributeError):
        p.exec("cm.swap_blocks(None, host, {0: 0})")
    with pytest.raises(TypeError):
        p.exec("cm.swap_blocks(dev, host, {0: '1'})")
    after = p.eval("dev_mem"), p.eval("host_mem")
    for b, a in zip(before, after):
        assert [x.tobytes() for x in a] == [x.tobytes() for x in b]


# ---------------------------------------------------------------------------- no-ops and misuse


def test_noops_and_unregister_misuse(peers, backend):
    p = engine(peers, backend, "noop", pool=MiB)
    p.exec("a = cm.allocate_cache(desc(1, [2, 64]), [CacheKey(1, 3)])\n"
           "buf = zeros(1, (2, 64), np.int8); r = cm.register_cache(desc(1, [2, 64]), addrs(buf), [CacheKey(1, 4)])\n"
           "b = cm.allocate_blocks_cache(desc(1, [2, 64]))")
    assert p.eval("dd._engine.cache_count") == 3
    # removing a missing key: a no-op, repeatedly
    p.exec("cm.remove_cache_key(CacheKey(1, 999)); cm.remove_cache_key(CacheKey(1, 3, 5)); "
           "cm.remove_cache_key(CacheKey(1, 999))")
    # deallocating an unknown id: a no-op
    p.exec("ghost = Cache(4242, desc(1, [2, 64]), [1], is_blocks_cache=False); cm.deallocate_cache(ghost)\n"
           "gb = Cache(4243, desc(1, [2, 64]), [1], is_blocks_cache=True); cm.deallocate_blocks_cache(gb)")
    assert p.eval("dd._engine.cache_count") == 3
    # unregistering an allocated cache is refused
    for code in ["cm.unregister_cache(a.cache_id)", "cm.unregister_cache(b.cache_id)"]:
        with llm_error(S.LLM_PARAM_INVALID, "unregister_cache"):
            p.exec(code)
    # the wrong deallocate kind is refused
    with llm_error(S.LLM_PARAM_INVALID):
        p.exec("cm.deallocate_cache(b)")
    with llm_error(S.LLM_PARAM_INVALID):
        p.exec("cm.deallocate_blocks_cache(a)")
    assert p.eval("dd._engine.cache_count") == 3 and p.eval("len(a.tensor_addrs) == len(b.tensor_addrs) == 1")
    # key held: deallocate keeps the cache, remove_cache_key frees it; a second deallocate is a no-op
    p.exec("cm.deallocate_cache(a)")
    assert p.eval("dd._engine.cache_count") == 3
    p.exec("cm.remove_cache_key(CacheKey(1, 3)); cm.deallocate_cache(a)")
    assert p.eval("dd._engine.cache_count") == 2
    p.exec("cm.deallocate_blocks_cache(b); cm.deallocate_blocks_cache(b)")
    assert p.eval("dd._engine.cache_count") == 1
    # deallocating a registered (user-owned) cache is a silent no-op for the engine
    p.exec("cm.deallocate_cache(r)")
    assert p.eval("dd._engine.cache_count") == 1
    with llm_error(S.LLM_PARAM_INVALID):  # its key is still bound
        p.exec("cm.allocate_cache(desc(1, [2, 64]), [CacheKey(1, 4)])")
    # unregister of the registered cache works, and its key is gone with it
    p.exec("cm.unregister_cache(r.cache_id)")
    assert p.eval("dd._engine.cache_count") == 0
    p.exec("r2 = cm.register_cache(desc(1, [2, 64]), addrs(buf), [CacheKey(1, 4)])")
