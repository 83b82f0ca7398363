"""Configuration of ``pdlink serve``: MindIE's ``config.json`` plus pdlink's ``KvTransferConfig``.

Where the file is found (first match wins):

1. ``--config PATH``;
2. env ``MIES_CONFIG_JSON_PATH``;
3. ``<home>/conf/config.json`` with ``<home>`` = ``$MINDIE_LLM_HOME_PATH`` (only when it holds an
   ``__init__.py``, as MindIE requires), else ``$MIES_INSTALL_PATH``;
4. the embedded default (``pdlink.server.defaults``).

A file is refused (``ConfigError``, with a message naming the file and the fix) when it is not a
regular file, is empty or larger than 10 MB, is readable or writable by others or writable by its
group (MindIE's ceiling is mode 0640), or is owned by neither the current user nor root.

Addresses: ``{ip}`` of the management plane is env ``MIES_CONTAINER_MANAGEMENT_IP``, else
``managementIpAddress``, else ``ipAddress`` (itself overridden by env ``MIES_CONTAINER_IP``);
``{port}`` is ``managementPort``, else ``port``. Binding ``0.0.0.0`` (or ``::``) needs
``allowAllZeroIpListening: true``.

TLS paths that are not absolute are relative to ``<home>``: the home of rule 3 when
``MINDIE_LLM_HOME_PATH`` / ``MIES_INSTALL_PATH`` is set, else the parent of the file's directory
when that directory is named ``conf`` (MindIE's ``<home>/conf/config.json`` layout), else the
file's directory.

This module imports the standard library only; reading a configuration loads the native module for
the backend and transport names the engine takes (`pdlink.BACKENDS`, `pdlink.TRANSPORTS`).
"""

from __future__ import annotations

import builtins
import ipaddress
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast, overload

from .. import environment

__all__ = ["ConfigError", "Settings", "Plane", "TlsFiles", "KvTransfer", "TestKv", "ModelInfo", "load", "parse",
           "locate", "read_config_file", "MAX_CONFIG_BYTES", "EMBEDDED"]

MAX_CONFIG_BYTES = 10 * 1024 * 1024
EMBEDDED = "<embedded default>"


class ConfigError(Exception):
    """The configuration cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class TlsFiles:
    """One plane's TLS material, paths resolved."""

    name: str  # "business", "management" or "metrics": which ServerConfig fields it came from
    ca_files: tuple[str, ...]  # empty: no client authentication
    cert: str
    key: str
    crl_files: tuple[str, ...]


@dataclass(frozen=True)
class Plane:
    """One HTTP listener: the management plane, and the metrics plane when on its own port."""

    name: str  # "management" or "metrics"
    ip: str
    port: int
    routes: tuple[str, ...]  # ("management",), ("metrics",) or ("management", "metrics")
    tls: TlsFiles | None  # None: plain HTTP


@dataclass(frozen=True)
class TestKv:
    """The test/demo KV surface (off by default; see docs/server.md)."""

    enabled: bool = False
    num_tensors: int = 2
    num_blocks: int = 16
    block_bytes: int = 4096


@dataclass(frozen=True)
class KvTransfer:
    """pdlink's own section: how the engines are built and linked."""

    backend: str = "cpu"
    transport: str = "auto"
    device_count: int = 1
    listen_ip_source: str = "server_ip"
    listen_port_base: int = 26000
    link_timeout_ms: int = 3000
    link_total_time_ms: int = 30000
    link_retry_interval_ms: int = 200
    sync_kv_timeout_ms: int = 1000
    role_drain_timeout_ms: int = 120_000  # an epoch-fenced role switch waits this long for the node's transfers
    test_kv: TestKv = field(default_factory=TestKv)
    link_secret: str = field(default="", repr=False)  # "" : links are not authenticated
    link_secret_source: str = "none"  # "none", "env PDLINK_LINK_SECRET" or the file's path
    payload_integrity: bool = False  # with a link secret: payloads sealed too (docs/security.md)
    ucx_trusted_network: bool = False  # transport "ucx": every host that reaches this one is trusted (docs/ucx.md)


@dataclass(frozen=True)
class ModelInfo:
    """What ``GET /v1/config`` reports (from BackendConfig)."""

    model_name: str = "pdlink"
    max_seq_len: int = 2560
    npu_mem_size: int = -1
    cpu_mem_size: int = 5
    world_size: int = 1
    max_output_len: int = 512
    cache_block_size: int = 128
    max_batch_size: int = 200


@dataclass(frozen=True)
class Settings:
    source: str  # the file's path, or EMBEDDED
    home: str | None
    ip_address: str
    management_ip: str
    port: int
    management_port: int
    metrics_port: int
    https_enabled: bool
    allow_all_zero_ip: bool
    max_link_num: int
    infer_mode: str
    max_request_bytes: int
    max_links_per_client: int
    head_timeout_ms: int
    body_timeout_ms: int
    max_json_depth: int
    planes: tuple[Plane, ...]
    kv: KvTransfer
    model: ModelInfo
    warnings: tuple[str, ...] = ()

    @property
    def management(self) -> Plane:
        return self.planes[0]

    def summary(self) -> dict[str, Any]:
        """A JSON-able description of the effective settings (``pdlink serve --check-config``)."""
        def plane(p: Plane) -> dict[str, Any]:
            out: dict[str, Any] = {"name": p.name, "url": f"{'https' if p.tls else 'http'}://{_host(p.ip)}:{p.port}",
                                   "routes": list(p.routes)}
            if p.tls:
                out["tls"] = {"certificates": p.tls.name, "cert": p.tls.cert, "key": p.tls.key,
                              "ca_files": list(p.tls.ca_files), "crl_files": list(p.tls.crl_files),
                              "mutual": bool(p.tls.ca_files)}
            return out

        kv = self.kv
        return {
            "source": self.source, "home": self.home, "inferMode": self.infer_mode,
            "ipAddress": self.ip_address, "managementIpAddress": self.management_ip, "port": self.port,
            "managementPort": self.management_port, "metricsPort": self.metrics_port,
            "httpsEnabled": self.https_enabled, "maxLinkNum": self.max_link_num,
            "maxRequestBytes": self.max_request_bytes, "maxLinksPerClient": self.max_links_per_client,
            "headTimeoutMs": self.head_timeout_ms, "bodyTimeoutMs": self.body_timeout_ms,
            "maxJsonDepth": self.max_json_depth,
            "planes": [plane(p) for p in self.planes],
            "KvTransferConfig": {
                "backend": kv.backend, "transport": kv.transport, "deviceCount": kv.device_count,
                "listenIpSource": kv.listen_ip_source, "listenPortBase": kv.listen_port_base,
                "linkTimeoutMs": kv.link_timeout_ms, "linkTotalTimeMs": kv.link_total_time_ms,
                "linkRetryIntervalMs": kv.link_retry_interval_ms, "syncKvTimeoutMs": kv.sync_kv_timeout_ms,
                "roleDrainTimeoutMs": kv.role_drain_timeout_ms,
                "testKv": {"enabled": kv.test_kv.enabled, "numTensors": kv.test_kv.num_tensors,
                           "numBlocks": kv.test_kv.num_blocks, "blockBytes": kv.test_kv.block_bytes},
                "linkSecret": kv.link_secret_source,  # where it came from, never the secret
                "ucxTrustedNetwork": kv.ucx_trusted_network,
            },
            "warnings": list(self.warnings),
        }


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


# ---------------------------------------------------------------------------------------- locating

def locate(cli_path: str | None, env: Mapping[str, str]) -> tuple[str | None, str | None, str]:
    """(config path or None for the embedded default, home directory or None, how it was found)."""
    home = _env_home(env)
    if cli_path:
        return cli_path, home, "--config"
    if env.get("MIES_CONFIG_JSON_PATH"):
        return env["MIES_CONFIG_JSON_PATH"], home, "MIES_CONFIG_JSON_PATH"
    if home is not None:
        path = os.path.join(home, "conf", "config.json")
        if not os.path.exists(path):
            var = "MINDIE_LLM_HOME_PATH" if _mindie_home(env) else "MIES_INSTALL_PATH"
            raise ConfigError(f"no configuration file at {path} (home from ${var}); create it, point "
                              "MIES_CONFIG_JSON_PATH or --config at a file, or unset the variable to use "
                              "the embedded default")
        return path, home, "home"
    return None, None, "embedded"


def _mindie_home(env: Mapping[str, str]) -> str | None:
    home = env.get("MINDIE_LLM_HOME_PATH")
    if home and os.path.isfile(os.path.join(home, "__init__.py")):
        return home
    return None


def _env_home(env: Mapping[str, str]) -> str | None:
    return _mindie_home(env) or env.get("MIES_INSTALL_PATH") or None


def read_config_file(path: str) -> dict[str, Any]:
    """Read and parse a config file after MindIE's file checks (regular file, 0 < size <= 10 MB,
    mode no looser than 0640, owned by the current user or root)."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as e:
        raise ConfigError(f"cannot read configuration file {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"configuration file {path} is not a regular file")
    if st.st_mode & 0o027:
        raise ConfigError(f"configuration file {path} has mode {stat.S_IMODE(st.st_mode):04o}: it must not be "
                          "readable or writable by others, nor writable by its group (at most 0640); "
                          f"run: chmod 640 {path}")
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"configuration file {path} is owned by uid {st.st_uid}, not by the current user "
                          f"({os.geteuid()}) or root")
    if st.st_size == 0:
        raise ConfigError(f"configuration file {path} is empty")
    if st.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"configuration file {path} is {st.st_size} bytes, larger than the 10 MB limit")
    try:
        with open(real, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read configuration file {path}: {e.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"configuration file {path} is larger than the 10 MB limit")
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"configuration file {path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"configuration file {path} must hold a JSON object")
    return raw


def load(cli_path: str | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Find, read, check and parse the configuration (see the module docstring)."""
    env = os.environ if env is None else env
    path, home, how = locate(cli_path, env)
    if path is None:
        from .defaults import DEFAULT_CONFIG_JSON

        return parse(json.loads(DEFAULT_CONFIG_JSON), EMBEDDED, None, env)
    raw = read_config_file(path)
    if home is None:
        cfg_dir = os.path.dirname(os.path.abspath(path))
        home = os.path.dirname(cfg_dir) if os.path.basename(cfg_dir) == "conf" else cfg_dir
    return parse(raw, path, home, env)


# ---------------------------------------------------------------------------------------- parsing

class _Section:
    """Typed access to one JSON object, with error messages naming the field."""

    # The accessors below are named after builtins, which they shadow in this class body: annotations
    # here spell the builtins as ``builtins.X``.

    def __init__(self, raw: Any, name: builtins.str, strict: builtins.bool = False):
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{name} must be a JSON object")
        self.raw: dict[builtins.str, Any] = raw
        self.name = name
        self.strict = strict
        self.seen: set[builtins.str] = set()

    def _get(self, key: builtins.str) -> Any:
        self.seen.add(key)
        return self.raw.get(key)

    def has(self, key: builtins.str) -> builtins.bool:
        return self.raw.get(key) is not None

    def bool(self, key: builtins.str, default: builtins.bool) -> builtins.bool:
        v = self._get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ConfigError(f"{self.name}.{key} must be true or false, got {v!r}")
        return v

    @overload
    def int(self, key: builtins.str, default: builtins.int, lo: builtins.int, hi: builtins.int) -> builtins.int: ...
    @overload
    def int(self, key: builtins.str, default: builtins.int | None, lo: builtins.int,
            hi: builtins.int) -> builtins.int | None: ...

    def int(self, key: builtins.str, default: builtins.int | None, lo: builtins.int,
            hi: builtins.int) -> builtins.int | None:
        v = self._get(key)
        if v is None:
            return default
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise ConfigError(f"{self.name}.{key} must be an integer in [{lo}, {hi}], got {v!r}")
        return v

    @overload
    def str(self, key: builtins.str, default: builtins.str,
            choices: tuple[builtins.str, ...] | None = None) -> builtins.str: ...
    @overload
    def str(self, key: builtins.str, default: builtins.str | None,
            choices: tuple[builtins.str, ...] | None = None) -> builtins.str | None: ...

    def str(self, key: builtins.str, default: builtins.str | None,
            choices: tuple[builtins.str, ...] | None = None) -> builtins.str | None:
        v = self._get(key)
        if v is None:
            return default
        if not isinstance(v, str) or (choices is not None and v not in choices):
            want = f"one of {list(choices)}" if choices else "a string"
            raise ConfigError(f"{self.name}.{key} must be {want}, got {v!r}")
        return v

    def str_list(self, key: builtins.str, default: list[builtins.str], max_len: builtins.int) -> list[builtins.str]:
        v = self._get(key)
        if v is None:
            return list(default)
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > max_len:
            raise ConfigError(f"{self.name}.{key} must be a list of at most {max_len} file names, got {v!r}")
        return list(v)

    def section(self, key: builtins.str, strict: builtins.bool = False) -> _Section:
        return _Section(self._get(key), f"{self.name}.{key}", strict)

    def done(self) -> None:
        if self.strict:
            unknown = sorted(set(self.raw) - self.seen)
            if unknown:
                raise ConfigError(f"{self.name} has unknown field(s) {unknown}")


def _ip(value: str, what: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ConfigError(f"{what} is not a valid IP address: {value!r}") from None


def _is_all_zero(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_unspecified


def _resolve(home: str | None, path: str) -> str:
    if os.path.isabs(path) or home is None:
        return os.path.abspath(path)
    return os.path.abspath(os.path.join(home, path))


def _tls_files(sc: _Section, name: str, home: str | None) -> TlsFiles:
    prefix = {"business": "tls", "management": "managementTls", "metrics": "metricsTls"}[name]
    defaults = {
        "business": (["ca.pem"], "security/certs/server.pem", "security/keys/server.key.pem", "security/certs/"),
        "management": (["management_ca.pem"], "security/certs/management/server.pem",
                       "security/keys/management/server.key.pem", "security/management/certs/"),
        "metrics": (["metrics_ca.pem"], "security/certs/metrics/server.pem", "security/keys/metrics/server.key.pem",
                    "security/metrics/certs/"),
    }[name]
    ca_path = sc.str("tlsCaPath", "security/ca/")  # one CA directory for every plane, as MindIE
    ca_key = "tlsCaFile" if name == "business" else f"{prefix}CaFile"
    ca_files = sc.str_list(ca_key, defaults[0], 3)
    cert = sc.str(f"{prefix}Cert", defaults[1])
    key = sc.str(f"{prefix}Pk", defaults[2])
    crl_path = sc.str(f"{prefix}CrlPath", defaults[3])
    crl_files = sc.str_list(f"{prefix}CrlFiles", [], 8)
    ca_dir = _resolve(home, ca_path)
    crl_dir = _resolve(home, crl_path)
    return TlsFiles(name, tuple(os.path.join(ca_dir, f) if not os.path.isabs(f) else f for f in ca_files),
                    _resolve(home, cert), _resolve(home, key),
                    tuple(os.path.join(crl_dir, f) if not os.path.isabs(f) else f for f in crl_files))


def _check_tls_files(tls: TlsFiles, plane: str, warnings: list[str]) -> TlsFiles:
    """Files must exist; a private key must not be accessible to group or others; certificates and
    CAs must not be writable by them. A listed CRL that is absent is skipped with a warning."""
    def regular(path: str, what: str) -> os.stat_result:
        try:
            st = os.stat(path)
        except OSError as e:
            raise ConfigError(f"{plane} plane: {what} {path}: {e.strerror} (httpsEnabled is true; set the "
                              f"{tls.name} TLS fields, or httpsEnabled: false on loopback)") from None
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{plane} plane: {what} {path} is not a regular file")
        return st

    st = regular(tls.key, "private key")
    if st.st_mode & 0o077:
        raise ConfigError(f"{plane} plane: private key {tls.key} has mode {stat.S_IMODE(st.st_mode):04o}; it must "
                          f"not be accessible to group or others: run chmod 600 {tls.key}")
    for path, what in [(tls.cert, "certificate")] + [(c, "CA file") for c in tls.ca_files]:
        st = regular(path, what)
        if st.st_mode & 0o022:
            raise ConfigError(f"{plane} plane: {what} {path} is writable by group or others "
                              f"(mode {stat.S_IMODE(st.st_mode):04o}); run chmod 644 {path} or stricter")
    crls = []
    for crl in tls.crl_files:
        if os.path.isfile(crl):
            crls.append(crl)
        else:
            warnings.append(f"{plane} plane: CRL file {crl} does not exist; no revocation check from it")
    if not tls.ca_files:
        warnings.append(f"{plane} plane: no CA file configured ({tls.name} certificates): clients are not "
                        "authenticated (mutual TLS off)")
    return TlsFiles(tls.name, tls.ca_files, tls.cert, tls.key, tuple(crls))


_MAX_SECRET_BYTES = 4096


def _link_secret(path: str | None, home: str | None, env: Mapping[str, str]) -> tuple[str, str]:
    """(secret, where it came from): ``linkSecretFile`` (mode 0600 or stricter, at most 4 KiB,
    surrounding whitespace ignored), else env ``PDLINK_LINK_SECRET`` (as the library), else none."""
    if path is None:
        secret = environment.link_secret(env)
        return (secret, f"env {environment.LINK_SECRET.name}") if secret else ("", "none")
    path = _resolve(home, path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"KvTransferConfig.linkSecretFile {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"KvTransferConfig.linkSecretFile {path} is not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(f"KvTransferConfig.linkSecretFile {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must "
                          f"not be accessible to group or others: run chmod 600 {path}")
    with open(path, "rb") as f:
        data = f.read(_MAX_SECRET_BYTES + 1)
    if len(data) > _MAX_SECRET_BYTES:
        raise ConfigError(f"KvTransferConfig.linkSecretFile {path} is larger than {_MAX_SECRET_BYTES} bytes")
    try:
        secret = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"KvTransferConfig.linkSecretFile {path} is not UTF-8 text") from None
    if not secret:
        raise ConfigError(f"KvTransferConfig.linkSecretFile {path} is empty")
    return secret, path


def _kv_section(root: _Section, home: str | None, env: Mapping[str, str]) -> KvTransfer:
    from .. import constants  # the names the engine takes (loads the native module)

    kv = root.section("KvTransferConfig", strict=True)
    test = kv.section("testKv", strict=True)
    test_kv = TestKv(
        enabled=test.bool("enabled", False),
        num_tensors=test.int("numTensors", 2, 1, 64),
        num_blocks=test.int("numBlocks", 16, 1, 4096),
        block_bytes=test.int("blockBytes", 4096, 64, 1 << 20),
    )
    test.done()
    if test_kv.num_tensors * test_kv.num_blocks * test_kv.block_bytes > (256 << 20):
        raise ConfigError("KvTransferConfig.testKv: numTensors * numBlocks * blockBytes must be at most 256 MiB")
    out = KvTransfer(
        backend=kv.str("backend", "cpu", constants.BACKENDS),
        transport=kv.str("transport", "auto", constants.TRANSPORTS),
        device_count=kv.int("deviceCount", 1, 1, 16),
        listen_ip_source=kv.str("listenIpSource", "server_ip", ("server_ip", "device_ip", "host_ip")),
        listen_port_base=kv.int("listenPortBase", 26000, 1024, 65535),
        link_timeout_ms=kv.int("linkTimeoutMs", 3000, 1, 600_000),
        link_total_time_ms=kv.int("linkTotalTimeMs", 30000, 1, 3_600_000),
        link_retry_interval_ms=kv.int("linkRetryIntervalMs", 200, 10, 60_000),
        sync_kv_timeout_ms=kv.int("syncKvTimeoutMs", 1000, 1, 2**31 - 1),
        role_drain_timeout_ms=kv.int("roleDrainTimeoutMs", 120_000, 1, 3_600_000),
        test_kv=test_kv,
    )
    secret, source = _link_secret(kv.str("linkSecretFile", None), home, env)
    integrity = kv.bool("payloadIntegrity", False)
    trusted = kv.bool("ucxTrustedNetwork", False)
    if out.transport == "ucx" and not trusted:
        raise ConfigError("KvTransferConfig.transport 'ucx' needs ucxTrustedNetwork: true, the statement that every "
                          "host that can reach this one is trusted (UCX assumes it: docs/ucx.md, 'Trust')")
    if integrity and not secret:
        raise ConfigError("KvTransferConfig.payloadIntegrity needs a link secret (linkSecretFile or env "
                          "PDLINK_LINK_SECRET)")
    kv.done()
    return replace(out, link_secret=secret, link_secret_source=source, payload_integrity=integrity,
                   ucx_trusted_network=trusted)


def _model_section(root: _Section, device_count: int) -> ModelInfo:
    backend = root.section("BackendConfig")
    deploy = backend.section("ModelDeployConfig")
    sched = backend.section("ScheduleConfig")
    models = deploy._get("ModelConfig")
    first: dict[str, Any] = {}
    if models is not None:
        if not isinstance(models, list) or (models and not isinstance(models[0], dict)):
            raise ConfigError("BackendConfig.ModelDeployConfig.ModelConfig must be a list of objects")
        first = models[0] if models else {}
    model = _Section(first, "BackendConfig.ModelDeployConfig.ModelConfig[0]")
    u32 = 2**32 - 1
    return ModelInfo(
        model_name=model.str("modelName", "pdlink"),
        max_seq_len=deploy.int("maxSeqLen", 2560, 0, u32),
        npu_mem_size=model.int("npuMemSize", -1, -1, 2**31 - 1),
        cpu_mem_size=model.int("cpuMemSize", 5, 0, 2**31 - 1),
        world_size=model.int("worldSize", device_count, 1, 1 << 16),
        max_output_len=sched.int("maxIterTimes", 512, 1, u32 - 1),
        cache_block_size=sched.int("cacheBlockSize", 128, 1, 128),
        max_batch_size=sched.int("maxBatchSize", 200, 1, 5000),
    )


def parse(raw: dict[str, Any], source: str, home: str | None, env: Mapping[str, str]) -> Settings:
    """Validate a parsed config document and derive the effective settings."""
    root = _Section(raw, "config")
    sc = root.section("ServerConfig")
    warnings: list[str] = []

    ip_address = _ip(env.get("MIES_CONTAINER_IP") or sc.str("ipAddress", "127.0.0.1"),
                     "ServerConfig.ipAddress (or env MIES_CONTAINER_IP)")
    if env.get("MIES_CONTAINER_MANAGEMENT_IP"):
        management_ip = _ip(env["MIES_CONTAINER_MANAGEMENT_IP"], "env MIES_CONTAINER_MANAGEMENT_IP")
    elif sc.has("managementIpAddress"):
        # sc.has() above: the value is present, so str() returns it, never the None default
        management_ip = _ip(cast(str, sc.str("managementIpAddress", None)), "ServerConfig.managementIpAddress")
    else:
        management_ip = ip_address
    port = sc.int("port", 1025, 1024, 65535)
    management_port = sc.int("managementPort", port, 1024, 65535)
    metrics_port = sc.int("metricsPort", 1027, 1024, 65535)
    allow_zero = sc.bool("allowAllZeroIpListening", False)
    https = sc.bool("httpsEnabled", True)
    max_link_num = sc.int("maxLinkNum", 1000, 1, 4096)
    infer_mode = sc.str("inferMode", "dmi", ("standard", "dmi"))
    max_request_mb = sc.int("maxRequestLength", 40, 1, 100)
    # pdlink's own bounds against hostile clients (docs/server.md, "Hostile clients"); maxJsonDepth
    # is MindIE's field. One client must leave at least one of maxLinkNum connections to others.
    per_client_max = max(1, max_link_num - 1)
    max_links_per_client = sc.int("maxLinksPerClient", min(16, per_client_max), 1, 4096)
    if max_links_per_client > per_client_max:
        raise ConfigError(f"ServerConfig.maxLinksPerClient ({max_links_per_client}) must be below maxLinkNum "
                          f"({max_link_num}), so that one client cannot take every connection")
    head_timeout_ms = sc.int("headTimeoutMs", 10_000, 100, 600_000)
    body_timeout_ms = sc.int("bodyTimeoutMs", 60_000, 100, 3_600_000)
    max_json_depth = sc.int("maxJsonDepth", 32, 5, 512)

    for ip, what in ((ip_address, "ipAddress"), (management_ip, "the management address")):
        if _is_all_zero(ip) and not allow_zero:
            raise ConfigError(f"{what} {ip} would listen on all interfaces; set ServerConfig."
                              "allowAllZeroIpListening to true to allow it, or bind a specific address")

    def tls_for(name: str, plane: str) -> TlsFiles | None:
        if not https:
            return None
        return _check_tls_files(_tls_files(sc, name, home), plane, warnings)

    mgmt_is_business = management_ip == ip_address and management_port == port
    mgmt_routes: tuple[str, ...] = ("management",)
    planes: list[Plane] = []
    if metrics_port == management_port:
        mgmt_routes = ("management", "metrics")
    planes.append(Plane("management", management_ip, management_port, mgmt_routes,
                        tls_for("business" if mgmt_is_business else "management", "management")))
    if metrics_port != management_port:
        metrics_is_business = management_ip == ip_address and metrics_port == port
        planes.append(Plane("metrics", management_ip, metrics_port, ("metrics",),
                            tls_for("business" if metrics_is_business else "metrics", "metrics")))
    if not https and not ipaddress.ip_address(management_ip).is_loopback:
        warnings.append(f"httpsEnabled is false and the management plane listens on {management_ip}, which is "
                        "not a loopback address: role assignments and status travel unencrypted and "
                        "unauthenticated; enable HTTPS")

    kv = _kv_section(root, home, env)
    if kv.test_kv.enabled:
        warnings.append("KvTransferConfig.testKv is enabled: test KV caches are registered and "
                        "POST /v1/pdlink/test/kv/pull is served; never enable it in production")
    model = _model_section(root, kv.device_count)
    return Settings(
        source=source, home=home, ip_address=ip_address, management_ip=management_ip, port=port,
        management_port=management_port, metrics_port=metrics_port, https_enabled=https,
        allow_all_zero_ip=allow_zero, max_link_num=max_link_num, infer_mode=infer_mode,
        max_request_bytes=max_request_mb * 1024 * 1024, max_links_per_client=max_links_per_client,
        head_timeout_ms=head_timeout_ms, body_timeout_ms=body_timeout_ms, max_json_depth=max_json_depth,
        planes=tuple(planes), kv=kv, model=model,
        warnings=tuple(warnings),
    )
