"""The emulated wire's own floor, and each profile as measured (pdlink.testing.hosts, docs/hosts.md).

Two hosts per configuration:

  * veth            : the plain wire (profile ``loopback``): veth pairs into the switch's bridge;
  * relay           : the userspace relay (pdlink-wire) with nothing to do (``Wire(relay=True)``): what
                      it adds by itself, at MTU 1500 and 9000;
  * rack, dc, wan   : the profiles.

Measured: TCP rate host 0 -> host 1 by iperf3 with one stream and with four (-P1, -P4); the round
trip of a ping (ICMP echo: host 1's kernel answers and the reply is timed by host 0's kernel, so it
is the wire and two kernels, no process's wake-up; p50/p99 over many), and of a 64-byte UDP datagram
echoed by a Python process on host 1 (p50: what an application sees on this machine, wake-ups
included). A profile passes when its iperf3 -P1 and -P4 rates are within RATE_TOLERANCE of its cap,
and its median ping is at least twice its one-way delay and at most that plus the relay's own
median ping (its floor) plus RTT_SLACK_US. A cap above what the unshaped relay moves is reported as
below the floor, never claimed.

    python bench/bench_wire.py                  # about a minute
    python bench/bench_wire.py --smoke          # seconds: one short run of each kind, no verdicts
    python bench/bench_wire.py --json out.json  # also write the rows
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from pdlink.testing.hosts import PROFILES, Hosts, Wire, unavailable_reason
from pdlink.testing.probes import icmp_probe, udp_echo, udp_probe

ECHO_PORT = 7100
RATE_TOLERANCE = 0.15  # a capped rate is within +-15 % of the cap (TCP over a token bucket)
RTT_SLACK_US = 200.0  # the median round trip may exceed 2 x delay + the relay's floor by this much


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def iperf(hosts: Hosts, streams: int, seconds: float) -> float:
    """iperf3 host 0 -> host 1, Mbit/s received."""
    server = hosts[1].spawn(["iperf3", "-s", "-1", "-B", hosts[1].ip], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while "5201" not in hosts[1].run(["ss", "-ltn"], text=True).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError("iperf3 server did not start")
            time.sleep(0.02)
        run = hosts[0].run(
            ["iperf3", "-c", hosts[1].ip, "-t", str(seconds), "-P", str(streams), "-J"], text=True, timeout=seconds + 60
        )
        if run.returncode != 0:
            raise RuntimeError(f"iperf3: {run.stdout[-500:]} {run.stderr[-500:]}")
        return float(json.loads(run.stdout)["end"]["sum_received"]["bits_per_second"]) / 1e6
    finally:
        server.kill()
        server.wait(30)


def pings(hosts: Hosts, count: int) -> list[float]:
    rtts: list[float] = hosts[0].run(icmp_probe, hosts[1].ip, count, 56, 2.0, 0.0005, timeout=600)["rtts_us"]
    return rtts


def round_trips(hosts: Hosts, count: int) -> list[float]:
    echo = hosts[1].spawn(udp_echo, hosts[1].ip, ECHO_PORT, 600.0)
    try:
        deadline = time.monotonic() + 30
        while not hosts[0].run(udp_probe, hosts[1].ip, ECHO_PORT, 1, 64, 0.5)["rtts_us"]:
            if time.monotonic() > deadline:
                raise RuntimeError("the echo did not answer")
        rtts: list[float] = hosts[0].run(udp_probe, hosts[1].ip, ECHO_PORT, count, 64, 2.0, timeout=600)["rtts_us"]
        return rtts
    finally:
        echo.kill()
        echo.join(10)


def measure(name: str, wire: Wire, seconds: float, probes: int) -> dict[str, Any]:
    count = probes if wire.delay_us < 5000 else max(20, probes // 5)
    with Hosts(2, wire) as hosts:
        ping = pings(hosts, count)
        rtts = round_trips(hosts, max(20, count // 5))
        p1 = iperf(hosts, 1, seconds)
        p4 = iperf(hosts, 4, seconds)
    return {
        "config": name,
        "rate_mbit": wire.rate_mbit,
        "delay_us": wire.delay_us,
        "loss": wire.loss,
        "mtu": wire.mtu,
        "iperf_p1_mbit": round(p1, 1),
        "iperf_p4_mbit": round(p4, 1),
        "ping_p50_us": round(statistics.median(ping), 1),
        "ping_p99_us": round(pct(ping, 99), 1),
        "ping_n": len(ping),
        "udp_echo_p50_us": round(statistics.median(rtts), 1),
        "udp_echo_n": len(rtts),
    }


def verdict(row: dict[str, Any], floor_rtt_us: float, floor_mbit: float) -> str:
    notes = []
    if row["rate_mbit"] is not None:
        cap = row["rate_mbit"]
        if cap > floor_mbit:
            notes.append(f"cap {cap} Mbit/s above the relay's floor {floor_mbit:.0f}: not claimed")
        elif any(abs(row[k] - cap) > RATE_TOLERANCE * cap for k in ("iperf_p1_mbit", "iperf_p4_mbit")):
            notes.append(f"rate off by more than {RATE_TOLERANCE:.0%}")
    want = 2 * row["delay_us"]
    if row["ping_p50_us"] < want * 0.98:
        notes.append("round trip shorter than the delay")
    elif row["ping_p50_us"] > want + floor_rtt_us + RTT_SLACK_US:
        notes.append("round trip beyond delay + floor + slack")
    return "ok" if not notes else "; ".join(notes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="seconds: one short run of each kind, no verdicts")
    parser.add_argument("--seconds", type=float, default=3.0, help="iperf3 time per run (default 3)")
    parser.add_argument("--probes", type=int, default=1000, help="UDP round trips per configuration (default 1000)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    why = unavailable_reason()
    if why is not None:
        print(f"bench_wire: hosts cannot be made here: {why}", file=sys.stderr)
        return 1
    seconds, probes = (1.0, 20) if args.smoke else (args.seconds, args.probes)
    configs: list[tuple[str, Wire]] = [
        ("veth", PROFILES["loopback"]),
        ("relay", Wire(relay=True)),
        ("relay mtu9000", Wire(relay=True, mtu=9000)),
    ]
    configs += [(name, PROFILES[name]) for name in ("rack", "dc", "wan")]
    if args.smoke:
        configs = [configs[0], configs[1], ("dc", PROFILES["dc"])]
    rows = [measure(name, wire, seconds, probes) for name, wire in configs]
    floor = next(r for r in rows if r["config"] == "relay")
    veth = rows[0]
    load = open("/proc/loadavg").read().split()[:3]
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# bench_wire: {stamp}, seconds={seconds}, probes={probes}, load average {' '.join(load)}")
    columns = ["config", "cap Mbit/s", "delay us (one way)", "iperf3 -P1 Mbit/s", "iperf3 -P4 Mbit/s"]
    columns += ["ping p50 us", "ping p99 us", "UDP echo p50 us", "verdict"]
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for r in rows:
        shaped = r["config"] in PROFILES
        floor_mbit = min(floor["iperf_p1_mbit"], floor["iperf_p4_mbit"])
        v = verdict(r, floor["ping_p50_us"], floor_mbit) if shaped and not args.smoke else "floor"
        if r is veth:
            v = "reference (no relay)"
        print(
            f"| {r['config']} | {r['rate_mbit'] or '-'} | {r['delay_us']} | {r['iperf_p1_mbit']} | "
            f"{r['iperf_p4_mbit']} | {r['ping_p50_us']} | {r['ping_p99_us']} | {r['udp_echo_p50_us']} | {v} |"
        )
        r["verdict"] = v
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
