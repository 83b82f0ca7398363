"""The ``pdlink`` command: ``demo``, ``version``, ``serve``, ``role``, ``status``, ``stats`` and ``hosts``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import cast

from .server.roles import ROLE_NAMES


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default="127.0.0.1:1026",
                   help="management plane HOST:PORT (default 127.0.0.1:1026, the embedded default's); "
                        "an IPv6 host goes in brackets")
    p.add_argument("--http", action="store_true", help="plain HTTP (a server with httpsEnabled: false)")
    p.add_argument("--ca", help="CA file to verify the server with (default: the system store)")
    p.add_argument("--cert", help="client certificate (mutual TLS)")
    p.add_argument("--key", help="client private key")
    p.add_argument("--check-hostname", action="store_true",
                   help="also check the server's host name (MindIE's controller does not)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per request attempt (default 5)")
    p.add_argument("--retries", type=int, default=3, help="retries on transport failures (default 3)")


def _client(args: argparse.Namespace):
    from .client import ManagementClient

    host, sep, port = args.server.rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"pdlink: --server must be HOST:PORT, got {args.server!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return ManagementClient(host, int(port), https=not args.http, ca=args.ca, cert=args.cert, key=args.key,
                            check_hostname=args.check_hostname, timeout=args.timeout, retries=args.retries)


def _serve(args: argparse.Namespace) -> int:
    from .server import config

    if args.print_default_config:
        from .server.defaults import DEFAULT_CONFIG_JSON

        print(DEFAULT_CONFIG_JSON, end="")
        return 0
    try:
        settings = config.load(args.config)
        for w in settings.warnings:
            logging.getLogger("pdlink.server").warning("%s", w)
        if args.check_config:
            if settings.https_enabled:  # build the TLS contexts too: the files must load
                from .server.tls import server_context

                for p in settings.planes:
                    assert p.tls is not None  # every plane has TLS when httpsEnabled
                    server_context(p.tls, p.name)
            print(json.dumps(settings.summary(), indent=2))
            return 0
        from .server.main import serve

        return serve(settings)
    except config.ConfigError as e:
        print(f"pdlink serve: configuration error: {e}", file=sys.stderr)
        return 2


def _role(args: argparse.Namespace) -> int:
    from .client import ClientError, NodeSpec, role_body

    if args.body:
        try:
            with (sys.stdin if args.body == "-" else open(args.body, encoding="utf-8")) as f:
                body = json.load(f)
        except (OSError, ValueError) as e:
            print(f"pdlink role: cannot read --body {args.body}: {e}", file=sys.stderr)
            return 2
    else:
        if not args.local:
            print("pdlink role: give --local ID@IP[:DEV,...] (and --peer ...), or --body FILE", file=sys.stderr)
            return 2
        try:
            body = role_body(NodeSpec.parse(args.local), [NodeSpec.parse(p) for p in args.peer or []],
                             args.p_percentage)
        except ValueError as e:
            print(f"pdlink role: {e}", file=sys.stderr)
            return 2
    client = _client(args)
    try:
        client.post_role(args.role, body, result_retries=args.result_retries, result_wait=args.interval)
        print(f"{args.role}: accepted")
        if args.no_wait:
            return 0
        status = client.wait_ready(args.role, timeout=args.wait_timeout, interval=args.interval)
    except ClientError as e:
        print(f"pdlink role: {e}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2))
    return 0


def _status(args: argparse.Namespace) -> int:
    from .client import ClientError

    client = _client(args)
    try:
        out = {"status": client.status()}
        if args.config:
            out["config"] = client.config()
    except ClientError as e:
        print(f"pdlink status: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out if args.config else out["status"], indent=2))
    return 0


def _stats(args: argparse.Namespace) -> int:
    from . import statsview

    try:
        url = statsview.metrics_url(args.target)
    except ValueError as e:
        print(f"pdlink stats: {e}", file=sys.stderr)
        return 2
    for name in ("interval", "timeout", "count"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            print(f"pdlink stats: --{name} must be > 0", file=sys.stderr)
            return 2
    context = None
    if url.startswith("https://"):
        from .server.tls import client_context

        try:
            context = client_context(args.ca, args.cert, args.key, args.check_hostname)
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            print(f"pdlink stats: TLS files: {e}", file=sys.stderr)
            return 2
    return statsview.run(url, interval=args.interval, count=args.count, once=args.once, timeout=args.timeout,
                         context=context)


def _env() -> int:
    """Every PDLINK_* variable pdlink reads (its Python layer's and its C++ core's), what each is set
    to now, its default and its meaning; a PDLINK_* variable that is set but that pdlink does not
    read (a misspelling) is named on stderr."""
    from . import environment

    variables = [(v, "python") for v in environment.VARIABLES] + [(v, "core") for v in environment.native_variables()]
    for v, layer in variables:
        raw = os.environ.get(v.name)
        if raw is None:
            now = "unset"
        elif v is environment.LINK_SECRET:
            now = "set (not shown)"
        else:
            now = repr(raw)
        default = "none" if v.default is None else repr(v.default)
        print(f"{v.name}={now}  [{layer}; default {default}] {v.meaning}")
    known = {v.name for v, _ in variables}
    for name in sorted(n for n in os.environ if n.startswith("PDLINK_") and n not in known):
        print(f"pdlink env: {name} is set, but pdlink reads no variable of that name", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdlink",
                                     description="KV-cache transfer between prefill and decode instances")
    parser.add_argument("-v", "--verbose", action="store_true", help="log pdlink's Python layer at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="two processes: move KV, verify, switch roles, move it back, print GB/s")
    demo.add_argument("--size-mib", type=int, default=64, help="bytes moved per pull (default 64 MiB)")
    demo.add_argument("--block-kib", type=int, default=256, help="KV block size (default 256 KiB)")
    demo.add_argument("--tensors", type=int, default=8, help="tensors in the cache, K and V of each layer (default 8)")
    demo.add_argument("--repeat", type=int, default=5, help="pulls per direction; the median is reported (default 5)")
    sub.add_parser("version", help="print versions")
    sub.add_parser("env", help="print every PDLINK_* variable: what it is set to, its default and its meaning")

    serve = sub.add_parser("serve", help="run the MindIE-compatible management server (needs pdlink[server])",
                           description="Host one pdlink engine per local device behind MindIE's management API. "
                                       "Config: --config, else $MIES_CONFIG_JSON_PATH, else "
                                       "$MINDIE_LLM_HOME_PATH or $MIES_INSTALL_PATH /conf/config.json, else the "
                                       "embedded default (plain HTTP on 127.0.0.1:1026). See docs/server.md.")
    serve.add_argument("--config", help="configuration file (MindIE config.json shape)")
    serve.add_argument("--check-config", action="store_true",
                       help="load and check the configuration, print the effective settings, exit")
    serve.add_argument("--print-default-config", action="store_true", help="print the embedded default and exit")

    role = sub.add_parser("role", help="assign a role to a server, as MindIE's controller does, and wait until ready")
    role.add_argument("role", choices=list(ROLE_NAMES))
    role.add_argument("--local", help="this instance: ID@IP[:DEV,...] (device ids; default device 0)")
    role.add_argument("--peer", action="append", help="a peer instance, ID@IP[:DEV,...]; repeat for several")
    role.add_argument("--p-percentage", type=int, help="flex only: prefill share in percent")
    role.add_argument("--body", help="send this JSON file as the body instead ('-': stdin)")
    role.add_argument("--no-wait", action="store_true", help="do not wait for RoleReady")
    role.add_argument("--wait-timeout", type=float, default=60.0, help="seconds to wait for RoleReady (default 60)")
    role.add_argument("--interval", type=float, default=1.0,
                      help="seconds between status polls and between re-posts (default 1)")
    role.add_argument("--result-retries", type=int, default=3,
                      help="re-posts when the answer is 200 without result 'ok' (default 3)")
    _add_client_args(role)

    status = sub.add_parser("status", help="print a server's GET /v1/status")
    status.add_argument("--config", action="store_true", help="also print GET /v1/config")
    _add_client_args(status)

    stats = sub.add_parser("stats", help="live per-peer throughput, latency and failures from a metrics endpoint",
                           description="Read a pdlink Prometheus metrics endpoint and print, per (labels, peer, "
                                       "path, op): transfers, bytes, GB/s, p50/p90/p99 latency (stage total) and "
                                       "failures, with links and link events below. The first frame is "
                                       "cumulative since the engine started (GB/s over busy time); later frames "
                                       "are the interval between two scrapes. Needs pdlink[server] "
                                       "(prometheus-client).")
    stats.add_argument("target", metavar="HOST:PORT",
                       help="the metrics endpoint: HOST:PORT (http://HOST:PORT/metrics; an IPv6 host in "
                            "brackets), or a full http(s):// URL")
    stats.add_argument("--once", action="store_true", help="print one cumulative table and exit (for scripts)")
    stats.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    stats.add_argument("--count", type=int, help="stop after this many frames (default: until Ctrl-C)")
    stats.add_argument("--timeout", type=float, default=5.0, help="seconds per scrape (default 5)")
    stats.add_argument("--ca", help="https: CA file to verify the endpoint with (default: the system store)")
    stats.add_argument("--cert", help="https: client certificate (mutual TLS)")
    stats.add_argument("--key", help="https: client private key")
    stats.add_argument("--check-hostname", action="store_true", help="https: also check the endpoint's host name")

    from .testing import hosts_cli  # argparse and the standard library only; hosts are made on demand

    hosts_cli.add_parser(sub)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if args.command == "version":
        from . import __version__
        from .native import core

        _core = core()

        ascend = _core.ascend_info()
        where = ascend.get("library_dir") or "the loader path"
        state = f"loaded from {where}" if ascend["loaded"] else "unavailable: " + cast(str, ascend["error"])
        print(f"pdlink {__version__} (wire protocol {_core.PROTOCOL_VERSION}, backends: cpu, ascend)")
        print(f"ascend runtime: {state}")
        ucx = _core.ucx_info()
        ucx_state = (f"UCX {ucx['version']} loaded from {ucx['library']}" if ucx["loaded"]
                     else "unavailable: " + cast(str, ucx["error"]))
        print(f"ucx: {ucx_state}")
        if ucx["loaded"]:
            probe = _core.ucx_network_probe()
            lanes = cast(list[str], probe["lanes"])
            if probe["error"]:
                print(f"ucx network transports: unknown ({probe['error']})")
            else:
                print(f"ucx network transports: {', '.join(lanes) or 'none reported'}")
            between = ("ucx (with ucx_trusted_network)" if probe["auto_between_hosts"]
                       else "tcp (no RDMA transport among these; docs/ucx.md)")
            print(f"auto between hosts: {between}")
        return 0
    if args.command == "env":
        return _env()
    if args.command == "serve":
        return _serve(args)
    if args.command == "role":
        return _role(args)
    if args.command == "status":
        return _status(args)
    if args.command == "stats":
        return _stats(args)
    if args.command == "hosts":
        return hosts_cli.main(args)
    for name in ("size_mib", "block_kib", "tensors", "repeat"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    from .demo import run

    return run(size_mib=args.size_mib, block_kib=args.block_kib, num_tensors=args.tensors, repeat=args.repeat)


if __name__ == "__main__":
    sys.exit(main())
