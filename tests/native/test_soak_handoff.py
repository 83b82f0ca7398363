"""The bounded soak of KV handoffs (issue 35; heavy, CI's ``pytest -m heavy`` stage runs it):
``bench/soak_handoff.py`` with 2,000 offer / claim / release cycles and random aborts from both
sides, the decoder process killed (SIGKILL) and started again every 1,000 cycles (2 kills). The
soak checks itself and exits non-zero when a check fails; this test asserts its end conditions
again from its saved summary: every cycle ran, the kills happened (the offer each killed decoder held ended
``"link_down"``, its unsent one ``"expired"``: the faults were met), no live offer and no retained byte
on the prefill at the end, every offer's end reason accounted for, the prefill's RSS, fds and
threads within the soak's stated bounds between warm-up and the end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from where import REPO

CYCLES, KILL_EVERY = 2000, 1000


@pytest.mark.heavy
def test_soak_of_2000_handoffs_with_aborts_and_two_decoder_kills(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "bench" / "soak_handoff.py"), "--cycles", str(CYCLES),
                        "--kill-every", str(KILL_EVERY), "--progress", "0", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads((tmp_path / "soak_handoff.json").read_text())
    cfg = s["config"]
    assert s["failures"] == []
    assert s["cycles_done"] == CYCLES
    assert s["kills"] == CYCLES // KILL_EVERY
    # each kill left three offers: held, in flight, never sent; the killed link or the lease ended them
    reasons = s["reasons"]
    assert reasons.get("link_down", 0) + reasons.get("expired", 0) >= s["kills"] * 2
    assert reasons.get("expired", 0) >= s["kills"]  # the unsent ones
    kill_offers = s["kill_offers"]
    assert kill_offers.get("held/link_down") == s["kills"]  # released by the link's death, not the lease
    assert kill_offers.get("unsent/expired") == s["kills"]
    assert sum(v for k, v in kill_offers.items() if k.startswith("flying/")) == s["kills"]
    assert set(kill_offers) <= {"held/link_down", "unsent/expired", "flying/claimed", "flying/link_down",
                                "flying/expired"}
    assert sum(reasons.values()) == s["offers_made"] == CYCLES + 3 * s["kills"]
    # aborts from both sides happened, and each ended as the soak expects
    outcomes = s["outcomes"]
    assert outcomes.get("decoder_abort/LLM_OFFER_RELEASED/peer_aborted", 0) > 0
    assert outcomes.get("abort_first/LLM_OFFER_RELEASED/aborted", 0) > 0
    assert outcomes.get("release_first/LLM_OFFER_RELEASED/released", 0) > 0
    assert outcomes.get("plain/ok/claimed", 0) > CYCLES // 2
    assert s["stats"]["offers_live"] == 0
    assert s["stats"]["offer_bytes"] == 0
    assert s["stats"]["offers_released"] == s["offers_made"]
    assert s["stats"]["handoff_events_dropped"] == 0
    g = s["growth"]
    assert g is not None
    assert g["rss"] <= cfg["max_rss_mib"] * 2**20
    assert g["fds"] <= cfg["max_fds"]
    assert g["threads"] <= cfg["max_threads"]
