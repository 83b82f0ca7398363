"""pdlink's tcp pull across two emulated hosts, beside iperf3 and Mooncake TE on the same wire.

For each wire profile of `pdlink.testing.hosts` asked for (loopback, rack, dc, wan), in ONE run of
two hosts with that profile (so every row has its ceilings from the same wire, same minutes):

  * pdlink: the link's round trip (median of 10 `Engine.ping`), then the decoder on host 1 pulls
    64 MiB (two tensors of 256 KiB blocks, reversed block order, so no two blocks coalesce) from
    the prompt on host 0 over transport "tcp" with the native API (`pdlink.Engine`, a prepared
    transfer); one warm-up pull, the bytes verified once, then timed pulls;
  * iperf3, the ceiling: the server on host 0 sends to a client on host 1 (`-R`: the same
    direction as the pull), with `-P 1` and with `-P S`, S being the number of streams pdlink's
    link uses; several runs, each its steady rate after an omitted start (`-O`);
  * Mooncake Transfer Engine's tcp read of the same 64 MiB in the same blocks, target on host 0
    bound to its address, initiator on host 1, P2P handshake (bench/peers/mooncake_hosts_peer.py),
    run with the interpreter in PDLINK_BENCH_MOONCAKE_PYTHON (its own virtualenv); skipped with a
    message when that interpreter cannot import it.

Reported per profile: medians with [min..max] in MB/s (and GB/s in the JSON), pdlink / iperf3 with
the same number of streams, and pdlink / Mooncake. Every run is bounded in time: a measurement
stops repeating once its budget is spent (at least one timed repetition), and every process has a
timeout. Results go to bench/results/hosts.json (merged by profile, so profiles can be run one at a
time), and the table (with each profile's wire and iperf3's retransmits) to stdout and
bench/results/hosts.txt.

Streams: `--streams S[,S2...]` asks pdlink for S tcp streams per link (default: the build's own
default), each count measured in the profile's run beside iperf3 -P S, through the engine's option
for it when this build has one (a field of `EngineOptions` or `Limits`, or a PDLINK_* variable,
whose name says "stream"); a build without one runs its single stream, and the report says so
("no option"). Where the link's record reports its streams (its lanes, "tcp xN"), that count is
used for the iperf3 comparison.

    python bench/bench_hosts.py --profiles dc,wan          # needs root (network namespaces)
    python bench/bench_hosts.py --streams 1,4              # pdlink with 1 and with 4 streams per link
    python bench/bench_hosts.py --congestion reno          # loss-based TCP in both hosts (default: the kernel's)
    python bench/bench_hosts.py --smoke --profiles loopback
    python bench/bench_hosts.py --same-host --smoke        # no namespaces: both sides on 127.0.0.1
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import selectors
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
MIB, KIB = 1024 * 1024, 1024
PROMPT_ID, DECODER_ID, REGION_KEY, SEED = 1, 2, 7, 11
ALL_PROFILES = ("loopback", "rack", "dc", "wan")
# targets of issue 33: pdlink >= 0.9x iperf3 (same streams) everywhere, >= 2x Mooncake on these
IPERF_TARGET, MOONCAKE_TARGET, MOONCAKE_PROFILES = 0.9, 2.0, ("dc", "wan")

# per profile: timed repetitions, the time budget of each measurement (s), iperf3 runs and the
# seconds of each (after `omit` seconds of start that iperf3 leaves out). At 100 Mb/s one pull of
# 64 MiB takes at least 5.4 s, so wan repeats least.
PLAN: dict[str, dict[str, float]] = {
    "loopback": {"reps": 5, "budget_s": 30, "iperf_runs": 3, "iperf_s": 3, "omit_s": 1},
    "rack": {"reps": 5, "budget_s": 30, "iperf_runs": 3, "iperf_s": 3, "omit_s": 1},
    "dc": {"reps": 5, "budget_s": 40, "iperf_runs": 3, "iperf_s": 4, "omit_s": 1},
    "wan": {"reps": 3, "budget_s": 120, "iperf_runs": 3, "iperf_s": 10, "omit_s": 2},
}
SMOKE = {"reps": 2, "budget_s": 10, "iperf_runs": 1, "iperf_s": 1, "omit_s": 0}


def summary(xs: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def pattern(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


# ---------------------------------------------------------------- pdlink's stream count


def stream_setting(streams: int | None) -> tuple[dict[str, Any], dict[str, str], str | None]:
    """How to ask this build of pdlink for `streams` tcp streams per link: (EngineOptions keyword
    arguments, environment variables, the option's name), found by name: a field of
    `EngineOptions` or of `Limits` whose name has "stream", else a PDLINK_* variable whose name has
    "STREAM". None as the option's name: the build has no such option (one stream per link).
    `streams` None: the option is found but left at the build's default."""
    import pdlink
    from pdlink import environment

    names = [f.name for f in dataclasses.fields(pdlink.EngineOptions) if "stream" in f.name]
    if names:
        return ({names[0]: streams} if streams else {}), {}, f"EngineOptions.{names[0]}"
    limits: Any = getattr(pdlink, "Limits", None)
    names = [f.name for f in dataclasses.fields(limits) if "stream" in f.name] if limits else []
    if names:
        return ({"limits": limits(**{names[0]: streams})} if streams else {}), {}, f"Limits.{names[0]}"
    variables = list(environment.VARIABLES)
    try:
        variables += list(environment.native_variables())
    except Exception:  # noqa: BLE001 - an older native module: no native variables to look at
        pass
    names = [v.name for v in variables if "STREAM" in v.name]
    if names:
        return {}, ({names[0]: str(streams)} if streams else {}), names[0]
    return {}, {}, None


def default_streams() -> int:
    """The tcp streams per link this build uses when not told (1 where it has no option for it)."""
    _, _, option = stream_setting(None)
    if option is None:
        return 1
    from pdlink.native import core

    value = getattr(core().EngineLimits(), option.rpartition(".")[2].lower(), None)
    return value if isinstance(value, int) and value > 0 else 1


def link_streams(links: list[dict[str, Any]]) -> int | None:
    """The stream count a link reports, when its record has one: a field whose name says
    "stream", or a lane "tcp xN" (the tcp path's lanes in `LinkInfo.lanes`)."""
    for link in links:
        for k, v in link.items():
            if "stream" in k and isinstance(v, int) and not isinstance(v, bool):
                return v
        for lane in link.get("lanes") or []:
            kind, _, count = str(lane).partition(" x")
            if kind == "tcp" and count.isdigit():
                return int(count)
    return None


# ---------------------------------------------------------------- the pdlink sides (run inside a host)


def engine_options(cluster_id: int, streams: int, timeout_ms: int, listen: str | None = None) -> Any:
    import pdlink

    fields, env, _ = stream_setting(streams)
    os.environ.update(env)
    return pdlink.EngineOptions(cluster_id=cluster_id, listen=listen, transport="tcp", timeout_ms=timeout_ms,
                                connect_timeout_ms=30000, **fields)


def tensors_of(total: int, block: int, seed: int | None) -> list[np.ndarray]:
    """The two tensors of a cache of `total` bytes in blocks of `block` bytes: a seeded pattern, or
    zeros when seed is None."""
    shape = (total // 2 // block, block)
    return [pattern(shape, seed + t) if seed is not None else np.zeros(shape, np.uint8) for t in range(2)]


def pdlink_target(ip: str, total: int, block: int, streams: int, timeout_ms: int) -> None:
    """The prompt side: registers the cache under REGION_KEY, listens on `ip`, prints one JSON line
    (port, the region's description), and serves until a line (or EOF) arrives on stdin."""
    import pdlink

    with pdlink.Engine(engine_options(PROMPT_ID, streams, timeout_ms, listen=f"{ip}:0")) as engine:
        region = engine.register(tensors_of(total, block, SEED), block_size=block, key=REGION_KEY)
        print(json.dumps({"port": engine.listen_port, "remote": dataclasses.asdict(region.remote())}), flush=True)
        sys.stdin.readline()


def pdlink_initiator(address: str, remote: dict[str, Any], total: int, block: int, streams: int,
                     timeout_ms: int, reps: int, budget_s: float) -> None:
    """The decoder side: links to `address` over tcp, pulls the whole cache (reversed block order)
    once to warm up, verifies every byte, then times up to `reps` pulls, stopping once `budget_s`
    has passed (at least one). Prints one JSON line."""
    import pdlink

    with pdlink.Engine(engine_options(DECODER_ID, streams, timeout_ms)) as engine:
        mine = tensors_of(total, block, None)
        local = engine.register(mine, block_size=block)
        t0 = time.perf_counter()
        peer = engine.connect(address, cluster_id=PROMPT_ID)
        connect_ms = (time.perf_counter() - t0) * 1e3
        links = [link.as_dict() for link in engine.links()]
        transports = {link["transport"] for link in links}
        if transports != {"tcp"}:
            raise AssertionError(f"asked for tcp, linked over {transports}")
        rtt_ms = []  # the wire's round trip as a link sees it: engine.ping
        for _ in range(10):
            t0 = time.perf_counter()
            engine.ping(peer)
            rtt_ms.append((time.perf_counter() - t0) * 1e3)
        job = engine.prepare(peer, local, pdlink.RemoteRegion(**remote))
        n = mine[0].shape[0]
        dst, src = np.arange(n), np.arange(n - 1, -1, -1)  # remote block n-1-i -> local block i
        t0 = time.perf_counter()
        job.read(dst, src)
        warm_s = time.perf_counter() - t0
        for t, arr in enumerate(mine):
            if not np.array_equal(arr, pattern(arr.shape, SEED + t)[src]):
                raise AssertionError(f"pdlink tcp pull across hosts: bytes differ in tensor {t}")
        gbps: list[float] = []
        start = time.perf_counter()
        while len(gbps) < reps and (not gbps or time.perf_counter() - start < budget_s):
            t0 = time.perf_counter()
            job.read(dst, src)
            gbps.append(total / (time.perf_counter() - t0) / 1e9)
        links = [link.as_dict() for link in engine.links()]
    print(json.dumps({"read": summary(gbps), "gbps": gbps, "verified": True, "warmup_s": warm_s,
                      "connect_ms": connect_ms, "rtt_ms": summary(rtt_ms),
                      "links": links}, default=str), flush=True)


# ---------------------------------------------------------------- processes on the hosts


@dataclasses.dataclass
class Site:
    """Where a process runs: an address and the prefix that runs an argv there."""

    ip: str
    command: Callable[[list[str]], list[str]]


class Server:
    """A long-lived process on a site whose first JSON line on stdout (or a line containing
    `ready`) says it is ready; stopped by a line on stdin, then killed after a grace period."""

    def __init__(self, argv: list[str], ready: str | None = None, timeout: float = 60) -> None:
        self._err: IO[bytes] = tempfile.TemporaryFile()
        self.name = " ".join(argv[-8:])
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err)
        self.info = self._wait_line(ready, timeout)

    def _wait_line(self, ready: str | None, timeout: float) -> Any:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        buf, deadline = b"", time.monotonic() + timeout
        try:
            while True:
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    text = line.decode(errors="replace").strip()
                    if ready is None and text.startswith("{"):
                        return json.loads(text)
                    if ready is not None and ready in text:
                        return text
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise RuntimeError(f"{self.name} was not ready within {timeout:.0f} s{self.stderr()}")
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"{self.name} exited ({self.proc.wait()}) before it was ready"
                                       f"{self.stderr()}")
                buf += chunk
        finally:
            sel.close()

    def stderr(self) -> str:
        self._err.seek(0)
        tail = self._err.read()[-2000:].decode(errors="replace").strip()
        return f": {tail}" if tail else ""

    def stop(self, grace: float = 15) -> int:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(b"stop\n")
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self._err.close()


def run_json(argv: list[str], timeout: float, whole: bool = False) -> dict[str, Any]:
    """Run argv to completion within `timeout` s; its last JSON line on stdout (`whole`: all of
    its stdout is one JSON document, as iperf3 -J writes it)."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"timed out after {timeout:.0f} s: {argv[-10:]}") from e
    if whole and r.returncode == 0:
        return json.loads(r.stdout)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"exited {r.returncode}: {(r.stderr or r.stdout).strip()[-2000:]}")
    return json.loads(lines[-1])


def measure_pdlink(src: Site, dst: Site, cfg: dict[str, Any], plan: dict[str, float], streams: int
                   ) -> dict[str, Any]:
    me = [sys.executable, os.path.abspath(__file__)]
    timeout_ms = int(plan["budget_s"] * 1000 + 60000)
    common = [str(cfg["total"]), str(cfg["block"]), str(streams), str(timeout_ms)]
    server = Server(src.command([*me, "_pdlink_target", src.ip, *common]))
    try:
        info = server.info
        out = run_json(dst.command([*me, "_pdlink_initiator", f"{src.ip}:{info['port']}", json.dumps(info["remote"]),
                                    *common, str(int(plan["reps"])), str(plan["budget_s"])]),
                       timeout=3 * plan["budget_s"] + 120)
    finally:
        server.stop()
    _, _, option = stream_setting(streams)
    reported = link_streams(out["links"])
    out["streams_asked"] = streams
    out["stream_option"] = option
    out["streams"] = reported if reported is not None else (streams if option else 1)
    return out


def measure_iperf3(src: Site, dst: Site, streams: int, plan: dict[str, float], port: int) -> dict[str, Any] | None:
    """iperf3 from host 0 to host 1 (server on the source, `-R`), `streams` parallel streams:
    the received rate of each run after its omitted start, GB/s."""
    exe = shutil.which("iperf3")
    if exe is None:
        print("  skipped iperf3: not installed (apt-get install iperf3)")
        return None
    gbps, retransmits = [], []
    for run in range(int(plan["iperf_runs"])):
        server = Server(src.command([exe, "-s", "-1", "-B", src.ip, "-p", str(port + run), "--forceflush"]),
                        ready="Server listening", timeout=30)
        try:
            seconds = int(plan["iperf_s"] + plan["omit_s"])
            r = run_json(dst.command([exe, "-c", src.ip, "-p", str(port + run), "-R", "-P", str(streams),
                                      "-t", str(seconds), "-O", str(int(plan["omit_s"])), "-J"]),
                         timeout=seconds + 60, whole=True)
        finally:
            server.stop(grace=10)
        end = r["end"]
        gbps.append(end["sum_received"]["bits_per_second"] / 8e9)
        retransmits.append(end.get("sum_sent", {}).get("retransmits"))
    return {**summary(gbps), "gbps": gbps, "streams": streams, "retransmits": retransmits}


def measure_mooncake(src: Site, dst: Site, cfg: dict[str, Any], plan: dict[str, float]) -> dict[str, Any] | None:
    python = os.environ.get("PDLINK_BENCH_MOONCAKE_PYTHON")
    if not python:
        print("  skipped Mooncake TE: set PDLINK_BENCH_MOONCAKE_PYTHON to an interpreter that has "
              "mooncake-transfer-engine")
        return None
    probe = subprocess.run([python, "-c", "from mooncake.engine import TransferEngine"], capture_output=True,
                           text=True, timeout=120)
    if probe.returncode != 0:
        print(f"  skipped Mooncake TE: `from mooncake.engine import TransferEngine` failed with {python}: "
              f"{probe.stderr.strip().splitlines()[-1:]}")
        return None
    script = os.path.join(HERE, "peers", "mooncake_hosts_peer.py")
    mib = str(cfg["total"] // MIB)
    server = Server(src.command([python, script, "target", src.ip, mib, str(SEED)]), timeout=120)
    try:
        info = server.info
        return run_json(dst.command([python, script, "initiator", dst.ip, info["segment"], str(info["address"]),
                                     mib, str(cfg["block"] // KIB), str(SEED), str(int(plan["reps"])),
                                     str(plan["budget_s"])]),
                        timeout=3 * plan["budget_s"] + 120)
    finally:
        server.stop()


def measure_profile(profile: str, src: Site, dst: Site, cfg: dict[str, Any], plan: dict[str, float]
                    ) -> dict[str, Any]:
    """One profile, one run: pdlink with each stream count asked for, then iperf3 with 1 stream and
    with each of pdlink's counts, then Mooncake. `pdlink`, `ratios`: by pdlink's stream count."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "plan": plan, "total": cfg["total"], "block": cfg["block"], "pdlink": {}}
    for asked in cfg["streams"]:
        print(f"[{profile}] pdlink tcp pull, {asked} stream(s) asked ...", flush=True)
        run = measure_pdlink(src, dst, cfg, plan, asked)
        out["pdlink"][str(run["streams"])] = run
    out["iperf3"] = {}
    for s in sorted({1, *(int(k) for k in out["pdlink"])}):
        print(f"[{profile}] iperf3 -P {s} ...", flush=True)
        out["iperf3"][str(s)] = measure_iperf3(src, dst, s, plan, port=5201 + 10 * s)
    if cfg["peers"]:
        print(f"[{profile}] Mooncake TE tcp read ...", flush=True)
        try:
            out["mooncake"] = measure_mooncake(src, dst, cfg, plan)
        except RuntimeError as e:  # reported, the rest of the row kept
            print(f"  Mooncake TE failed: {e}")
            out["mooncake"] = {"error": str(e)[-1000:]}
    mc = out.get("mooncake") or {}
    out["ratios"] = {}
    for k, run in out["pdlink"].items():
        p = run["read"]["median"]
        ceiling = out["iperf3"].get(k)
        out["ratios"][k] = {"pdlink_over_iperf3_same_streams": p / ceiling["median"] if ceiling else None,
                            "pdlink_over_mooncake": p / mc["read"]["median"] if "read" in mc else None}
    out["wall_s"] = time.monotonic() - t0
    return out


# ---------------------------------------------------------------- report


def mbps(s: dict[str, float] | None) -> str:
    if not s:
        return "-"
    return f"{s['median'] * 1e3:.1f} [{s['min'] * 1e3:.1f}..{s['max'] * 1e3:.1f}]"


def verdict(profile: str, r: dict[str, Any], streams: str) -> str:
    ratios, notes = r["ratios"][streams], []
    if r.get("wire_delay_applied") is False:
        notes.append("NOT this profile (the wire's delay was not applied)")
    a = ratios["pdlink_over_iperf3_same_streams"]
    if a is not None:
        notes.append(f"iperf3 {'met' if a >= IPERF_TARGET else 'NOT met'}")
    b = ratios["pdlink_over_mooncake"]
    if profile in MOONCAKE_PROFILES:
        notes.append("Mooncake not run" if b is None else f"Mooncake {'met' if b >= MOONCAKE_TARGET else 'NOT met'}")
    return ", ".join(notes)


def table(results: dict[str, Any], profiles: Sequence[str], size_mib: int) -> list[str]:
    """One row per profile and pdlink stream count S; every ceiling from the profile's own run."""
    head = (f"| profile | ping RTT, ms | streams S | pdlink tcp pull {size_mib} MiB, MB/s | iperf3 -P 1, MB/s | "
            "iperf3 -P S, MB/s | pdlink / iperf3 (S) | Mooncake TE tcp read, MB/s | pdlink / Mooncake | verdict |")
    lines = [head, "| " + " | ".join(["---"] * 10) + " |"]
    for name in profiles:
        r = results["profiles"].get(name)
        if r is None:
            continue
        mc = r.get("mooncake") or {}
        for k, p in sorted(r["pdlink"].items(), key=lambda kv: int(kv[0])):
            a, b = r["ratios"][k]["pdlink_over_iperf3_same_streams"], r["ratios"][k]["pdlink_over_mooncake"]
            lines.append(
                f"| {name} | {p['rtt_ms']['median']:.2f} | {k}{'' if p['stream_option'] else ' (no option)'} | "
                f"{mbps(p['read'])} | {mbps(r['iperf3'].get('1'))} | {mbps(r['iperf3'].get(k))} | "
                f"{'-' if a is None else f'{a:.2f}x'} | {mbps(mc.get('read')) if 'read' in mc else 'not run'} | "
                f"{'-' if b is None else f'{b:.2f}x'} | {verdict(name, r, k)} |")
    return lines


# ---------------------------------------------------------------- main


CONGESTION = "/proc/sys/net/ipv4/tcp_congestion_control"


def congestion_control(host: Any, algorithm: str | None) -> str:
    """The host's TCP congestion control (per network namespace), set to `algorithm` first when
    given (it must be in the machine's net.ipv4.tcp_allowed_congestion_control; nothing outside the
    host is changed)."""
    if algorithm:
        r = host.run(["sh", "-c", f"printf %s {algorithm} > {CONGESTION}"], timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"cannot set {algorithm} as the congestion control in a host: {r.stderr!r}")
    return host.run(["cat", CONGESTION], timeout=30, text=True).stdout.strip()


def run_profiles(profiles: Sequence[str], cfg: dict[str, Any], same_host: bool, smoke: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in profiles:
        plan = dict(SMOKE if smoke else PLAN[name])
        if same_host:
            local = Site("127.0.0.1", list)
            out["same-host"] = {**measure_profile("same-host", local, local, cfg, plan),
                                "wire": "none: both sides in this namespace on 127.0.0.1"}
            break
        from pdlink.testing.hosts import PROFILES, Hosts  # type: ignore[import-untyped,unused-ignore]

        with Hosts(2, profile=name) as hosts:
            congestion = {congestion_control(host, cfg["congestion"]) for host in hosts}
            src = Site(hosts[0].ip, hosts[0].command)
            dst = Site(hosts[1].ip, hosts[1].command)
            row = measure_profile(name, src, dst, cfg, plan)
            wire = PROFILES[name]
            row["wire"] = dataclasses.asdict(wire)
            row["congestion"] = ",".join(sorted(congestion))
            # the wire's own check: a link's round trip is at least twice the one-way delay asked for
            want_ms = 2 * wire.delay_us / 1e3
            got_ms = statistics.median(run["rtt_ms"]["median"] for run in row["pdlink"].values())
            row["wire_delay_applied"] = got_ms >= 0.8 * want_ms
            if not row["wire_delay_applied"]:
                print(f"  [{name}] the wire did not apply its delay: round trip {got_ms:.2f} ms, "
                      f"at least {want_ms:.2f} ms expected")
            out[name] = row
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_pdlink_target":
        ip, total, block, streams, timeout_ms = argv[1:6]
        pdlink_target(ip, int(total), int(block), int(streams), int(timeout_ms))
        return 0
    if argv and argv[0] == "_pdlink_initiator":
        address, remote, total, block, streams, timeout_ms, reps, budget = argv[1:9]
        pdlink_initiator(address, json.loads(remote), int(total), int(block), int(streams), int(timeout_ms),
                         int(reps), float(budget))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default=",".join(ALL_PROFILES), help="comma-separated, of " + ", ".join(ALL_PROFILES))
    ap.add_argument("--streams", default=None,
                    help="comma-separated tcp stream counts per pdlink link, each measured in the profile's run, "
                         "where the build has the option (default: the build's default)")
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--no-peers", action="store_true", help="skip Mooncake TE")
    ap.add_argument("--congestion", default=None,
                    help="TCP congestion control in both hosts, e.g. reno (default: the machine's); the "
                         "results then go to hosts-ALGO.json unless --out is given")
    ap.add_argument("--smoke", action="store_true", help="few, short repetitions: checks that everything runs")
    ap.add_argument("--same-host", action="store_true",
                    help="no hosts: both sides on 127.0.0.1 in this namespace (a check of the benchmark itself)")
    ap.add_argument("--out", default=None, help="default: bench/results/hosts.json")
    args = ap.parse_args(argv)
    profiles = [p for p in args.profiles.split(",") if p]
    unknown = set(profiles) - set(ALL_PROFILES)
    if unknown:
        ap.error(f"unknown profile(s) {sorted(unknown)}")
    asked = [int(x) for x in args.streams.split(",")] if args.streams else [default_streams()]
    if stream_setting(None)[2] is None and asked != [1]:
        print(f"this build of pdlink has no option for tcp streams: it runs one per link, not {asked}")
        asked = [1]
    cfg = {"total": args.size_mib * MIB, "block": args.block_kib * KIB, "streams": asked,
           "peers": not args.no_peers, "congestion": args.congestion}
    if args.out is None:
        args.out = os.path.join(HERE, "results", f"hosts-{args.congestion}.json" if args.congestion else "hosts.json")
    if not args.same_host:
        from pdlink.testing.hosts import unavailable_reason

        reason = unavailable_reason()
        if reason:
            print(f"no emulated hosts here: {reason}")
            return 2
    results: dict[str, Any] = {"profiles": {}}
    if os.path.exists(args.out):  # profiles are run one at a time too: keep the others
        with open(args.out) as f:
            results = json.load(f)
    measured = run_profiles(profiles, cfg, args.same_host, args.smoke)
    results["profiles"].update(measured)
    results["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform(), "smoke": args.smoke}
    lines = [f"pdlink tcp pull of {args.size_mib} MiB across two hosts ({args.block_kib} KiB blocks), "
             "median [min..max] MB/s; ceilings from the same run",
             *table(results, list(measured), args.size_mib)]
    for name in measured:
        row = results["profiles"][name]
        lines.append(f"{name}: {row['date']}, {row['wall_s']:.0f} s, wire {row.get('wire', 'none')}, "
                     f"congestion control {row.get('congestion', 'this host')}; iperf3 "
                     + ", ".join(f"-P {k} retransmits {v['retransmits']}" for k, v in row["iperf3"].items() if v))
    print("\n".join(lines))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.splitext(args.out)[0] + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
