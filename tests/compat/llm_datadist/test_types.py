"""Tests for pdlink.compat.llm_datadist.llm_types: enums, CacheDesc, keys, cache handles, transfer configs."""

from enum import Enum, IntEnum

import pytest

from internals import PushType, register_mem_status_from_int
from llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCache,
    LayerSynchronizer,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from pdlink import LLMException, LLMStatusCode

U64 = 2**64 - 1


def _assert_param_invalid(excinfo):
    assert excinfo.value.status_code is LLMStatusCode.LLM_PARAM_INVALID


# ---------------------------------------------------------------------------- enums


def test_enums():
    assert issubclass(Placement, IntEnum)
    assert (Placement.HOST, Placement.DEVICE) == (0, 1)
    assert str(Placement.HOST) == "Placement.HOST"
    assert str(Placement.DEVICE) == "Placement.DEVICE"
    assert issubclass(RegisterMemStatus, Enum) and not issubclass(RegisterMemStatus, int)
    assert [(m.name, m.value) for m in RegisterMemStatus] == [("OK", 0), ("PREPARING", 1), ("FAILED", 2)]
    assert [(m.name, m.value) for m in Memtype] == [("MEM_TYPE_DEVICE", 0), ("MEM_TYPE_HOST", 1)]
    assert [(m.name, m.value) for m in PushType] == [
        ("NO_CACHE_KEY", 0),
        ("BLOCKS_CACHE_KEY", 1),
        ("CACHE_KEY_BY_ID", 2),
    ]


def test_register_mem_status_from_int():
    assert register_mem_status_from_int(0) is RegisterMemStatus.OK
    assert register_mem_status_from_int(1) is RegisterMemStatus.PREPARING
    assert register_mem_status_from_int(2) is RegisterMemStatus.FAILED
    assert register_mem_status_from_int(17) is RegisterMemStatus.FAILED
    assert register_mem_status_from_int(-1) is RegisterMemStatus.FAILED


# ---------------------------------------------------------------------------- CacheDesc


def test_cache_desc_basics():
    shape = [4, 16, 8]
    desc = CacheDesc(80, shape, DataType.DT_FLOAT16)
    assert desc.num_tensors == 80
    assert desc.shape is shape
    assert desc.data_type is DataType.DT_FLOAT16
    assert desc.placement is Placement.DEVICE
    assert desc.batch_dim == 0
    assert desc.batch_size == 4
    assert desc.seq_len_dim_index == -1
    assert desc.kv_tensor_format is None
    assert desc.size == 4 * 16 * 8 * 2


def test_cache_desc_full_args_and_repr():
    desc = CacheDesc(2, (3, 5), DataType.DT_INT32, Placement.HOST, 1, 0, "BSND")
    assert desc.placement is Placement.HOST
    assert desc.batch_dim == 1
    assert desc.batch_size == 5
    assert desc.seq_len_dim_index == 0
    assert desc.kv_tensor_format == "BSND"
    assert desc.size == 3 * 5 * 4
    assert repr(desc) == (
        "CacheDesc(num_tensors=2, shape=(3, 5), data_type=DataType.DT_INT32, placement=Placement.HOST, "
        "batch_dim_index=1, seq_len_dim_index=0, kv_tensor_format='BSND')"
    )
    kw = CacheDesc(
        num_tensors=1,
        shape=[2],
        data_type=DataType.DT_BF16,
        placement=Placement.DEVICE,
        batch_dim_index=0,
        seq_len_dim_index=-1,
        kv_tensor_format=None,
    )
    assert kw.size == 4


def test_cache_desc_size_for_all_types():
    sizes = {
        DataType.DT_FLOAT: 4, DataType.DT_FLOAT16: 2, DataType.DT_BF16: 2, DataType.DT_INT8: 1,
        DataType.DT_UINT8: 1, DataType.DT_INT16: 2, DataType.DT_UINT16: 2, DataType.DT_INT32: 4,
        DataType.DT_UINT32: 4, DataType.DT_INT64: 8, DataType.DT_UINT64: 8, DataType.DT_DOUBLE: 8,
        DataType.DT_BOOL: 1,
    }
    for dt, sz in sizes.items():
        assert CacheDesc(1, [2, 3], dt).size == 6 * sz
    assert CacheDesc(1, [0, 3], DataType.DT_FLOAT).size == 0


def test_cache_desc_size_not_computable():
    with pytest.raises(LLMException) as ei:
        _ = CacheDesc(1, [2, 3], DataType.DT_STRING).size
    _assert_param_invalid(ei)
    with pytest.raises(LLMException):
        _ = CacheDesc(1, [2, -1], DataType.DT_FLOAT).size
    with pytest.raises(LLMException):
        _ = CacheDesc(1, [2**62, 4], DataType.DT_FLOAT).size


def test_cache_desc_update_dim():
    shape = [4, 16]
    desc = CacheDesc(2, shape, DataType.DT_FLOAT)
    assert desc.size == 4 * 16 * 4
    desc.update_dim(1, 32)
    assert shape == [4, 32]
    assert desc.shape is shape
    assert desc.size == 4 * 32 * 4
    desc.update_dim(0, 8)
    assert desc.batch_size == 4  # not recomputed
    assert desc.size == 8 * 32 * 4
    with pytest.raises(LLMException):
        desc.update_dim(2, 1)
    with pytest.raises(LLMException):
        desc.update_dim(-1, 1)
    with pytest.raises(TypeError):
        desc.update_dim("0", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        desc.update_dim(0, "1")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        desc.update_dim(0, 2**63)
    tdesc = CacheDesc(1, (2, 3), DataType.DT_INT8)
    tdesc.update_dim(1, 5)
    assert list(tdesc.shape) == [2, 5]
    assert tdesc.size == 10


@pytest.mark.parametrize(
    "args,kwargs",
    [
        (("2", [1], DataType.DT_FLOAT), {}),
        ((True, [1], DataType.DT_FLOAT), {}),
        ((2, "1,2", DataType.DT_FLOAT), {}),
        ((2, [1, "2"], DataType.DT_FLOAT), {}),
        ((2, [1, 2.0], DataType.DT_FLOAT), {}),
        ((2, None, DataType.DT_FLOAT), {}),
        ((2, [1], 0), {}),
        ((2, [1], None), {}),
        ((2, [1], DataType.DT_FLOAT), {"placement": 1}),
        ((2, [1], DataType.DT_FLOAT), {"placement": None}),
        ((2, [1], DataType.DT_FLOAT), {"batch_dim_index": "0"}),
        ((2, [1], DataType.DT_FLOAT), {"batch_dim_index": None}),
        ((2, [1], DataType.DT_FLOAT), {"seq_len_dim_index": 0.0}),
        ((2, [1], DataType.DT_FLOAT), {"kv_tensor_format": 1}),
    ],
)
def test_cache_desc_type_errors(args, kwargs):
    with pytest.raises(TypeError):
        CacheDesc(*args, **kwargs)


def test_cache_desc_type_error_message():
    with pytest.raises(TypeError) as ei:
        CacheDesc("2", [1], DataType.DT_FLOAT)  # type: ignore[arg-type]
    assert str(ei.value) == "num_tensors only support ['int'], but got <class 'str'>."


@pytest.mark.parametrize(
    "args",
    [
        (-1, [1], DataType.DT_FLOAT),
        (2**32, [1], DataType.DT_FLOAT),
        (1, [2**63], DataType.DT_FLOAT),
        (1, [-(2**63) - 1], DataType.DT_FLOAT),
        (1, [1], DataType.DT_FLOAT, Placement.DEVICE, 2**31),
        (1, [1], DataType.DT_FLOAT, Placement.DEVICE, 0, 2**31),
    ],
)
def test_cache_desc_value_errors(args):
    with pytest.raises(ValueError):
        CacheDesc(*args)


def test_cache_desc_value_error_message():
    with pytest.raises(ValueError) as ei:
        CacheDesc(2**32, [1], DataType.DT_FLOAT)
    assert str(ei.value) == f"num_tensors's value is out of range,{2**32} is not a uint32 value."


@pytest.mark.parametrize(
    "kwargs",
    [
        {"shape": [], "batch_dim_index": 0},
        {"shape": [2, 3], "batch_dim_index": 2},
        {"shape": [2, 3], "batch_dim_index": -1},
        {"shape": [2, 3], "seq_len_dim_index": 2},
        {"shape": [2, 3], "seq_len_dim_index": -2},
    ],
)
def test_cache_desc_index_param_invalid(kwargs):
    with pytest.raises(LLMException) as ei:
        CacheDesc(1, data_type=DataType.DT_FLOAT, **kwargs)
    _assert_param_invalid(ei)


def test_cache_desc_num_tensors_zero_allowed():
    assert CacheDesc(0, [1], DataType.DT_FLOAT).num_tensors == 0


# ---------------------------------------------------------------------------- CacheKey


def test_cache_key_positional_and_defaults():
    key = CacheKey(1, 2)
    assert key.cluster_id == 1
    assert key.prompt_cluster_id == 1
    assert key.req_id == 2
    assert key.model_id == 0
    assert key.prefix_id == U64
    assert repr(key) == "CacheKey(cluster_id=1, req_id=2, prefix_id=18446744073709551615, model_id=0)"
    full = CacheKey(1, 2, 3, 4)
    assert (full.cluster_id, full.req_id, full.model_id, full.prefix_id) == (1, 2, 3, 4)
    assert repr(full) == "CacheKey(cluster_id=1, req_id=2, prefix_id=4, model_id=3)"


def test_cache_key_keywords():
    key = CacheKey(prompt_cluster_id=5, req_id=6, prefix_id=7)
    assert key.cluster_id == 5 and key.prompt_cluster_id == 5
    assert key.prefix_id == 7
    assert repr(key) == "CacheKey(cluster_id=5, req_id=6, prefix_id=7, model_id=0)"
    key2 = CacheKey(cluster_id=5, req_id=6, model_id=1)
    assert key2.model_id == 1
    key3 = CacheKey(5, req_id=6, model_id=1, prefix_id=0)
    assert (key3.cluster_id, key3.req_id, key3.model_id, key3.prefix_id) == (5, 6, 1, 0)
    # Padding key
    assert CacheKey(0, U64).req_id == U64


def test_cache_key_equality_and_hash():
    assert CacheKey(1, 2) == CacheKey(prompt_cluster_id=1, req_id=2)
    assert CacheKey(1, 2) != CacheKey(1, 3)
    assert len({CacheKey(1, 2), CacheKey(cluster_id=1, req_id=2), CacheKey(1, 2, 1)}) == 2


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((), {}),
        ((1,), {}),
        ((), {"req_id": 1}),
        ((), {"cluster_id": 1}),
        ((1, 2), {"foo": 3}),
        ((1, 2, 3, 4, 5), {}),
        ((1, 2, 3), {"prefix_id": 4, "model_id": 3}),
        ((1, 2), {"cluster_id": 9}),
        ((), {"cluster_id": 1, "prompt_cluster_id": 2, "req_id": 3}),
    ],
)
def test_cache_key_param_invalid(args, kwargs):
    with pytest.raises(LLMException) as ei:
        CacheKey(*args, **kwargs)
    _assert_param_invalid(ei)


def test_cache_key_same_value_twice_is_accepted():
    key = CacheKey(cluster_id=1, prompt_cluster_id=1, req_id=3)
    assert key.cluster_id == 1


@pytest.mark.parametrize(
    "args,exc",
    [
        (("1", 2), TypeError),
        ((1, "2"), TypeError),
        ((1, 2, 1.0), TypeError),
        ((1, 2, 0, None), TypeError),
        ((True, 2), TypeError),
        ((-1, 2), ValueError),
        ((1, 2**64), ValueError),
        ((1, 2, -1), ValueError),
        ((1, 2, 0, 2**64), ValueError),
    ],
)
def test_cache_key_type_value_errors(args, exc):
    with pytest.raises(exc):
        CacheKey(*args)


def test_cache_key_error_messages():
    with pytest.raises(TypeError) as ei:
        CacheKey(1, "2")
    assert str(ei.value) == "req_id only support ['int'], but got <class 'str'>."
    with pytest.raises(ValueError) as vi:
        CacheKey(1, 2, 0, 2**64)
    assert str(vi.value) == f"prefix_id's value is out of range,{2**64} is not a uint64 value."
    with pytest.raises(ValueError) as vi:
        CacheKey(prompt_cluster_id=-1, req_id=1)
    assert str(vi.value) == "prompt_cluster_id's value is out of range,-1 is not a uint64 value."


# ---------------------------------------------------------------------------- CacheKeyByIdAndIndex


def test_cache_key_by_id_and_index():
    key = CacheKeyByIdAndIndex(1, 2)
    assert (key.cluster_id, key.cache_id, key.batch_index) == (1, 2, 0)
    key = CacheKeyByIdAndIndex(cluster_id=U64, cache_id=-1, batch_index=2**32 - 1)
    assert key.batch_index == 2**32 - 1
    assert repr(CacheKeyByIdAndIndex(1, 2, 3)) == "CacheKeyByIdAndIndex(cluster_id=1, cache_id=2, batch_index=3)"
    assert CacheKeyByIdAndIndex(1, 2, 3) == CacheKeyByIdAndIndex(1, 2, 3)
    assert hash(CacheKeyByIdAndIndex(1, 2, 3)) == hash(CacheKeyByIdAndIndex(1, 2, 3))
    assert CacheKeyByIdAndIndex(1, 2, 3) != CacheKeyByIdAndIndex(1, 2, 4)


@pytest.mark.parametrize(
    "args,exc",
    [
        (("1", 2), TypeError),
        ((1, 2.0), TypeError),
        ((1, 2, None), TypeError),
        ((1, True), TypeError),
        ((-1, 2), ValueError),
        ((1, 2**63), ValueError),
        ((1, 2, -1), ValueError),
        ((1, 2, 2**32), ValueError),
    ],
)
def test_cache_key_by_id_and_index_errors(args, exc):
    with pytest.raises(exc):
        CacheKeyByIdAndIndex(*args)


# ---------------------------------------------------------------------------- BlocksCacheKey


def test_blocks_cache_key():
    key = BlocksCacheKey(1)
    assert (key.cluster_id, key.prompt_cluster_id, key.model_id) == (1, 1, 0)
    assert repr(key) == "BlocksCacheKey(cluster_id=1, model_id=0)"
    key = BlocksCacheKey(prompt_cluster_id=2, model_id=1)
    assert repr(key) == "BlocksCacheKey(prompt_cluster_id=2, model_id=1)"
    key = BlocksCacheKey(cluster_id=3, model_id=4)
    assert repr(key) == "BlocksCacheKey(cluster_id=3, model_id=4)"
    assert repr(BlocksCacheKey(5, 6)) == "BlocksCacheKey(cluster_id=5, model_id=6)"
    # only type-checked, no range check
    assert BlocksCacheKey(-1, 2**70).model_id == 2**70
    assert BlocksCacheKey(1, 0) == BlocksCacheKey(prompt_cluster_id=1)
    assert len({BlocksCacheKey(1, 0), BlocksCacheKey(prompt_cluster_id=1)}) == 1


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((), {}),
        ((), {"model_id": 1}),
        ((1, 2, 3), {}),
        ((1,), {"model_id": 2, "foo": 1}),
        ((1,), {"req_id": 2}),
    ],
)
def test_blocks_cache_key_param_invalid(args, kwargs):
    with pytest.raises(LLMException) as ei:
        BlocksCacheKey(*args, **kwargs)
    _assert_param_invalid(ei)


@pytest.mark.parametrize("args", [("1",), (1, "0"), (1.0,), (True,), (1, None)])
def test_blocks_cache_key_type_errors(args):
    with pytest.raises(TypeError):
        BlocksCacheKey(*args)


# ---------------------------------------------------------------------------- Cache


def _host_desc(n=2):
    return CacheDesc(n, [4, 8], DataType.DT_FLOAT16, Placement.HOST)


def test_cache_handle():
    desc = CacheDesc(2, [4, 8], DataType.DT_FLOAT16)
    addrs = [0x1000, 0x2000]
    cache = Cache(1, desc, addrs)
    assert cache.cache_id == 1
    assert cache.cache_desc is desc
    assert cache.tensor_addrs == addrs
    assert cache.is_blocks_cache is False
    assert repr(cache) == "Cache(cache_id=1, num_tensors=2, is_blocks_cache=False)"
    cache._invalidate()
    assert cache.tensor_addrs == []
    assert addrs == [0x1000, 0x2000]  # the caller's list is not cleared
    assert not hasattr(Cache, "__del__")
    blocks = Cache(2, desc, (1, 2), is_blocks_cache=True)  # type: ignore[arg-type]
    assert blocks.is_blocks_cache is True
    assert blocks.tensor_addrs == [1, 2]


def test_cache_handle_validation():
    desc = CacheDesc(2, [4, 8], DataType.DT_FLOAT16)
    with pytest.raises(TypeError):
        Cache("1", desc, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Cache(2**63, desc, [1, 2])
    with pytest.raises(TypeError):
        Cache(1, None, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Cache(1, desc, [1, "2"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        Cache(1, desc, [1, 2], is_blocks_cache=1)  # type: ignore[arg-type]


def test_cache_create_cpu_cache():
    desc = _host_desc()
    cache = Cache.create_cpu_cache(desc, [10, 20])
    assert cache.cache_id == -1
    assert cache.is_blocks_cache is True
    assert cache.tensor_addrs == [10, 20]
    assert cache.cache_desc is desc
    with pytest.raises(LLMException) as ei:
        Cache.create_cpu_cache(CacheDesc(2, [4, 8], DataType.DT_FLOAT16), [10, 20])
    _assert_param_invalid(ei)
    with pytest.raises(LLMException) as ei:
        Cache.create_cpu_cache(desc, [10])
    _assert_param_invalid(ei)
    with pytest.raises(TypeError):
        Cache.create_cpu_cache(desc, [10, "20"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        Cache.create_cpu_cache("desc", [10, 20])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Cache.create_cpu_cache(desc, 10)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- KvCache


def test_kv_cache_handle():
    desc = CacheDesc(2, [4, 8], DataType.DT_FLOAT16)
    kv = KvCache(3, desc, [[1, 2]])
    assert kv.cache_id == 3
    assert kv.cache_desc is desc
    assert kv.per_device_tensor_addrs == [[1, 2]]
    assert kv._manager is None
    assert repr(kv) == "KvCache(cache_id=3, num_devices=1)"
    kv._invalidate()
    assert kv.per_device_tensor_addrs == []
    with pytest.raises(TypeError):
        KvCache(3, desc, [1, 2])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        KvCache("3", desc, [[1, 2]])  # type: ignore[arg-type]


def test_kv_cache_create_cpu_cache():
    desc = _host_desc()
    flat = KvCache.create_cpu_cache(desc, [1, 2])
    assert flat.cache_id == -1
    assert flat.per_device_tensor_addrs == [[1, 2]]
    nested = KvCache.create_cpu_cache(desc, [[1, 2], [3, 4]])
    assert nested.per_device_tensor_addrs == [[1, 2], [3, 4]]
    for bad in ([], [1], [[1, 2], [3]], [[1, 2], 3], [1, [2, 3]]):
        with pytest.raises(LLMException) as ei:
            KvCache.create_cpu_cache(desc, bad)  # type: ignore[arg-type]
        _assert_param_invalid(ei)
    with pytest.raises(LLMException):
        KvCache.create_cpu_cache(CacheDesc(2, [4], DataType.DT_FLOAT), [1, 2])
    for wrong in ((1, 2), [1, "2"], [[1, "2"]], ["a", "b"]):
        with pytest.raises(TypeError):
            KvCache.create_cpu_cache(desc, wrong)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- MemInfo


def test_mem_info():
    info = MemInfo(Memtype.MEM_TYPE_DEVICE, 0x1000, 4096)
    assert info.mem_type is Memtype.MEM_TYPE_DEVICE
    assert info.addr == 0x1000
    assert info.size == 4096
    assert repr(info) == "MemInfo(mem_type=Memtype.MEM_TYPE_DEVICE, addr=4096, size=4096)"
    for args in ((0, 1, 1), (Memtype.MEM_TYPE_HOST, "1", 1), (Memtype.MEM_TYPE_HOST, 1, 1.0), (None, 1, 1)):
        with pytest.raises(TypeError):
            MemInfo(*args)


# ---------------------------------------------------------------------------- TransferConfig


def test_transfer_config():
    cfg = TransferConfig(1, [10, 20])
    assert cfg.dst_cluster_id == 1
    assert cfg.dst_addrs == [10, 20]
    assert cfg.src_layer_range is None
    assert cfg.src_batch_index == 0
    assert cfg.dst_layer_range is None
    cfg = TransferConfig(2, (1, 2, 3, 4), range(0, 2), 3)  # type: ignore[arg-type]
    assert cfg.src_layer_range == range(0, 2)
    assert cfg.src_batch_index == 3
    cfg.dst_cluster_id = 5
    cfg.dst_addrs = [7, 8]
    cfg.src_layer_range = range(1, 2)
    cfg.src_batch_index = 1
    cfg.dst_layer_range = range(0, 1)  # plain attribute
    assert (cfg.dst_cluster_id, cfg.dst_addrs, cfg.src_layer_range, cfg.src_batch_index) == (
        5, [7, 8], range(1, 2), 1)
    assert "TransferConfig(dst_cluster_id=5" in repr(cfg)
    cfg.src_layer_range = None
    assert cfg.src_layer_range is None


def test_transfer_config_errors():
    with pytest.raises(TypeError):
        TransferConfig("1", [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TransferConfig(-1, [1])
    with pytest.raises(TypeError):
        TransferConfig(1, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TransferConfig(1, [1, "2"])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        TransferConfig(1, [1, -2])
    with pytest.raises(TypeError):
        TransferConfig(1, [1], [0, 1])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TransferConfig(1, [1], None, -1)
    for bad in (range(0, 4, 2), range(2, 2), range(3, 1), range(-1, 1)):
        with pytest.raises(LLMException) as ei:
            TransferConfig(1, [1], bad)
        _assert_param_invalid(ei)
    cfg = TransferConfig(1, [1])
    with pytest.raises(ValueError):
        cfg.dst_cluster_id = 2**64
    with pytest.raises(TypeError):
        cfg.dst_addrs = 5  # type: ignore[assignment]
    with pytest.raises(LLMException):
        cfg.src_layer_range = range(1, 0)
    with pytest.raises(ValueError):
        cfg.src_batch_index = 2**32


# ---------------------------------------------------------------------------- TransferWithCacheKeyConfig


def test_transfer_with_cache_key_config():
    key = CacheKeyByIdAndIndex(7, 1, 2)
    cfg = TransferWithCacheKeyConfig(key, range(0, 2), range(2, 4), 1)
    assert cfg.cache_key is key
    assert cfg.src_layer_range == range(0, 2)
    assert cfg.dst_layer_range == range(2, 4)
    assert cfg.src_batch_index == 1
    assert cfg.dst_cluster_id == 7
    assert "TransferWithCacheKeyConfig(cache_key=CacheKeyByIdAndIndex(cluster_id=7" in repr(cfg)
    bkey = BlocksCacheKey(9, 1)
    bcfg = TransferWithCacheKeyConfig(bkey, range(0, 1), range(0, 1))
    assert bcfg.dst_cluster_id == 9
    assert bcfg.src_batch_index == 0
    cfg.src_batch_index = 0
    cfg.cache_key = bkey
    assert cfg.dst_cluster_id == 9
    with pytest.raises(LLMException):
        cfg.src_batch_index = 1
    cfg.src_layer_range = range(1, 3)
    cfg.dst_layer_range = range(0, 2)


def test_transfer_with_cache_key_config_errors():
    key = CacheKeyByIdAndIndex(7, 1)
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(key)
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(key, range(0, 1))
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(key, None, range(0, 1))
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(CacheKey(1, 2), range(0, 1), range(0, 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(None, range(0, 1), range(0, 1))  # type: ignore[arg-type]
    for src, dst in ((range(0, 2), range(0, 3)), (range(0, 4, 2), range(0, 2)), (range(1, 1), range(0, 0))):
        with pytest.raises(LLMException) as ei:
            TransferWithCacheKeyConfig(key, src, dst)
        _assert_param_invalid(ei)
    # dst length must equal src length even when starts differ
    with pytest.raises(LLMException):
        TransferWithCacheKeyConfig(key, range(1, 3), range(2, 3))
    with pytest.raises(LLMException) as ei:
        TransferWithCacheKeyConfig(BlocksCacheKey(1), range(0, 1), range(0, 1), 1)
    _assert_param_invalid(ei)
    with pytest.raises(ValueError):
        TransferWithCacheKeyConfig(key, range(0, 1), range(0, 1), -1)
    cfg = TransferWithCacheKeyConfig(key, range(0, 1), range(0, 1), 3)
    with pytest.raises(LLMException):
        cfg.cache_key = BlocksCacheKey(1)
    with pytest.raises(TypeError):
        cfg.cache_key = None  # type: ignore[assignment]
    with pytest.raises(TypeError):
        cfg.src_layer_range = None  # type: ignore[assignment]
    with pytest.raises(LLMException):
        cfg.dst_layer_range = range(0, 2, 2)


# ---------------------------------------------------------------------------- LayerSynchronizer


def test_layer_synchronizer_abc():
    with pytest.raises(TypeError):
        LayerSynchronizer()  # type: ignore[abstract]

    class Sync(LayerSynchronizer):
        def __init__(self):
            self.calls = []

        def synchronize_layer(self, layer_index, timeout_in_millis):
            self.calls.append((layer_index, timeout_in_millis))
            return True

    s = Sync()
    assert s.synchronize_layer(0, None) is True
    assert s.calls == [(0, None)]
