"""Property tests (hypothesis) of the Python API's argument checks (llm_datadist_api.md §3.2, docs/compatibility.md).

For arbitrary values, of the right type or not, in range or not, each constructor and setter below
either accepts them or raises exactly the documented error, in the documented order of checks:
``TypeError`` for a wrong type, ``ValueError`` for an int outside its C range,
``LLMException(LLM_PARAM_INVALID)`` for a semantic problem (and, where llm_datadist_api.md §5 says so, a plain
``RuntimeError`` for an IP string that cannot be parsed). Each test predicts the outcome from those
rules and checks that exactly that happens; any other exception fails the test.
Also: ``generate_options()`` carries every property back out (llm_datadist_api.md §4.1), and ``code_2_status`` is
total over integers.
"""

from __future__ import annotations

import json
import socket

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from llm_datadist.status import code_2_status

# Modest example counts keep the whole file at a few seconds; no example database in the tree.
PROPS = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

PARAM_INVALID = "LLMException(LLM_PARAM_INVALID)"

RANGES = {
    "uint16": (0, 2**16 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "uint32": (0, 2**32 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "uint64": (0, 2**64 - 1),
}
EDGES = sorted({v for lo, hi in RANGES.values() for v in (lo, hi, lo - 1, hi + 1)} | {0, 1, -1})

# ------------------------------------------------------------------------------------- strategies

ints = st.one_of(st.sampled_from(EDGES), st.integers(-(2**70), 2**70), st.integers(-3, 300))
not_ints = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.binary(max_size=4),
    st.lists(st.integers(0, 9), max_size=3),
    st.tuples(st.integers(0, 9)),
    st.dictionaries(st.text(max_size=2), st.integers(0, 9), max_size=2),
    st.sampled_from([object(), 1j, DataType.DT_FLOAT, range(3)]),
)
int_enums = st.sampled_from([LLMRole.PROMPT, LLMRole.MIX, Placement.HOST, LLMStatusCode.LLM_SUCCESS])
anything = st.one_of(ints, ints, not_ints, int_enums)  # ints twice: valid values come up often


def mostly(good, bad=anything):
    """Values that are usually valid (7 in 8, so that later checks are reached), sometimes anything."""
    return st.sampled_from(range(8)).flatmap(lambda i: bad if i == 0 else good)


u64 = st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 9))


def is_int(v) -> bool:
    """What the checks accept as an int: any int (IntEnum members too) except bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def int_error(v, kind):
    """The error of check_<kind>(v): TypeError, ValueError or None."""
    if not is_int(v):
        return TypeError
    lo, hi = RANGES[kind]
    return None if lo <= v <= hi else ValueError


def first(*errors):
    """The first error of checks made in this order."""
    return next((e for e in errors if e is not None), None)


def outcome(fn, *args, **kwargs):
    """What calling fn did: None, TypeError, ValueError, PARAM_INVALID or RuntimeError. Anything
    else (another exception, another status code) fails the test."""
    try:
        fn(*args, **kwargs)
    except LLMException as e:
        assert e.status_code == LLMStatusCode.LLM_PARAM_INVALID, f"LLMException with {e.status_code}: {e}"
        return PARAM_INVALID
    except (TypeError, ValueError) as e:
        return TypeError if isinstance(e, TypeError) else ValueError
    except RuntimeError as e:
        assert type(e) is RuntimeError, f"{type(e).__name__}: {e}"
        return RuntimeError
    return None


def check(expected, fn, *args, **kwargs):
    got = outcome(fn, *args, **kwargs)
    assert got == expected, f"expected {expected}, got {got} for args={args!r} kwargs={kwargs!r}"


# ------------------------------------------------------------------------------------- keys


def expected_key_params(args, kwargs, names):
    """Spec 7.2/7.4 plus pdlink's decision on repeated params: (error, params, cluster keyword)."""
    if len(args) + len(kwargs) > len(names):
        return PARAM_INVALID, None, None
    if any(k not in ("prompt_cluster_id",) + names for k in kwargs):
        return PARAM_INVALID, None, None
    params = dict(zip(names, args))
    cluster_name = "cluster_id"
    if "cluster_id" not in params and "cluster_id" not in kwargs and "prompt_cluster_id" in kwargs:
        cluster_name = "prompt_cluster_id"
    for k, v in kwargs.items():
        canonical = "cluster_id" if k == "prompt_cluster_id" else k
        if canonical in params:
            if not (params[canonical] == v and type(params[canonical]) is type(v)):
                return PARAM_INVALID, None, None
            continue
        params[canonical] = v
    if "cluster_id" not in params:
        return PARAM_INVALID, None, None
    return None, params, cluster_name


KEY_NAMES = st.sampled_from(["cluster_id", "prompt_cluster_id", "req_id", "model_id", "prefix_id", "bogus"])


@PROPS
@given(args=st.lists(mostly(u64), max_size=4), kwargs=st.dictionaries(KEY_NAMES, mostly(u64), max_size=2))
def test_cache_key(args, kwargs):
    err, params, _ = expected_key_params(args, kwargs, ("cluster_id", "req_id", "model_id", "prefix_id"))
    if err is None and "req_id" not in params:
        err = PARAM_INVALID
    if err is None:
        values = (params["cluster_id"], params["req_id"], params.get("model_id", 0), params.get("prefix_id", 2**64 - 1))
        err = first(*(int_error(v, "uint64") for v in values))
    check(err, CacheKey, *args, **kwargs)
    if err is None:
        key = CacheKey(*args, **kwargs)
        assert (key.cluster_id, key.req_id, key.model_id) == (params["cluster_id"], params["req_id"],
                                                              params.get("model_id", 0))
        assert key.prefix_id == params.get("prefix_id", 2**64 - 1)
        assert key == CacheKey(*args, **kwargs) and hash(key) == hash(CacheKey(*args, **kwargs))


@PROPS
@given(args=st.lists(mostly(ints), max_size=2),
       kwargs=st.dictionaries(st.sampled_from(["cluster_id", "prompt_cluster_id", "model_id", "req_id"]),
                              mostly(ints), max_size=2))
def test_blocks_cache_key(args, kwargs):
    err, params, cluster_name = expected_key_params(args, kwargs, ("cluster_id", "model_id"))
    if err is None:  # type-checked as int only, no range check (llm_datadist_api.md §7.4)
        err = first(None if is_int(params["cluster_id"]) else TypeError,
                    None if is_int(params.get("model_id", 0)) else TypeError)
    check(err, BlocksCacheKey, *args, **kwargs)
    if err is None:
        key = BlocksCacheKey(*args, **kwargs)
        assert (key.cluster_id, key.model_id) == (params["cluster_id"], params.get("model_id", 0))
        assert repr(key).startswith(f"BlocksCacheKey({cluster_name}=")


@PROPS
@given(cluster_id=mostly(ints), cache_id=mostly(ints), batch_index=mostly(ints, st.one_of(anything, st.none())),
       pass_index=st.booleans())
def test_cache_key_by_id_and_index(cluster_id, cache_id, batch_index, pass_index):
    args = (cluster_id, cache_id, batch_index) if pass_index else (cluster_id, cache_id)
    err = first(int_error(cluster_id, "uint64"), int_error(cache_id, "int64"),
                int_error(batch_index if pass_index else 0, "uint32"))
    check(err, CacheKeyByIdAndIndex, *args)


# ------------------------------------------------------------------------------------- CacheDesc

good_shapes = st.lists(st.integers(0, 64), min_size=1, max_size=4)
shapes = mostly(st.one_of(good_shapes, good_shapes.map(tuple)),
                st.one_of(st.lists(st.one_of(st.integers(0, 9), anything), max_size=4),
                          st.lists(ints, max_size=3), not_ints))


@PROPS
@given(num_tensors=mostly(st.integers(0, 8)), shape=shapes, data_type=mostly(st.sampled_from(list(DataType))),
       placement=mostly(st.sampled_from(list(Placement))), batch_dim=mostly(st.integers(-1, 4)),
       seq_dim=mostly(st.integers(-2, 4)), fmt=mostly(st.one_of(st.none(), st.text(max_size=4))))
def test_cache_desc(num_tensors, shape, data_type, placement, batch_dim, seq_dim, fmt):
    is_shape = isinstance(shape, (list, tuple)) and all(is_int(d) for d in shape)
    err = first(
        int_error(num_tensors, "uint32"),
        None if is_shape else TypeError,
        None if isinstance(data_type, DataType) else TypeError,
        None if isinstance(placement, Placement) else TypeError,
        int_error(batch_dim, "int32"),
        int_error(seq_dim, "int32"),
        None if fmt is None or isinstance(fmt, str) else TypeError,
    )
    if err is None:
        err = first(
            None if 0 <= batch_dim < len(shape) else PARAM_INVALID,
            None if seq_dim == -1 or 0 <= seq_dim < len(shape) else PARAM_INVALID,
            first(*(int_error(d, "int64") for d in shape)),
        )
    check(err, CacheDesc, num_tensors, shape, data_type, placement, batch_dim, seq_dim, fmt)
    if err is None:
        desc = CacheDesc(num_tensors, shape, data_type, placement, batch_dim, seq_dim, fmt)
        assert desc.shape is shape and desc.batch_size == shape[batch_dim]
        # size: prod(shape) * itemsize, or LLMException(PARAM_INVALID) when not computable
        total = {DataType.DT_FLOAT: 4, DataType.DT_INT8: 1, DataType.DT_UINT8: 1, DataType.DT_BOOL: 1,
                 DataType.DT_INT32: 4, DataType.DT_UINT32: 4, DataType.DT_INT64: 8, DataType.DT_UINT64: 8,
                 DataType.DT_DOUBLE: 8}.get(data_type, 2)
        for d in shape:
            total *= d
        computable = data_type is not DataType.DT_STRING and min(shape) >= 0 and total < 2**63
        if computable:
            assert desc.size == total
        else:
            check(PARAM_INVALID, lambda: desc.size)


# ------------------------------------------------------------------------------------- LLMConfig

STR_PROPS = ["listen_ip_info", "deploy_res_path", "buf_pool_cfg", "mem_pool_cfg", "host_mem_pool_cfg",
             "local_comm_res", "transfer_backend", "global_resource_config"]
BOOL_PROPS = ["enable_switch_role", "enable_cache_manager", "enable_remote_cache_accessible"]


def expected_config_error(name, v):
    """Spec 4.1 (and the [INF] decisions in configs.py) for `cfg.<name> = v`."""
    if name in STR_PROPS:
        return None if v is None or isinstance(v, str) else TypeError
    if name in BOOL_PROPS:
        return None if v is None or isinstance(v, bool) else TypeError
    if name == "output_max_size":
        return None if v is None or is_int(v) else TypeError
    if name in ("rdma_traffic_class", "rdma_service_level"):
        return None if v is None else int_error(v, "uint32")
    if name == "mem_utilization":
        if not isinstance(v, float):
            return TypeError
        return None if 0.0 <= v <= 1.0 else PARAM_INVALID
    if name in ("link_total_time", "link_retry_count"):
        if v is None:
            return None
        if not is_int(v):
            return TypeError
        lo, hi = (0, 2**32 - 1) if name == "link_total_time" else (1, 100)
        return None if lo <= v <= hi else PARAM_INVALID
    if name == "sync_kv_timeout":
        if v is None:
            return None
        if not (is_int(v) or isinstance(v, str)):
            return TypeError
        if isinstance(v, str) and not (v.isascii() and v.isdigit()):
            return PARAM_INVALID
        value = int(v)
        return PARAM_INVALID if value <= 0 else int_error(value, "int32")
    if name == "device_id":
        if v is None:
            return None
        if not (is_int(v) or isinstance(v, (list, tuple))):
            return TypeError
        if is_int(v):
            return PARAM_INVALID if v < 0 else int_error(v, "int32")
        if not all(is_int(d) for d in v):
            return TypeError
        if not v:
            return PARAM_INVALID
        return first(*((PARAM_INVALID if d < 0 else int_error(d, "int32")) for d in v))
    if name == "ge_options":
        if v is None:
            return None
        if not isinstance(v, dict):
            return TypeError
        return None if all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()) else TypeError
    if name == "cluster_info":
        if v is None:
            return None
        if not isinstance(v, str):
            return TypeError
        try:
            parsed = json.loads(v)
        except ValueError:
            return ValueError  # json.JSONDecodeError, as the reference
        if not isinstance(parsed, dict):
            return PARAM_INVALID
        ip_infos = parsed.get("listen_ip_info")
        for info in ip_infos if isinstance(ip_infos, list) else []:
            if isinstance(info, dict) and isinstance(info.get("ip"), str):
                try:
                    socket.inet_aton(info["ip"])
                except (OSError, ValueError):
                    return RuntimeError  # "Can not parse ip str" (llm_datadist_api.md §5)
        return None
    raise AssertionError(name)


GOOD_CONFIG = {
    **{name: st.one_of(st.text(max_size=6), st.none()) for name in STR_PROPS},
    **{name: st.one_of(st.booleans(), st.none()) for name in BOOL_PROPS},
    "output_max_size": st.one_of(ints, st.none()),
    "rdma_traffic_class": st.one_of(ints, st.none()),
    "rdma_service_level": st.one_of(ints, st.none()),
    "mem_utilization": st.floats(-0.5, 1.5),
    "link_total_time": st.one_of(ints, st.integers(-1, 2**32)),
    "link_retry_count": st.integers(-1, 102),
    "sync_kv_timeout": st.one_of(ints, st.text(alphabet="0123456789-+ ", max_size=4), st.integers(-2, 2**31 + 1)),
    "device_id": st.one_of(st.integers(-2, 8), ints, st.lists(st.one_of(st.integers(-1, 8), ints), max_size=3),
                           st.lists(st.integers(-1, 8), max_size=3).map(tuple)),
    "ge_options": st.dictionaries(st.one_of(st.text(max_size=3), ints), st.one_of(st.text(max_size=3), ints),
                                  max_size=2),
    "cluster_info": st.one_of(st.text(max_size=4), st.builds(json.dumps, st.one_of(
        st.integers(), st.lists(st.integers(), max_size=2),
        st.fixed_dictionaries({"listen_ip_info": st.lists(st.fixed_dictionaries(
            {"ip": st.one_of(st.sampled_from(["1.2.3.4", "127.0.0.1", "300.1.1.1", "x"]), st.integers(0, 9))}),
            max_size=2)})))),
}


@PROPS
@given(data=st.data(), name=st.sampled_from(sorted(GOOD_CONFIG)))
def test_llm_config_setters(data, name):
    value = data.draw(mostly(GOOD_CONFIG[name]), label=name)
    cfg = LLMConfig()
    err = expected_config_error(name, value)
    check(err, setattr, cfg, name, value)
    if err is None:
        cfg.generate_options()  # whatever was accepted can be emitted


# ------------------------------------------------------------------------------------- options

# Emission order of llm_datadist_api.md §4.1, as option keys.
OPTION_ORDER = ["ge.exec.deviceId", "ge.session_device_id", "llm.SyncKvCacheWaitTime", "llm.deployResPath",
                "llm.BufPoolCfg", "llm.MemPoolConfig", "llm.HostMemPoolConfig", "llm.EnableCacheManager",
                "llm.EnableRemoteCacheAccessible", "llm.listenIpInfo", "llm.LinkTotalTime", "llm.LinkRetryCount",
                "llm.RdmaTrafficClass", "llm.RdmaServiceLevel", "llm.LocalCommRes", "llm.TransferBackend",
                "llm.GlobalResourceConfig", "llm.ClusterInfo", "llm.OutputMaxSize", "llm.EnableSwitchRole",
                "llm.MemoryUtilization"]
RANK = {key: i for i, key in enumerate(OPTION_ORDER)}
RANK["ge.session_device_id"] = RANK["ge.exec.deviceId"]  # one group; a list emits session_device_id first
option_text = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=8)
valid_config = st.fixed_dictionaries({}, optional={
    "device_id": st.one_of(st.integers(0, 2**31 - 1), st.lists(st.integers(0, 7), min_size=1, max_size=4)),
    "sync_kv_timeout": st.one_of(st.integers(1, 2**31 - 1), st.integers(1, 99999).map(str)),
    "deploy_res_path": option_text,
    "buf_pool_cfg": option_text,
    "mem_pool_cfg": option_text,
    "host_mem_pool_cfg": option_text,
    "enable_cache_manager": st.booleans(),
    "enable_remote_cache_accessible": st.booleans(),
    "listen_ip_info": option_text,
    "link_total_time": st.integers(0, 2**32 - 1),
    "link_retry_count": st.integers(1, 100),
    "rdma_traffic_class": st.integers(0, 2**32 - 1),
    "rdma_service_level": st.integers(0, 2**32 - 1),
    "local_comm_res": st.text(max_size=6),
    "transfer_backend": st.text(max_size=6),
    "global_resource_config": st.text(max_size=6),
    "output_max_size": st.integers(-(2**40), 2**40),
    "enable_switch_role": st.booleans(),
    "mem_utilization": st.floats(0.0, 1.0),
    "ge_options": st.dictionaries(st.sampled_from(["ge.flowGraphMemMaxSize", "ge.x", "ge.y"]), option_text,
                                  max_size=2),
})


def parse_options(opts):
    """Spec 4.1 backwards: the properties an option dict describes."""
    props = {}
    if "ge.exec.deviceId" in opts:
        ids = [int(x) for x in opts["ge.exec.deviceId"].split(";")]
        props["device_id"] = ids if len(ids) > 1 else ids[0]  # [5] and 5 give the same options
        assert opts["ge.session_device_id"] == str(ids[0])
    simple = {"llm.SyncKvCacheWaitTime": "sync_kv_timeout", "llm.deployResPath": "deploy_res_path",
              "llm.BufPoolCfg": "buf_pool_cfg", "llm.MemPoolConfig": "mem_pool_cfg",
              "llm.HostMemPoolConfig": "host_mem_pool_cfg", "llm.listenIpInfo": "listen_ip_info",
              "llm.LinkTotalTime": "link_total_time", "llm.LinkRetryCount": "link_retry_count",
              "llm.RdmaTrafficClass": "rdma_traffic_class", "llm.RdmaServiceLevel": "rdma_service_level",
              "llm.LocalCommRes": "local_comm_res", "llm.TransferBackend": "transfer_backend",
              "llm.GlobalResourceConfig": "global_resource_config", "llm.OutputMaxSize": "output_max_size",
              "llm.MemoryUtilization": "mem_utilization"}
    for key, name in simple.items():
        if key in opts:
            props[name] = opts[key]
    for key, name in (("llm.EnableCacheManager", "enable_cache_manager"),
                      ("llm.EnableRemoteCacheAccessible", "enable_remote_cache_accessible"),
                      ("llm.EnableSwitchRole", "enable_switch_role")):
        if key in opts:
            assert opts[key] in ("0", "1")
            props[name] = opts[key] == "1"
    return props


@PROPS
@given(config=valid_config)
def test_generate_options_round_trips(config):
    cfg = LLMConfig()
    for name, value in config.items():
        setattr(cfg, name, value)
    opts = cfg.generate_options()
    assert opts is cfg.generate_options() is cfg.options  # the same dict, and a second call changes nothing
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in opts.items())
    ge = config.get("ge_options", {})
    assert list(opts)[:len(ge)] == list(ge) and all(opts[k] == v for k, v in ge.items())  # copied first
    ours = [k for k in opts if k not in ge]
    assert ours == sorted(ours, key=RANK.__getitem__)  # every other key, in the documented order

    props = parse_options({k: v for k, v in opts.items() if k not in ge})
    expected = {k: v for k, v in config.items() if k != "ge_options"}
    expected.setdefault("mem_utilization", 0.95)  # always emitted
    if expected.get("enable_switch_role") is False:
        del expected["enable_switch_role"]  # emitted only when True
    assert set(props) == set(expected), (props, expected)
    for name, value in expected.items():
        got = props[name]
        if name == "device_id":
            assert got == value or (isinstance(value, list) and len(value) == 1 and got == value[0]), (got, value)
        elif isinstance(value, bool):
            assert got is value
        elif isinstance(value, float):
            assert float(got) == value
        else:
            assert got == str(value)
        # and the getter gives back what was set
        if name in config:
            assert getattr(cfg, name) == value


# ------------------------------------------------------------------------------------- LLMClusterInfo


def expected_ip_error(ip, port):
    if not (isinstance(ip, str) or is_int(ip)):
        return TypeError
    err = int_error(port, "uint16")
    if err:
        return err
    if isinstance(ip, str):
        try:
            return int_error(int.from_bytes(socket.inet_aton(ip), "little"), "uint32")
        except (OSError, ValueError):
            return RuntimeError  # "Can not parse ip str:..." (llm_datadist_api.md §5)
    return int_error(ip, "uint32")


ips = st.one_of(st.sampled_from(["127.0.0.1", "1.2.3.4", "1", "0x7f.1", "256.0.0.1", "", "a.b", "1.2.3.4\x00"]),
                st.ip_addresses(v=4).map(str), st.text(max_size=8), st.integers(-1, 2**32))


@PROPS
@given(remote_id=mostly(u64), role=mostly(st.one_of(st.sampled_from(list(LLMRole)), st.none())), ip=mostly(ips),
       port=mostly(st.integers(-2, 70000)), local=st.booleans())
def test_llm_cluster_info(remote_id, role, ip, port, local):
    info = LLMClusterInfo()
    check(int_error(remote_id, "uint64"), setattr, info, "remote_cluster_id", remote_id)
    check(None if role is None or is_int(role) else TypeError, setattr, info, "remote_role_type", role)
    append = info.append_local_ip_info if local else info.append_remote_ip_info
    err = expected_ip_error(ip, port)
    check(err, append, ip, port)
    listed = info.local_ip_info_list if local else info.remote_ip_info_list
    if err is None:
        ip_int = int.from_bytes(socket.inet_aton(ip), "little") if isinstance(ip, str) else ip
        assert listed == [(ip_int, port)]
    else:
        assert listed == []  # a refused address is not half-added


# ------------------------------------------------------------------------------------- code_2_status

KNOWN = {int(m): m for m in LLMStatusCode if m is not LLMStatusCode.LLM_UNKNOWN_ERROR}


@PROPS
@given(code=st.one_of(st.sampled_from(sorted(KNOWN)), ints, st.integers(0x5010B000, 0x5010B030), int_enums))
def test_code_2_status_is_total_over_integers(code):
    status = code_2_status(code)
    assert isinstance(status, LLMStatusCode)
    assert status is KNOWN.get(int(code), LLMStatusCode.LLM_FAILED)
