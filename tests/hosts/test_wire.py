"""The emulated wire of pdlink.testing.hosts: delay, loss (random and in bursts), reordering, the
rate cap and the MTU come out as set, and the wire changes while traffic runs. Bounds are generous
(a loaded 2-core machine): a delay is never shorter than set, and at most a stated slack longer at
the median; a loss rate lies within several standard deviations. Measured rates and latencies:
bench/bench_wire.py (docs/hosts.md)."""

from __future__ import annotations

import json
import statistics
import subprocess
from collections.abc import Sequence

from hostbed import require_hosts
from pdlink.testing.hosts import PROFILES, Hosts, Wire
from pdlink.testing.probes import icmp_probe
from peers import hosts as hp
from poll import wait_until

DATA_PORT = 7011
SLACK_US = 3000  # the median round trip may exceed 2 x delay by this much (the relay on a loaded machine)


def round_trips(hosts: Hosts, count: int) -> list[float]:
    """Round trips host 0 -> host 1 -> host 0 of ``count`` pings, in microseconds (host 1's kernel
    answers; the reply is timed by host 0's kernel: the wire and two kernels, no process wake-up)."""
    probe = hosts[0].run(icmp_probe, hosts[1].ip, count, 56, 2.0)
    rtts: list[float] = probe["rtts_us"]
    assert len(rtts) >= count * 0.9, probe["lost"]
    return rtts


def one_way(hosts: Hosts, count: int, per_ms: int = 20) -> list[int]:
    """Send ``count`` numbered datagrams host 0 -> host 1; the sequence numbers host 1 got, in order."""
    receiver = hosts[1].spawn(hp.udp_receive, hosts[1].ip, DATA_PORT, count, 3.0)
    wait_until(lambda: str(DATA_PORT) in hosts[1].run(["ss", "-lun"], text=True).stdout, 30, "the receiver is bound")
    hosts[0].run(hp.udp_send, hosts[1].ip, DATA_PORT, count, 200, per_ms)
    got: list[int] = receiver.result(60)
    return got


def bursts(missing: Sequence[int]) -> list[int]:
    """Lengths of the runs of consecutive missing sequence numbers."""
    runs: list[int] = []
    previous = None
    for seq in sorted(missing):
        if previous is not None and seq == previous + 1:
            runs[-1] += 1
        else:
            runs.append(1)
        previous = seq
    return runs


def ahead_of_their_turn(seqs: Sequence[int]) -> int:
    """How many frames arrived before a frame sent earlier than they were."""
    ahead, lowest_later = 0, None
    for seq in reversed(seqs):
        if lowest_later is not None and seq > lowest_later:
            ahead += 1
        lowest_later = seq if lowest_later is None else min(lowest_later, seq)
    return ahead


def test_delay_is_the_profiles() -> None:
    require_hosts()
    with Hosts(2, Wire(delay_us=2000)) as hosts:
        rtts = round_trips(hosts, 100)
    p50 = statistics.median(rtts)
    assert min(rtts) >= 2 * 2000 * 0.98  # never shorter than the wire's delay, both ways
    assert p50 <= 2 * 2000 + SLACK_US, p50


def test_loss_random_and_in_bursts() -> None:
    require_hosts()
    count = 4000
    with Hosts(2, Wire(loss=0.1)) as hosts:
        got = one_way(hosts, count)
        lost = 1 - len(set(got)) / count
        assert 0.06 <= lost <= 0.14, lost  # 0.1 +- 8 standard deviations
        assert statistics.mean(bursts(sorted(set(range(count)) - set(got)))) < 1.5  # independent losses
        hosts.set_wire(Wire(loss=0.1, loss_burst=8))
        got = one_way(hosts, count)
        lost = 1 - len(set(got)) / count
        assert 0.03 <= lost <= 0.25, lost  # bursts make the rate noisier
        mean_burst = statistics.mean(bursts(sorted(set(range(count)) - set(got))))
        assert 3 <= mean_burst <= 20, mean_burst


def test_reordering() -> None:
    require_hosts()
    with Hosts(2, Wire(delay_us=1000, reorder=0.2)) as hosts:
        got = one_way(hosts, 1000)
    assert len(got) == 1000
    assert ahead_of_their_turn(got) >= 80  # about 0.2 x 1000 frames sent ahead (1 - sqrt(0.8) on each link)
    with Hosts(2, Wire(delay_us=1000, jitter_us=500)) as hosts:
        got = one_way(hosts, 1000)
    assert got == sorted(got)  # jitter alone never reorders


def test_rate_cap_is_the_profiles() -> None:
    require_hosts()
    with Hosts(2, Wire(rate_mbit=200)) as hosts:
        server = hosts[1].spawn(["iperf3", "-s", "-1", "-B", hosts[1].ip], stdout=subprocess.DEVNULL)
        try:
            wait_until(lambda: "5201" in hosts[1].run(["ss", "-ltn"], text=True).stdout, 30, "iperf3 listens")
            run = hosts[0].run(["iperf3", "-c", hosts[1].ip, "-t", "2", "-J"], text=True, timeout=60)
        finally:
            server.kill()
            server.wait(30)
    assert run.returncode == 0, run.stderr
    mbit = json.loads(run.stdout)["end"]["sum_received"]["bits_per_second"] / 1e6
    assert 0.75 * 200 <= mbit <= 1.05 * 200, mbit


def test_mtu_and_a_profile_on_some_hosts_while_traffic_runs() -> None:
    require_hosts()
    with Hosts(3, Wire(mtu=9000)) as hosts:
        assert "mtu 9000" in hosts[0].run(["ip", "link", "show", "eth0"], text=True).stdout
        fast = statistics.median(round_trips(hosts, 30))
        hosts.set_wire(Wire(delay_us=3000, mtu=9000), hosts=[0])  # host 0's link only: half the delay
        slow = statistics.median(round_trips(hosts, 30))
        assert slow >= 3000 * 0.98 and slow > fast, (fast, slow)
        hosts.set_wire("loopback")
        assert hosts.relay_stats(0) is None
        wait_until(lambda: statistics.median(round_trips(hosts, 10)) < slow, 30, "the delay is gone")


def test_profiles_shape_as_named() -> None:
    require_hosts()
    with Hosts(2, "dc") as hosts:
        rtts = round_trips(hosts, 50)
        stats = hosts.relay_stats(0)
    assert min(rtts) >= 2 * PROFILES["dc"].delay_us * 0.98
    assert stats is not None and stats["up_in"] >= 50 and stats["down_in"] >= 50
