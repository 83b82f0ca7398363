"""``pdlink serve`` configuration: where it is found, env/config precedence, file security rules,
field checks, TLS files, the embedded default, and that ``import pdlink`` stays light."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

import fresh_import
from internals import DEFAULT_CONFIG_JSON, ManagementClient
from internals import server_config as C
from server_util import LOCAL, Certs, Serve, write_config


def cfg(tmp_path, server=None, kv=None, extra=None, name="config.json", mode=0o600):
    server = {"httpsEnabled": False, **(server or {})}
    return write_config(str(tmp_path / name), server, kv, extra, mode)


def load(path=None, **env):
    return C.load(path, env)


# ------------------------------------------------------------------------------------- location

def test_embedded_default_when_nothing_is_configured():
    s = load()
    assert s.source == C.EMBEDDED
    assert (s.management_ip, s.management_port, s.metrics_port) == ("127.0.0.1", 1026, 1027)
    assert not s.https_enabled and s.infer_mode == "dmi" and s.warnings == ()
    assert [(p.name, p.port, p.routes, p.tls) for p in s.planes] == [
        ("management", 1026, ("management",), None), ("metrics", 1027, ("metrics",), None)]
    assert s.kv == C.KvTransfer() and not s.kv.test_kv.enabled
    assert s.model.max_batch_size == 200 and s.model.cache_block_size == 128
    # the embedded text is the documented default and parses to the same settings
    assert C.parse(json.loads(DEFAULT_CONFIG_JSON), C.EMBEDDED, None, {}) == s


def test_precedence_cli_then_env_then_home(tmp_path):
    a = cfg(tmp_path, {"managementPort": 2001}, name="a.json")
    b = cfg(tmp_path, {"managementPort": 2002}, name="b.json")
    home = tmp_path / "install"
    cfg(home, {"managementPort": 2003}, name="conf/config.json")
    assert load(a, MIES_CONFIG_JSON_PATH=b, MIES_INSTALL_PATH=str(home)).management_port == 2001
    assert load(None, MIES_CONFIG_JSON_PATH=b, MIES_INSTALL_PATH=str(home)).management_port == 2002
    assert load(None, MIES_INSTALL_PATH=str(home)).management_port == 2003


def test_mindie_home_needs_init_py(tmp_path):
    mindie = tmp_path / "mindie"
    install = tmp_path / "install"
    cfg(mindie, {"managementPort": 2004}, name="conf/config.json")
    cfg(install, {"managementPort": 2005}, name="conf/config.json")
    env = {"MINDIE_LLM_HOME_PATH": str(mindie), "MIES_INSTALL_PATH": str(install)}
    assert load(None, **env).management_port == 2005  # no __init__.py: MINDIE_LLM_HOME_PATH is ignored
    (mindie / "__init__.py").write_text("")
    s = load(None, **env)
    assert s.management_port == 2004 and s.home == str(mindie)


def test_home_without_a_config_file_is_an_error(tmp_path):
    with pytest.raises(C.ConfigError, match=r"no configuration file at .*conf/config.json.*MIES_INSTALL_PATH"):
        load(None, MIES_INSTALL_PATH=str(tmp_path))


def test_missing_file(tmp_path):
    with pytest.raises(C.ConfigError, match="cannot read configuration file .*nope.json"):
        load(str(tmp_path / "nope.json"))


# ------------------------------------------------------------------------------------- addresses

def test_management_ip_precedence(tmp_path):
    both = cfg(tmp_path, {"ipAddress": "127.0.0.5", "managementIpAddress": "127.0.0.6"}, name="both.json")
    only_ip = cfg(tmp_path, {"ipAddress": "127.0.0.5"}, name="ip.json")
    assert load(both).management_ip == "127.0.0.6"
    assert load(both, MIES_CONTAINER_MANAGEMENT_IP="127.0.0.7").management_ip == "127.0.0.7"
    assert load(only_ip).management_ip == "127.0.0.5"
    s = load(only_ip, MIES_CONTAINER_IP="127.0.0.8")  # overrides ipAddress, and so the fallback
    assert (s.ip_address, s.management_ip) == ("127.0.0.8", "127.0.0.8")
    assert load(both, MIES_CONTAINER_IP="127.0.0.8").management_ip == "127.0.0.6"
    with pytest.raises(C.ConfigError, match="MIES_CONTAINER_MANAGEMENT_IP"):
        load(both, MIES_CONTAINER_MANAGEMENT_IP="not-an-ip")


def test_management_port_and_planes(tmp_path):
    s = load(cfg(tmp_path, {"port": 3000, "metricsPort": 3001}, name="a.json"))
    assert s.management_port == 3000  # managementPort absent: port
    assert [(p.port, p.routes) for p in s.planes] == [(3000, ("management",)), (3001, ("metrics",))]
    s = load(cfg(tmp_path, {"port": 3000, "managementPort": 3002, "metricsPort": 3002}, name="b.json"))
    assert [(p.port, p.routes) for p in s.planes] == [(3002, ("management", "metrics"))]


@pytest.mark.parametrize("field,value", [("ipAddress", "0.0.0.0"), ("managementIpAddress", "0.0.0.0"),
                                         ("managementIpAddress", "::")])
def test_all_zero_address_needs_the_flag(tmp_path, field, value):
    with pytest.raises(C.ConfigError, match="allowAllZeroIpListening"):
        load(cfg(tmp_path, {field: value}))
    s = load(cfg(tmp_path, {field: value, "allowAllZeroIpListening": True}, name="ok.json"))
    assert s.allow_all_zero_ip
    assert any("not a loopback" in w for w in s.warnings)  # the management plane listens there (plain HTTP)


def test_all_zero_from_env_is_refused(tmp_path):
    with pytest.raises(C.ConfigError, match="allowAllZeroIpListening"):
        load(cfg(tmp_path), MIES_CONTAINER_MANAGEMENT_IP="0.0.0.0")


def test_plain_http_warns_off_loopback(tmp_path):
    assert load(cfg(tmp_path, {"managementIpAddress": "127.0.0.9"})).warnings == ()
    s = load(cfg(tmp_path, {"managementIpAddress": "192.0.2.10"}, name="b.json"))
    assert any("httpsEnabled is false" in w and "192.0.2.10" in w for w in s.warnings)


# ------------------------------------------------------------------------------------- file rules

@pytest.mark.parametrize("mode,ok", [(0o600, True), (0o640, True), (0o400, True), (0o644, False), (0o660, False),
                                     (0o602, False), (0o666, False)])
def test_file_mode(tmp_path, mode, ok):
    path = cfg(tmp_path, mode=mode)
    if ok:
        assert load(path).source == path
    else:
        with pytest.raises(C.ConfigError, match=r"must not be readable or writable by others.*chmod 640"):
            load(path)


def test_file_size_limits(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    empty.chmod(0o600)
    with pytest.raises(C.ConfigError, match="is empty"):
        load(str(empty))
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(C.MAX_CONFIG_BYTES + 1)  # sparse: no 10 MB written
    big.chmod(0o600)
    with pytest.raises(C.ConfigError, match="larger than the 10 MB limit"):
        load(str(big))
    exact = tmp_path / "exact.json"
    doc = json.dumps({"ServerConfig": {"httpsEnabled": False}}).encode()
    exact.write_bytes(doc + b" " * (C.MAX_CONFIG_BYTES - len(doc)))
    exact.chmod(0o600)
    assert load(str(exact)).source == str(exact)


def test_not_a_regular_file(tmp_path):
    d = tmp_path / "dir.json"
    d.mkdir()
    with pytest.raises(C.ConfigError, match="not a regular file"):
        load(str(d))


@pytest.mark.parametrize("text,match", [(b"{", "not valid JSON"), (b"[1]", "must hold a JSON object"),
                                        (b"\xff\xfe", "not valid JSON")])
def test_not_json(tmp_path, text, match):
    p = tmp_path / "c.json"
    p.write_bytes(text)
    p.chmod(0o600)
    with pytest.raises(C.ConfigError, match=match):
        load(str(p))


@pytest.mark.parametrize("server,match", [
    ({"port": 80}, r"port must be an integer in \[1024, 65535\]"),
    ({"managementPort": 70000}, "managementPort"),
    ({"metricsPort": "1027"}, "metricsPort"),
    ({"httpsEnabled": "false"}, "httpsEnabled must be true or false"),
    ({"inferMode": "pd"}, "inferMode must be one of"),
    ({"maxLinkNum": 0}, "maxLinkNum"),
    ({"maxRequestLength": 101}, "maxRequestLength"),
    ({"ipAddress": "localhost"}, "not a valid IP address"),
    ({"allowAllZeroIpListening": 1}, "allowAllZeroIpListening"),
    ({"headTimeoutMs": 99}, r"headTimeoutMs must be an integer in \[100, 600000\]"),
    ({"bodyTimeoutMs": "60000"}, r"bodyTimeoutMs must be an integer in \[100, 3600000\]"),
    ({"maxJsonDepth": 4}, r"maxJsonDepth must be an integer in \[5, 512\]"),
    ({"maxLinksPerClient": 0}, r"maxLinksPerClient must be an integer in \[1, 4096\]"),
    ({"maxLinkNum": 10, "maxLinksPerClient": 10}, r"maxLinksPerClient \(10\) must be below maxLinkNum \(10\)"),
])
def test_server_config_fields(tmp_path, server, match):
    with pytest.raises(C.ConfigError, match=match):
        load(cfg(tmp_path, server))


def test_hostile_client_bounds(tmp_path):
    """The defaults (docs/server.md, "Hostile clients"), maxLinksPerClient's default below a small
    maxLinkNum, and the summary."""
    s = load(cfg(tmp_path))
    assert (s.max_links_per_client, s.head_timeout_ms, s.body_timeout_ms, s.max_json_depth) == (16, 10000, 60000, 32)
    assert {k: s.summary()[k] for k in ("maxLinksPerClient", "headTimeoutMs", "bodyTimeoutMs", "maxJsonDepth")} == \
        {"maxLinksPerClient": 16, "headTimeoutMs": 10000, "bodyTimeoutMs": 60000, "maxJsonDepth": 32}
    assert load(cfg(tmp_path, {"maxLinkNum": 5}, name="five.json")).max_links_per_client == 4
    assert load(cfg(tmp_path, {"maxLinkNum": 1}, name="one.json")).max_links_per_client == 1
    s = load(cfg(tmp_path, {"maxLinkNum": 100, "maxLinksPerClient": 99, "headTimeoutMs": 100,
                            "bodyTimeoutMs": 3_600_000, "maxJsonDepth": 512}, name="set.json"))
    assert (s.max_links_per_client, s.head_timeout_ms, s.body_timeout_ms, s.max_json_depth) == (99, 100, 3_600_000, 512)


@pytest.mark.parametrize("kv,match", [
    ({"backend": "npu"}, r"backend must be one of \['auto', 'cpu', 'ascend'\]"),
    ({"transport": "rdma"}, "transport"),
    ({"deviceCount": 0}, "deviceCount"),
    ({"listenIpSource": "pod_ip"}, "listenIpSource"),
    ({"listenPortBase": 80}, "listenPortBase"),
    ({"linkTimeoutMs": 0}, "linkTimeoutMs"),
    ({"typo": 1}, r"unknown field\(s\) \['typo'\]"),
    ({"testKv": {"enabled": "yes"}}, "testKv.enabled"),
    ({"testKv": {"numBlocks": 4096, "numTensors": 64, "blockBytes": 1 << 20}}, "at most 256 MiB"),
    ({"testKv": {"extra": True}}, "unknown field"),
])
def test_kv_transfer_section_is_strict(tmp_path, kv, match):
    with pytest.raises(C.ConfigError, match=match):
        load(cfg(tmp_path, kv=kv))


def test_kv_section_and_backend_config(tmp_path):
    s = load(cfg(tmp_path, kv={"deviceCount": 2, "listenIpSource": "device_ip", "listenPortBase": 30000,
                               "testKv": {"enabled": True, "numBlocks": 8}},
                 extra={"BackendConfig": {"ModelDeployConfig": {"maxSeqLen": 4096, "ModelConfig": [
                     {"modelName": "llama", "worldSize": 2}]}, "ScheduleConfig": {"maxBatchSize": 50}}}))
    assert (s.kv.device_count, s.kv.listen_ip_source, s.kv.listen_port_base) == (2, "device_ip", 30000)
    assert s.kv.test_kv == C.TestKv(enabled=True, num_blocks=8)
    assert any("testKv is enabled" in w for w in s.warnings)
    assert (s.model.model_name, s.model.max_seq_len, s.model.world_size, s.model.max_batch_size) == \
        ("llama", 4096, 2, 50)
    assert s.summary()["KvTransferConfig"]["testKv"]["enabled"] is True


def test_link_secret_file_then_env(tmp_path):
    secret = tmp_path / "link.secret"
    secret.write_text("  s3cret\n")
    secret.chmod(0o600)
    s = load(cfg(tmp_path, kv={"linkSecretFile": str(secret)}), PDLINK_LINK_SECRET="from-env")
    assert (s.kv.link_secret, s.kv.link_secret_source) == ("s3cret", str(secret))
    assert "s3cret" not in repr(s) and "s3cret" not in json.dumps(s.summary())  # never shown
    s = load(cfg(tmp_path, name="env.json"), PDLINK_LINK_SECRET="from-env")
    assert (s.kv.link_secret, s.kv.link_secret_source) == ("from-env", "env PDLINK_LINK_SECRET")
    assert load(cfg(tmp_path, name="none.json")).kv.link_secret_source == "none"
    secret.chmod(0o640)
    with pytest.raises(C.ConfigError, match="linkSecretFile .* has mode 0640.*chmod 600"):
        load(cfg(tmp_path, kv={"linkSecretFile": str(secret)}, name="loose.json"))
    secret.write_text(" \n")
    secret.chmod(0o600)
    with pytest.raises(C.ConfigError, match="linkSecretFile .* is empty"):
        load(cfg(tmp_path, kv={"linkSecretFile": str(secret)}, name="empty.json"))
    with pytest.raises(C.ConfigError, match="linkSecretFile .*absent.*No such file"):
        load(cfg(tmp_path, kv={"linkSecretFile": "absent"}, name="absent.json"))


def test_payload_integrity_needs_a_link_secret(tmp_path):
    assert load(cfg(tmp_path, name="off.json"), PDLINK_LINK_SECRET="s").kv.payload_integrity is False
    s = load(cfg(tmp_path, kv={"payloadIntegrity": True}, name="on.json"), PDLINK_LINK_SECRET="s")
    assert s.kv.payload_integrity is True
    with pytest.raises(C.ConfigError, match="payloadIntegrity needs a link secret"):
        load(cfg(tmp_path, kv={"payloadIntegrity": True}, name="nosecret.json"))


def test_the_ucx_transport_needs_the_trusted_network_statement(tmp_path):
    s = load(cfg(tmp_path, kv={"transport": "ucx", "ucxTrustedNetwork": True}, name="ucx.json"))
    assert (s.kv.transport, s.kv.ucx_trusted_network) == ("ucx", True)
    with pytest.raises(C.ConfigError, match="transport 'ucx' needs ucxTrustedNetwork: true"):
        load(cfg(tmp_path, kv={"transport": "ucx"}, name="untrusted.json"))
    with pytest.raises(C.ConfigError, match="ucxTrustedNetwork"):
        load(cfg(tmp_path, kv={"transport": "ucx", "ucxTrustedNetwork": "yes"}, name="notbool.json"))


# ------------------------------------------------------------------------------------- TLS files

@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return Certs(str(tmp_path_factory.mktemp("certs")))


def _home_with_certs(tmp_path, certs, management_files=True):
    """MindIE's layout: <home>/conf/config.json and TLS paths relative to <home>."""
    home = tmp_path / "home"
    for rel, src, mode in [("security/ca/ca.pem", certs.ca, 0o644),
                           ("security/certs/server.pem", certs.server_cert, 0o644),
                           ("security/keys/server.key.pem", certs.server_key, 0o600)]:
        dst = home / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(open(src, "rb").read())
        dst.chmod(mode)
    return home


def test_tls_paths_are_relative_to_home(tmp_path, certs):
    home = _home_with_certs(tmp_path, certs)
    path = write_config(str(home / "conf" / "config.json"), {"httpsEnabled": True, "port": 4000,
                                                             "metricsPort": 4000, "tlsCrlFiles": []})
    s = load(path)  # --config: <home> is the parent of conf/
    assert s.home == str(home)
    (plane,) = s.planes
    assert plane.routes == ("management", "metrics") and plane.tls.name == "business"
    assert plane.tls.cert == str(home / "security/certs/server.pem")
    assert plane.tls.ca_files == (str(home / "security/ca/ca.pem"),)
    assert load(None, MIES_INSTALL_PATH=str(home)).planes == s.planes


def test_plane_certificate_sets(tmp_path, certs):
    tls = certs.server_config()
    s = load(cfg(tmp_path, {**tls, "port": 4000, "managementPort": 4000, "metricsPort": 4001}, name="a.json"))
    assert [(p.name, p.tls.name) for p in s.planes] == [("management", "business"), ("metrics", "metrics")]
    s = load(cfg(tmp_path, {**tls, "port": 4000, "managementPort": 4002, "metricsPort": 4002}, name="b.json"))
    assert [(p.name, p.tls.name) for p in s.planes] == [("management", "management")]
    s = load(cfg(tmp_path, {**tls, "port": 4000, "managementPort": 4003, "metricsPort": 4004}, name="c.json"))
    assert [(p.name, p.tls.name) for p in s.planes] == [("management", "management"), ("metrics", "metrics")]
    assert all(p.tls.ca_files == (certs.ca,) for p in s.planes)


def test_tls_file_rules(tmp_path, certs):
    tls = certs.server_config()
    with pytest.raises(C.ConfigError, match=r"management plane: certificate .*missing.pem.*No such file"):
        load(cfg(tmp_path, {**tls, "managementTlsCert": str(tmp_path / "missing.pem"), "managementPort": 4100},
                 name="a.json"))
    loose_key = tmp_path / "loose.key.pem"
    loose_key.write_bytes(open(certs.server_key, "rb").read())
    loose_key.chmod(0o640)
    with pytest.raises(C.ConfigError, match=r"private key .*loose.key.pem has mode 0640.*chmod 600"):
        load(cfg(tmp_path, {**tls, "tlsPk": str(loose_key)}, name="b.json"))
    loose_cert = tmp_path / "loose.pem"
    loose_cert.write_bytes(open(certs.server_cert, "rb").read())
    loose_cert.chmod(0o666)
    with pytest.raises(C.ConfigError, match="writable by group or others"):
        load(cfg(tmp_path, {**tls, "tlsCert": str(loose_cert)}, name="c.json"))
    with pytest.raises(C.ConfigError, match="CA file .*nope.pem"):
        load(cfg(tmp_path, {**tls, "tlsCaFile": ["nope.pem"]}, name="d.json"))
    s = load(cfg(tmp_path, {**tls, "tlsCrlFiles": ["absent_crl.pem"]}, name="e.json"))
    assert any("absent_crl.pem does not exist" in w for w in s.warnings)
    s = load(cfg(tmp_path, {**tls, "tlsCaFile": []}, name="f.json"))
    assert any("mutual TLS off" in w for w in s.warnings) and s.planes[0].tls.ca_files == ()
    with pytest.raises(C.ConfigError, match="at most 3 file names"):
        load(cfg(tmp_path, {**tls, "tlsCaFile": ["a", "b", "c", "d"]}, name="g.json"))


def test_tls_contexts_are_tls13_and_mutual(tmp_path, certs):
    import ssl

    from internals import server_context

    s = load(cfg(tmp_path, {**certs.server_config(crl=True)}))
    ctx = server_context(s.planes[0].tls)
    assert ctx.minimum_version == ctx.maximum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.verify_flags & ssl.VERIFY_CRL_CHECK_LEAF
    s = load(cfg(tmp_path, {**certs.server_config(ca=False)}, name="noca.json"))
    assert server_context(s.planes[0].tls).verify_mode == ssl.CERT_NONE


def test_a_mismatched_key_is_a_config_error(tmp_path, certs):
    from internals import server_context

    s = load(cfg(tmp_path, {**certs.server_config(), "tlsPk": certs.client_key}))
    with pytest.raises(C.ConfigError, match="cannot load certificate"):
        server_context(s.planes[0].tls)


# ------------------------------------------------------------------------------------- processes

def _run(args, env=None, timeout=30):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("MIES_", "MINDIE_"))}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "pdlink", *args], capture_output=True, text=True, env=full,
                          timeout=timeout)


def test_import_pdlink_stays_light():
    assert fresh_import.run(fresh_import.server_modules_stay_light, timeout=30) == []


def test_check_config_honours_env_and_reports_errors(tmp_path):
    env_cfg = cfg(tmp_path, {"managementPort": 5001}, name="env.json")
    out = _run(["serve", "--check-config"], {"MIES_CONFIG_JSON_PATH": env_cfg,
                                              "MIES_CONTAINER_MANAGEMENT_IP": "127.0.0.3"})
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["source"] == env_cfg
    assert summary["planes"][0]["url"] == "http://127.0.0.3:5001"
    loose = cfg(tmp_path, name="loose.json", mode=0o644)
    out = _run(["serve", "--config", loose, "--check-config"])
    assert out.returncode == 2
    assert "configuration error" in out.stderr and "chmod 640" in out.stderr
    zero = cfg(tmp_path, {"managementIpAddress": "0.0.0.0"}, name="zero.json")
    out = _run(["serve", "--config", zero])  # refused before anything listens
    assert out.returncode == 2 and "allowAllZeroIpListening" in out.stderr
    out = _run(["serve", "--print-default-config"])
    assert out.returncode == 0 and json.loads(out.stdout) == json.loads(DEFAULT_CONFIG_JSON)


def test_a_taken_port_is_reported(tmp_path):
    with socket.socket() as s:
        s.bind((LOCAL, 0))
        s.listen()
        port = s.getsockname()[1]
        out = _run(["serve", "--config", cfg(tmp_path, {"managementPort": port, "port": port})])
    assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in out.stderr


def _free(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds (TIME_WAIT is fine)
        try:
            s.bind((LOCAL, port))
            return True
        except OSError:
            return False


def test_starts_on_the_embedded_default(tmp_path):
    if not (_free(1026) and _free(1027)):
        pytest.skip("ports 1026/1027 of the embedded default are taken on this machine")
    server = Serve(None)
    try:
        server.wait_ready()
        assert "config: <embedded default>" in server.output
        client = ManagementClient(LOCAL, 1026, https=False, retries=0)
        assert client.healthy()
        assert client.status()["service"] == {"roleStatus": "RoleUnknown", "currentRole": "none"}
        assert "pdlink_role_info" in ManagementClient(LOCAL, 1027, https=False, retries=0).metrics()
        out = _run(["status", "--http"])
        assert out.returncode == 0 and json.loads(out.stdout)["service"]["roleStatus"] == "RoleUnknown"
    finally:
        assert server.stop() == 0
    assert "pdlink serve: stopped" in server.output
