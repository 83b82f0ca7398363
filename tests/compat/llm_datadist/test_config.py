"""Tests for pdlink.compat.llm_datadist.configs: LLMRole, LLMClusterInfo, LlmConfig/LLMConfig."""

import json
from enum import IntEnum

import pytest

from internals import ip_to_int, role_to_option
from llm_datadist import LLMClusterInfo, LLMConfig, LlmConfig, LLMRole
from pdlink import LLMException, LLMStatusCode


def _param_invalid(excinfo):
    return excinfo.value.status_code is LLMStatusCode.LLM_PARAM_INVALID


# ---------------------------------------------------------------------------- LLMRole


def test_llm_role_values_and_str():
    assert issubclass(LLMRole, IntEnum)
    assert (LLMRole.PROMPT, LLMRole.DECODER, LLMRole.MIX) == (1, 2, 3)
    assert str(LLMRole.PROMPT) == "LLMRole.PROMPT"
    assert str(LLMRole.DECODER) == "LLMRole.DECODER"
    assert str(LLMRole.MIX) == "LLMRole.MIX"
    assert f"{LLMRole.MIX}" == "LLMRole.MIX"


def test_role_to_option():
    assert role_to_option(LLMRole.PROMPT) == "Prompt"
    assert role_to_option(LLMRole.DECODER) == "Decoder"
    assert role_to_option(LLMRole.MIX) == "Mix"
    assert role_to_option(2) == "Decoder"
    with pytest.raises(TypeError):
        role_to_option("Prompt")  # type: ignore[arg-type]
    with pytest.raises(LLMException) as ei:
        role_to_option(7)
    assert _param_invalid(ei)


# ---------------------------------------------------------------------------- LLMClusterInfo


def test_ip_to_int():
    assert ip_to_int("1.2.3.4") == 67305985
    assert ip_to_int("127.0.0.1") == 16777343
    assert ip_to_int(12345) == 12345
    with pytest.raises(RuntimeError, match=r"^Can not parse ip str:1\.2\.3\.400$"):
        ip_to_int("1.2.3.400")
    with pytest.raises(RuntimeError, match="Can not parse ip str:"):
        ip_to_int("not an ip")


def test_cluster_info_defaults():
    info = LLMClusterInfo()
    assert info.remote_cluster_id is None
    assert info.remote_role_type is None
    assert info.local_ip_info_list == []
    assert info.remote_ip_info_list == []


def test_cluster_info_ip_lists():
    info = LLMClusterInfo()
    info.remote_cluster_id = 2
    info.remote_role_type = LLMRole.PROMPT
    info.append_local_ip_info("1.2.3.4", 26000)
    info.append_remote_ip_info("1.2.3.4", 0)
    info.append_remote_ip_info(67305985, 65535)
    assert info.remote_cluster_id == 2
    assert info.remote_role_type is LLMRole.PROMPT
    assert info.local_ip_info_list == [(67305985, 26000)]
    assert info.remote_ip_info_list == [(67305985, 0), (67305985, 65535)]
    assert all(isinstance(t, tuple) for t in info.remote_ip_info_list)
    with pytest.raises(AttributeError):
        info.local_ip_info_list = []  # type: ignore[misc]
    with pytest.raises(AttributeError):
        info.remote_ip_info_list = []  # type: ignore[misc]


def test_cluster_info_validation():
    info = LLMClusterInfo()
    with pytest.raises(TypeError, match=r"remote_cluster_id only support \['int'\], but got <class 'str'>\."):
        info.remote_cluster_id = "1"  # type: ignore[assignment]
    with pytest.raises(TypeError):
        info.remote_cluster_id = True
    with pytest.raises(TypeError):
        info.remote_cluster_id = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"^remote_cluster_id's value is out of range,-1 is not a uint64 value\.$"):
        info.remote_cluster_id = -1
    with pytest.raises(ValueError):
        info.remote_cluster_id = 2**64
    info.remote_cluster_id = 2**64 - 1
    info.remote_role_type = 2
    assert info.remote_role_type == 2
    with pytest.raises(TypeError):
        info.remote_role_type = "PROMPT"  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"ip only support \['str', 'int'\]"):
        info.append_local_ip_info(1.5, 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"port's value is out of range,65536 is not a uint16 value\."):
        info.append_local_ip_info("1.2.3.4", 65536)
    with pytest.raises(ValueError):
        info.append_remote_ip_info("1.2.3.4", -1)
    with pytest.raises(TypeError):
        info.append_remote_ip_info("1.2.3.4", "80")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="Can not parse ip str:abc"):
        info.append_remote_ip_info("abc", 80)
    assert info.local_ip_info_list == []
    assert info.remote_ip_info_list == []


# ---------------------------------------------------------------------------- LlmConfig


def test_alias_is_same_class():
    assert LLMConfig is LlmConfig


def test_default_options():
    assert LLMConfig().generate_options() == {"llm.MemoryUtilization": "0.95"}
    assert LLMConfig().gen_options() == {"llm.MemoryUtilization": "0.95"}


def test_spec_example_options_and_order():
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.sync_kv_timeout = 5000
    cfg.enable_switch_role = True
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.listen_ip_info = "1.2.3.4:26000"
    opts = cfg.generate_options()
    expected = [
        ("ge.exec.deviceId", "0"),
        ("ge.session_device_id", "0"),
        ("llm.SyncKvCacheWaitTime", "5000"),
        ("llm.EnableCacheManager", "1"),
        ("llm.EnableRemoteCacheAccessible", "1"),
        ("llm.listenIpInfo", "1.2.3.4:26000"),
        ("llm.EnableSwitchRole", "1"),
        ("llm.MemoryUtilization", "0.95"),
    ]
    assert list(opts.items()) == expected


def test_full_emission_order():
    cfg = LLMConfig()
    cfg.ge_options = {"ge.flowGraphMemMaxSize": "1024", "ge.other": "x"}
    cfg.device_id = 3
    cfg.sync_kv_timeout = "1000"
    cfg.deploy_res_path = "res"
    cfg.buf_pool_cfg = '{"buf_cfg":[]}'
    cfg.mem_pool_cfg = '{"memory_size": 1024}'
    cfg.host_mem_pool_cfg = '{"memory_size": 2048}'
    cfg.enable_cache_manager = False
    cfg.enable_remote_cache_accessible = False
    cfg.listen_ip_info = "0.0.0.0:1"
    cfg.link_total_time = 10
    cfg.link_retry_count = 3
    cfg.rdma_traffic_class = 132
    cfg.rdma_service_level = 4
    cfg.local_comm_res = ""
    cfg.transfer_backend = "hixl"
    cfg.global_resource_config = "{}"
    cfg.cluster_info = '{"cluster_id": 1}'
    cfg.output_max_size = 64
    cfg.enable_switch_role = True
    cfg.mem_utilization = 0.5
    opts = cfg.generate_options()
    assert list(opts.keys()) == [
        "ge.flowGraphMemMaxSize",
        "ge.other",
        "ge.exec.deviceId",
        "ge.session_device_id",
        "llm.SyncKvCacheWaitTime",
        "llm.deployResPath",
        "llm.BufPoolCfg",
        "llm.MemPoolConfig",
        "llm.HostMemPoolConfig",
        "llm.EnableCacheManager",
        "llm.EnableRemoteCacheAccessible",
        "llm.listenIpInfo",
        "llm.LinkTotalTime",
        "llm.LinkRetryCount",
        "llm.RdmaTrafficClass",
        "llm.RdmaServiceLevel",
        "llm.LocalCommRes",
        "llm.TransferBackend",
        "llm.GlobalResourceConfig",
        "llm.ClusterInfo",
        "llm.OutputMaxSize",
        "llm.EnableSwitchRole",
        "llm.MemoryUtilization",
    ]
    assert opts["ge.exec.deviceId"] == "3"
    assert opts["ge.session_device_id"] == "3"
    assert opts["llm.SyncKvCacheWaitTime"] == "1000"
    assert opts["llm.deployResPath"] == "res"
    assert opts["llm.EnableCacheManager"] == "0"
    assert opts["llm.EnableRemoteCacheAccessible"] == "0"
    assert opts["llm.LinkTotalTime"] == "10"
    assert opts["llm.LinkRetryCount"] == "3"
    assert opts["llm.RdmaTrafficClass"] == "132"
    assert opts["llm.RdmaServiceLevel"] == "4"
    assert opts["llm.LocalCommRes"] == ""
    assert opts["llm.TransferBackend"] == "hixl"
    assert opts["llm.GlobalResourceConfig"] == "{}"
    assert opts["llm.ClusterInfo"] == '{"cluster_id": 1}'
    assert opts["llm.OutputMaxSize"] == "64"
    assert opts["llm.MemoryUtilization"] == "0.5"
    assert all(isinstance(v, str) for v in opts.values())


def test_device_id_list():
    cfg = LLMConfig()
    cfg.device_id = [0, 1]
    opts = cfg.generate_options()
    assert opts["ge.exec.deviceId"] == "0;1"
    assert opts["ge.session_device_id"] == "0"
    cfg2 = LLMConfig()
    cfg2.device_id = (2, 5, 7)
    assert cfg2.device_id == (2, 5, 7)
    opts2 = cfg2.generate_options()
    assert opts2["ge.exec.deviceId"] == "2;5;7"
    assert opts2["ge.session_device_id"] == "2"


def test_same_dict_returned_and_accumulates():
    cfg = LLMConfig()
    first = cfg.generate_options()
    assert first is cfg.options
    cfg.listen_ip_info = "1.1.1.1:1"
    second = cfg.gen_options()
    assert second is first
    assert first["llm.listenIpInfo"] == "1.1.1.1:1"
    # Keys are never removed, even if the property is cleared.
    cfg.listen_ip_info = ""
    cfg.generate_options()
    assert "llm.listenIpInfo" in cfg.options


def test_options_read_only():
    cfg = LLMConfig()
    with pytest.raises(AttributeError):
        cfg.options = {}  # type: ignore[misc]


def test_getter_defaults():
    cfg = LLMConfig()
    assert cfg.device_id is None
    assert cfg.sync_kv_timeout is None
    assert cfg.listen_ip_info == ""
    assert cfg.deploy_res_path == ""
    assert cfg.ge_options == {}
    assert cfg.enable_switch_role is False
    assert cfg.link_total_time == 0
    assert cfg.link_retry_count == 1
    assert cfg.cluster_info == ""
    assert cfg.output_max_size is None
    assert cfg.mem_utilization == 0.95
    assert cfg.buf_pool_cfg == ""
    assert cfg.mem_pool_cfg == ""
    assert cfg.host_mem_pool_cfg == ""
    assert cfg.enable_cache_manager is False
    assert cfg.enable_remote_cache_accessible is False
    assert cfg.rdma_traffic_class is None
    assert cfg.rdma_service_level is None
    assert cfg.local_comm_res == ""
    assert cfg.transfer_backend == ""
    assert cfg.global_resource_config == ""


def test_unset_getter_defaults_not_emitted():
    cfg = LLMConfig()
    # reading defaults does not make them "set"
    _ = (cfg.link_total_time, cfg.link_retry_count, cfg.local_comm_res, cfg.enable_cache_manager)
    assert cfg.generate_options() == {"llm.MemoryUtilization": "0.95"}


def test_enable_switch_role_false_not_emitted():
    cfg = LLMConfig()
    cfg.enable_switch_role = False
    assert "llm.EnableSwitchRole" not in cfg.generate_options()


def test_local_comm_res_empty_emitted_once_set():
    cfg = LLMConfig()
    cfg.local_comm_res = ""
    assert cfg.generate_options()["llm.LocalCommRes"] == ""


def test_ge_options_same_object_and_override():
    cfg = LLMConfig()
    ge = {"ge.exec.deviceId": "9", "ge.flowGraphMemMaxSize": "100"}
    cfg.ge_options = ge
    assert cfg.ge_options is ge
    cfg.device_id = 1
    opts = cfg.generate_options()
    assert list(opts)[0] == "ge.exec.deviceId"
    assert opts["ge.exec.deviceId"] == "1"


def test_cluster_info_ip_conversion():
    cfg = LLMConfig()
    cfg.cluster_info = json.dumps({"cluster_id": 1, "listen_ip_info": [{"ip": "1.2.3.4", "port": 26000}]})
    parsed = json.loads(cfg.cluster_info)
    assert parsed["listen_ip_info"][0]["ip"] == 67305985
    assert parsed["listen_ip_info"][0]["port"] == 26000
    assert json.loads(cfg.generate_options()["llm.ClusterInfo"]) == parsed
    with pytest.raises(RuntimeError, match="Can not parse ip str:"):
        cfg.cluster_info = json.dumps({"listen_ip_info": [{"ip": "x.y", "port": 1}]})
    with pytest.raises(ValueError):
        cfg.cluster_info = "{not json"
    with pytest.raises(LLMException):
        cfg.cluster_info = "[1, 2]"
    with pytest.raises(TypeError):
        cfg.cluster_info = {"cluster_id": 1}  # type: ignore[assignment]


# ---------------------------------------------------------------------------- LlmConfig validation


@pytest.mark.parametrize(
    "prop,value",
    [
        ("device_id", "0"),
        ("device_id", 1.0),
        ("device_id", True),
        ("device_id", [0, "1"]),
        ("device_id", [0, True]),
        ("sync_kv_timeout", 1.5),
        ("sync_kv_timeout", True),
        ("listen_ip_info", 123),
        ("deploy_res_path", 1),
        ("ge_options", [("a", "b")]),
        ("ge_options", {"a": 1}),
        ("ge_options", {1: "a"}),
        ("enable_switch_role", 1),
        ("enable_switch_role", "1"),
        ("link_total_time", "10"),
        ("link_total_time", True),
        ("link_retry_count", 2.0),
        ("cluster_info", 1),
        ("output_max_size", "1"),
        ("mem_utilization", 1),
        ("mem_utilization", "0.5"),
        ("mem_utilization", None),
        ("buf_pool_cfg", {}),
        ("mem_pool_cfg", {}),
        ("host_mem_pool_cfg", 1),
        ("enable_cache_manager", 1),
        ("enable_remote_cache_accessible", "True"),
        ("rdma_traffic_class", "132"),
        ("rdma_service_level", 4.0),
        ("local_comm_res", {}),
        ("transfer_backend", 1),
        ("global_resource_config", {}),
    ],
)
def test_config_type_errors(prop, value):
    cfg = LLMConfig()
    with pytest.raises(TypeError):
        setattr(cfg, prop, value)


def test_config_type_error_message():
    cfg = LLMConfig()
    with pytest.raises(TypeError) as ei:
        cfg.listen_ip_info = 5  # type: ignore[assignment]
    assert str(ei.value) == "listen_ip_info only support ['str'], but got <class 'int'>."
    with pytest.raises(TypeError) as ei:
        cfg.device_id = "0"  # type: ignore[assignment]
    assert str(ei.value) == "device_id only support ['list', 'tuple', 'int'], but got <class 'str'>."


@pytest.mark.parametrize(
    "prop,value",
    [
        ("device_id", 2**31),
        ("device_id", [0, 2**31]),
        ("sync_kv_timeout", 2**31),
        ("sync_kv_timeout", str(2**31)),
        ("rdma_traffic_class", -1),
        ("rdma_traffic_class", 2**32),
        ("rdma_service_level", 2**32),
    ],
)
def test_config_value_errors(prop, value):
    cfg = LLMConfig()
    with pytest.raises(ValueError):
        setattr(cfg, prop, value)


def test_config_value_error_message():
    cfg = LLMConfig()
    with pytest.raises(ValueError) as ei:
        cfg.sync_kv_timeout = 2**31
    assert str(ei.value) == f"sync_kv_timeout's value is out of range,{2**31} is not a int32 value."


@pytest.mark.parametrize(
    "prop,value",
    [
        ("device_id", -1),
        ("device_id", [0, -1]),
        ("device_id", []),
        ("sync_kv_timeout", 0),
        ("sync_kv_timeout", -5),
        ("sync_kv_timeout", "0"),
        ("sync_kv_timeout", "-5"),
        ("sync_kv_timeout", "12a"),
        ("sync_kv_timeout", ""),
        ("link_total_time", -1),
        ("link_total_time", 2**32),
        ("link_retry_count", 0),
        ("link_retry_count", 101),
        ("mem_utilization", 1.5),
        ("mem_utilization", -0.1),
        ("mem_utilization", float("nan")),
    ],
)
def test_config_param_invalid(prop, value):
    cfg = LLMConfig()
    with pytest.raises(LLMException) as ei:
        setattr(cfg, prop, value)
    assert _param_invalid(ei)


def test_config_valid_values_roundtrip():
    cfg = LLMConfig()
    cfg.sync_kv_timeout = "250"
    assert cfg.sync_kv_timeout == "250"
    cfg.sync_kv_timeout = 2**31 - 1
    assert cfg.sync_kv_timeout == 2**31 - 1
    cfg.link_total_time = 0
    cfg.link_total_time = 2**32 - 1
    assert cfg.link_total_time == 2**32 - 1
    cfg.link_retry_count = 1
    cfg.link_retry_count = 100
    assert cfg.link_retry_count == 100
    cfg.mem_utilization = 0.0
    cfg.mem_utilization = 1.0
    assert cfg.generate_options()["llm.MemoryUtilization"] == "1.0"
    cfg.device_id = 2**31 - 1
    assert cfg.device_id == 2**31 - 1


def test_config_none_resets():
    cfg = LLMConfig()
    cfg.device_id = 1
    cfg.device_id = None
    cfg.sync_kv_timeout = 10
    cfg.sync_kv_timeout = None
    cfg.link_total_time = 5
    cfg.link_total_time = None
    cfg.enable_cache_manager = True
    cfg.enable_cache_manager = None
    cfg.local_comm_res = "x"
    cfg.local_comm_res = None
    cfg.ge_options = {"a": "b"}
    cfg.ge_options = None
    cfg.listen_ip_info = None
    assert cfg.device_id is None
    assert cfg.link_total_time == 0
    assert cfg.listen_ip_info == ""
    assert cfg.ge_options == {}
    assert cfg.generate_options() == {"llm.MemoryUtilization": "0.95"}
