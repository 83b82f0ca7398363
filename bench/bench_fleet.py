"""A fleet across hosts: N ``pdlink serve`` instances on H emulated hosts, driven by role storms.

    python bench/bench_fleet.py                       # 32 instances, 4 hosts, profile dc, 100 storms
    python bench/bench_fleet.py --loopback            # the same on this machine's loopback (baseline)
    python bench/bench_fleet.py -n 8 --hosts 2 --storms 5 --profile loopback

What it does and measures is described in ``bench/fleet_driver.py`` (the driver, shared with
``tests/fleet/test_fleet.py``): mutual TLS on every management plane, a link secret on every KV
link, a MindIE-like controller posting role storms (the P:D split changes each storm, only the
difference switches), test pulls of real KV (verified byte for byte by the pulling server) during
and after each storm, one host pair partitioned (``--partition-storm``) and one instance killed and
restarted (``--kill-storm``) mid-storm. It prints a JSON summary and writes it, the raw records and
a text report under ``--out`` (default ``bench/results/fleet-<profile>``), and a plot (roles and pull
throughput over time) to ``--plot`` (default ``docs/perf/fleet-<profile>.png``).

Emulated hosts need ``pdlink.testing.hosts`` and root; without them use ``--loopback``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from fleet_driver import Fleet, Loopback, free_bases, hosts_module, summary, workdir_under  # noqa: E402


def options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--instances", type=int, default=32)
    p.add_argument("--hosts", type=int, default=4, help="hosts that run instances (the controller gets one more)")
    p.add_argument("--profile", default="dc", help="wire profile of pdlink.testing.hosts (default dc)")
    p.add_argument("--loopback", action="store_true", help="run on this machine's loopback, no emulated hosts")
    p.add_argument("--storms", type=int, default=100)
    p.add_argument("--kill-storm", type=int, default=None,
                   help="storm in which an instance is killed (default storms/2)")
    p.add_argument("--partition-storm", type=int, default=None,
                   help="storm in which two hosts are partitioned (default storms/3; never on loopback)")
    p.add_argument("--partition-s", type=float, default=3.0)
    p.add_argument("--pullers", type=int, default=2, help="threads pulling while a storm converges")
    p.add_argument("--storm-timeout", type=float, default=90.0)
    p.add_argument("--transport", default="tcp")
    p.add_argument("--mgmt-base", type=int, default=None,
                   help="first management port of a host (default 21000; on loopback: free ports found)")
    p.add_argument("--kv-base", type=int, default=None, help="KV listenPortBase (default 26000; loopback: found)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    return p.parse_args(argv)


def plot(fleet: Fleet, path: str, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install '.[bench]'); no plot written"
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    end = max([p.t for p in fleet.pulls] + [t for t, _, _ in fleet.timeline.roles] + [1.0])
    ts = [t for t, _, _ in fleet.timeline.roles] + [end]
    ax1.step(ts, [p for _, p, _ in fleet.timeline.roles] + [fleet.timeline.roles[-1][1]], where="post", label="prefill")
    ax1.step(ts, [d for _, _, d in fleet.timeline.roles] + [fleet.timeline.roles[-1][2]], where="post", label="decode")
    for t, text in fleet.timeline.events:
        if "SIGKILL" in text or "partitioned" in text:
            ax1.axvline(t, color="red", lw=0.8)
            ax2.axvline(t, color="red", lw=0.8)
    ax1.set_ylabel("instances (planned role)")
    ax1.legend(loc="upper right")
    ax1.set_title(title)
    bins = int(end) + 1
    ok = [0.0] * bins
    bad = [0] * bins
    for p in fleet.pulls:
        if p.status == 200:
            ok[int(p.t)] += p.nbytes / 2**20
        else:
            bad[int(p.t)] += 1
    ax2.plot(range(bins), ok, label="verified pulls, MiB/s")
    ax2.plot(range(bins), bad, label="failed pulls / s", color="orange")
    ax2.set_xlabel("seconds (red: a fault)")
    ax2.set_ylabel("pulls")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"plot written to {path}"


def report(s: dict[str, Any]) -> str:
    c, p, r = s["converge_s"], s["pulls"], s["resources"]

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        f"pdlink fleet: {s['instances']} instances on {s['hosts']} hosts, wire {s['profile']} "
        f"(tcp connect host 0 -> 1: {s.get('wire_rtt_ms_host0_host1')} ms), {s['storms']} storms; "
        f"machine load average (1 min) at start / end {s.get('machine_load_1min_start_end')}",
        f"converged {s['converged']}/{s['storms']}; time to converge p50 {f(c['p50'])} s, p99 {f(c['p99'])} s, "
        f"max {f(c['max'])} s (min {f(c['min'])} s)",
        f"posts {s['posts']} (switched {s['switched']}), re-posts by the controller's sync {s['reposts']}: "
        f"{json.dumps(s['repost_reasons'])}",
        f"faults: {json.dumps(s['faults'])}",
        f"pulls {p['total']}: ok {p['ok']}, wrong-byte pulls {p['wrong_bytes_pulls']}, after-storm ok "
        f"{p['after_ok']} failed {p['after_failed']}; failed by phase/code: {json.dumps(p['failed_by_code'])}",
    ]
    for key in ("threads", "fds", "rss_kib"):
        v = r[key]
        lines.append(f"{key} per instance: first >= {v['first_min']}, last <= {v['last_max']}, max {v['max']}, "
                     f"growth first->last max {v['growth_first_to_last_max']} "
                     f"(median {v['growth_first_to_last_median']})")
    g = s["same_links_growth"]
    lines.append(f"same instance, same number of links, later minus earlier ({g['groups']} groups, spans up to "
                 f"{g['span_s_max'] and round(g['span_s_max'])} s): " +
                 ", ".join(f"{k} max {g[k]['max']} median {g[k]['median']}" for k in ("threads", "fds", "rss_kib")))
    h = g["rss_kib_second_half"]
    lines.append(f"rss_kib over the second half of each process's life ({h['processes']} processes): "
                 f"min {h['min']} median {h['median']} max {h['max']}")
    lines += ["events:"] + [f"  {e}" for e in s["events"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    storms = args.storms
    kill = args.kill_storm if args.kill_storm is not None else storms // 2
    part = None if args.loopback else (args.partition_storm if args.partition_storm is not None else storms // 3)
    if args.loopback:
        hosts_cm: Any = Loopback(args.hosts)
        profile = "loopback (this machine's, no emulated hosts)"
    else:
        mod, why = hosts_module()
        if mod is None:
            raise SystemExit(f"emulated hosts are not available: {why}; use --loopback")
        hosts_cm = mod.Hosts(args.hosts + 1, profile=args.profile)
        profile = args.profile
    build = os.path.join(ROOT, "build")
    os.makedirs(build, exist_ok=True)
    t_start = time.monotonic()
    load_start = os.getloadavg()[0]
    with hosts_cm as hosts, workdir_under(build) as work:
        per_host = -(-args.instances // args.hosts)
        found = free_bases([hosts[i].ip for i in range(args.hosts)], per_host) if args.loopback else (21000, 26000)
        mgmt_base = args.mgmt_base if args.mgmt_base is not None else found[0]
        kv_base = args.kv_base if args.kv_base is not None else found[1]
        fleet = Fleet(hosts, args.instances, work, controller_host=not args.loopback, seed=args.seed,
                      transport=args.transport, mgmt_base=mgmt_base, kv_base=kv_base,
                      pullers=args.pullers, storm_timeout=args.storm_timeout)
        try:
            fleet.start()
            rtt = fleet.tcp_rtt_ms(0, 1) if args.hosts > 1 else None
            print(f"{args.instances} instances up in {time.monotonic() - t_start:.1f} s", flush=True)
            for k in range(storms):
                fault = "kill" if k == kill else "partition" if k == part else ""
                rec = fleet.storm(fault, partition_s=args.partition_s)
                print(f"storm {rec.index}: P={rec.prefills} switched {len(rec.switched)} posted {rec.posted} "
                      f"{fault} converged {rec.converged_s if rec.converged_s is None else round(rec.converged_s, 3)}"
                      f" s, re-posts {rec.reposts}, after-pulls ok {rec.after_ok} failed {rec.after_failed}",
                      flush=True)
            finals = fleet.final_states()
        finally:
            codes = fleet.stop()
        s = summary(fleet)
        s["profile"] = profile
        s["wire_rtt_ms_host0_host1"] = rtt
        s["wall_s"] = time.monotonic() - t_start
        s["machine_load_1min_start_end"] = [load_start, os.getloadavg()[0]]  # other work on the machine
        s["exit_codes"] = sorted({str(c) for c in codes.values()})
        services = [st.get("service", {}) for st in finals.values()]
        s["final_states"] = sorted({f"{sv.get('roleStatus')}/{sv.get('currentRole')}" for sv in services})
        out = args.out or os.path.join(HERE, "results", f"fleet-{'loopback' if args.loopback else args.profile}")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(s, f, indent=1)
        with open(os.path.join(out, "records.json"), "w") as f:
            json.dump({"storms": [dataclasses.asdict(x) for x in fleet.storms],
                       "pulls": [dataclasses.asdict(x) for x in fleet.pulls],
                       "samples": [dataclasses.asdict(x) for x in fleet.samples],
                       "roles": fleet.timeline.roles}, f)
        text = report(s)
        with open(os.path.join(out, "report.txt"), "w") as f:
            f.write(text + "\n")
        name = "loopback" if args.loopback else args.profile
        png = args.plot or os.path.join(ROOT, "docs", "perf", f"fleet-{name}.png")
        print(plot(fleet, png, f"{args.instances} pdlink serve instances, {args.hosts} hosts, {profile}"))
        print(text)
        print(json.dumps({k: v for k, v in s.items() if k != "per_instance"}))
        return s


if __name__ == "__main__":
    run(options())
