"""Shared helpers of the peer runners (stdlib + numpy only: they run in the peers' own virtualenvs)."""
import json
import statistics


def summary(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def pct(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def emit(read_gbps, write_gbps, lat_us, extra):
    print(json.dumps({"read": summary(read_gbps), "write": summary(write_gbps),
                      "lat_us": {"p50": pct(lat_us, 50), "p99": pct(lat_us, 99), "n": len(lat_us)}, **extra}))
