"""The tcp path over several streams (docs/architecture.md, "The tcp path's streams"): a large pull or
push is cut into chunks spread over the link's channel and its lanes; every byte lands where it
should (the whole destination and its guards checked, odd sizes and offsets, many blocks), with a
link secret too; one stream cut mid-transfer fails the transfer with LLM_LINK_FAILED, breaks the
link, leaves the source intact, and a relink retries in full.

The decoder (the initiator: its pdlink.TcpStreams decides) runs with PDLINK_TCP_STREAMS; 1 is the
single-stream path of before."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from backend_env import Variant
from conftest import DECODER_ID, PROMPT_ID, only
from llm_datadist import BlocksCacheKey, CacheKey, DataType, LLMStatusCode
from peer import Peer
from peers import kv, workers
from poll import hang_guard, wait_until
from relay import DOWN, Relay
from verify import assert_same, check_transfer, rows

KEY = BlocksCacheKey(PROMPT_ID, 1)
# 2 tensors x 97 blocks of 345,679 bytes: 64 MiB in all, no block aligned to anything.
SHAPE = (97, 345_679)
BLOCKS = 97
TIMEOUT_MS = 60_000  # generous: under a sanitizer 64 MiB moves at a few MB/s


def start(peers: Callable[..., Peer], variant: Variant, streams: int, secret: str | None = None,
          port: int | None = None, prefill: Peer | None = None) -> tuple[Peer, Peer, int]:
    env = {"PDLINK_TCP_STREAMS": str(streams)}
    if secret:
        env |= {"PDLINK_LINK_SECRET": secret, "PDLINK_PAYLOAD_INTEGRITY": "1"}
    p = peers("prefill", env=variant.env(**env))
    listen = p.call(kv.start, "prompt", PROMPT_ID, listen=True, timeout_ms=TIMEOUT_MS)
    p.call(kv.register_blocks, "big", 2, SHAPE, DataType.DT_UINT8, seed=7, key=KEY)
    d = peers("decode", env=variant.env(**env))
    d.call(kv.start, "decoder", DECODER_ID, timeout_ms=TIMEOUT_MS)
    d.call(kv.register_blocks, "big", 2, SHAPE, DataType.DT_UINT8, seed=8)
    assert d.call(kv.link, PROMPT_ID, port or listen)[0] == LLMStatusCode.LLM_SUCCESS
    return p, d, listen


def lanes(peer: Peer) -> list[str]:
    (link,) = peer.call(kv.links)
    assert link["transport"] == "tcp"
    return list(link["lanes"])


# Every block moves, to another block: the destination's order reversed and shifted, so a chunk
# landing at the wrong offset shows.
SRC = list(range(BLOCKS))
DST = [(BLOCKS - 1 - b + 5) % BLOCKS for b in SRC]


@only("cpu-tcp")
@pytest.mark.parametrize("streams", [1, 2, 4])
def test_a_large_pull_and_push_over_several_streams_land_exact_bytes(peers: Callable[..., Peer], variant: Variant,
                                                                     streams: int) -> None:
    p, d, _ = start(peers, variant, streams)
    check_transfer(lambda: p.call(kv.snapshot, "big"), lambda: d.call(kv.snapshot, "big"),
                   lambda: d.call_within(hang_guard(TIMEOUT_MS), kv.pull_blocks, KEY, "big", SRC, DST),
                   rows(list(zip(SRC, DST))))
    # the streams are the link's channel and streams - 1 lanes, on both sides
    assert lanes(d) == ([] if streams == 1 else [f"tcp x{streams}"])
    assert lanes(p) == ([] if streams == 1 else [f"served x{streams}"])
    # a push of every other block back (another set of ranges: the chunks are cut anew)
    back = SRC[::2]
    check_transfer(lambda: d.call(kv.snapshot, "big"), lambda: p.call(kv.snapshot, "big"),
                   lambda: d.call_within(hang_guard(TIMEOUT_MS), kv.push_blocks, KEY, "big", back, back[::-1]),
                   rows(list(zip(back, back[::-1]))))


@only("cpu-tcp")
def test_several_streams_with_a_link_secret_and_payload_integrity(peers: Callable[..., Peer],
                                                                  variant: Variant) -> None:
    """Each lane has its own session key from its own handshake; every frame and payload sealed."""
    p, d, _ = start(peers, variant, 4, secret="lanes-secret")
    check_transfer(lambda: p.call(kv.snapshot, "big"), lambda: d.call(kv.snapshot, "big"),
                   lambda: d.call_within(hang_guard(TIMEOUT_MS), kv.pull_blocks, KEY, "big", SRC, DST),
                   rows(list(zip(SRC, DST))))
    (link,) = d.call(kv.links)
    assert (link["authenticated"], link["payload_integrity"], list(link["lanes"])) == (True, True, ["tcp x4"])
    check_transfer(lambda: d.call(kv.snapshot, "big"), lambda: p.call(kv.snapshot, "big"),
                   lambda: d.call_within(hang_guard(TIMEOUT_MS), kv.push_blocks, KEY, "big", SRC, SRC),
                   rows([(b, b) for b in SRC]))


@only("cpu-tcp")
def test_a_stream_cut_mid_pull_fails_it_and_a_relink_retries_in_full(peers: Callable[..., Peer],
                                                                    variant: Variant) -> None:
    """The link runs through a relay (tests/relay.py): its two channels, then, on the first large
    pull, three lanes. With 4 MiB of the pull through and the rest held, one lane is cut: the pull
    fails with LLM_LINK_FAILED (none completed: fewer bytes went through than it moves), the link is
    broken, the source unchanged; after an unlink and a direct link the same pull lands every byte."""
    p = peers("prefill", env=variant.env(PDLINK_TCP_STREAMS="4"))
    port = p.call(kv.start, "prompt", PROMPT_ID, listen=True, timeout_ms=TIMEOUT_MS)
    p.call(kv.register_blocks, "big", 2, SHAPE, DataType.DT_UINT8, seed=7, key=KEY)
    prompt0 = p.call(kv.snapshot, "big")
    moved_bytes = 2 * SHAPE[0] * SHAPE[1]
    with Relay(port) as relay:
        d = peers("decode", env=variant.env(PDLINK_TCP_STREAMS="4"))
        d.call(kv.start, "decoder", DECODER_ID, timeout_ms=TIMEOUT_MS)
        d.call(kv.register_blocks, "big", 2, SHAPE, DataType.DT_UINT8, seed=8)
        assert d.call(kv.link, PROMPT_ID, relay.port)[0] == LLMStatusCode.LLM_SUCCESS
        assert relay.connections() == 2
        decoder0 = d.call(kv.snapshot, "big")
        relay.hold_after(DOWN, 4 << 20)
        d.call(workers.start_transfer_loop, "pull", KEY, "big", SRC, DST, 1)
        assert relay.wait_held(DOWN) >= 4 << 20
        assert relay.connections() == 5  # the lanes opened through the relay too
        relay.cut(3)  # a lane
        relay.release()
        outcome = d.call_within(hang_guard(TIMEOUT_MS), workers.join_transfer_loop, hang_guard(TIMEOUT_MS) / 2)
        assert outcome == LLMStatusCode.LLM_LINK_FAILED, outcome
        assert d.call(workers.transfers_done) == 0
        assert relay.forwarded[DOWN] < moved_bytes, relay.forwarded
        (link,) = d.call(kv.links)
        assert link["broken"], link
    assert_same(p.call(kv.snapshot, "big"), prompt0, "source of the failed pull")
    assert d.call(kv.unlink, PROMPT_ID, relay.port, True) == LLMStatusCode.LLM_SUCCESS
    assert d.call(kv.link, PROMPT_ID, port)[0] == LLMStatusCode.LLM_SUCCESS
    d.call_within(hang_guard(TIMEOUT_MS), kv.pull_blocks, KEY, "big", SRC, DST)
    # what the failed pull landed is overwritten: the destination is exactly the one before it with
    # every block replaced, its guards intact
    assert_same(d.call(kv.snapshot, "big"), decoder0.with_rows(prompt0, list(zip(SRC, DST))),
                "destination after the retry")
    assert_same(p.call(kv.snapshot, "big"), prompt0, "source of the retried pull")
    assert lanes(d) == ["tcp x4"]


@only("cpu-tcp")
def test_a_request_key_pulled_over_several_streams_is_released_after_the_pull(
        peers: Callable[..., Peer], variant: Variant) -> None:
    """A pull by request key (8 MiB: eight chunks over four streams) moves exact bytes, and the
    prompt then releases the key's cache (one commit, on the link's channel, after the last chunk)."""
    env = variant.env(PDLINK_TCP_STREAMS="4")
    p = peers("prefill", env=env)
    port = p.call(kv.start, "prompt", PROMPT_ID, listen=True, timeout_ms=TIMEOUT_MS, remote=False, pool=32 << 20)
    p.call(kv.allocate, "src", 2, (1, 4 << 20), DataType.DT_INT8, seed=6, keys=[CacheKey(PROMPT_ID, 5)])
    p.call(kv.deallocate, "src")  # only the request key holds it now
    d = peers("decode", env=env)
    d.call(kv.start, "decoder", DECODER_ID, timeout_ms=TIMEOUT_MS, remote=False, pool=32 << 20)
    d.call(kv.allocate, "dst", 2, (1, 4 << 20), DataType.DT_INT8, seed=7)
    assert d.call(kv.link, PROMPT_ID, port)[0] == LLMStatusCode.LLM_SUCCESS
    assert p.call(kv.cache_count) == 1
    check_transfer(lambda: p.call(kv.snapshot, "src"), lambda: d.call(kv.snapshot, "dst"),
                   lambda: d.call_within(hang_guard(TIMEOUT_MS), kv.pull_cache, CacheKey(PROMPT_ID, 5), "dst"),
                   rows([(0, 0)]))
    assert lanes(d) == ["tcp x4"]
    wait_until(lambda: p.call(kv.cache_count) == 0, 10, "the consumed cache freed")
