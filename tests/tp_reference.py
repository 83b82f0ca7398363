"""The numpy reference of KV geometry (pdlink.kv's TP plan, native/test_tp_plan.py and
native/test_tp_transfer.py): a model-wide (layer, K/V) tensor of random bytes and one rank's
blocks of it, laid out as that rank's geometry says."""

from __future__ import annotations

import numpy as np

from pdlink.kv import KvGeometry


def model_kv(kv_heads: int, head_bytes: int, tokens: int, seed: int = 0) -> np.ndarray:
    """One (layer, K/V) tensor of the whole model: [tokens, heads, head bytes] of random bytes."""
    return np.random.default_rng(seed).integers(0, 256, (tokens, kv_heads, head_bytes), dtype=np.uint8)


def blocks_of(g: KvGeometry, x: np.ndarray) -> np.ndarray:
    """Rank ``g``'s blocks of ``x`` (a whole number of its blocks of tokens): [blocks, block
    bytes] in its layout (HND: [heads, tokens, head]; NHD and MLA: [tokens, heads, head])."""
    heads = x[:, g.first_head:g.first_head + g.heads, :]
    blocks = heads.reshape(-1, g.block_tokens, g.heads, heads.shape[2])  # [blocks, T, H, D]
    if g.layout == "HND":
        blocks = blocks.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(blocks).reshape(blocks.shape[0], -1)


def rank_tensors(g: KvGeometry, blocks: int, seed: int) -> list[np.ndarray]:
    """Rank ``g``'s ``blocks`` blocks of each of its ``layers * kv`` tensors, as flat byte arrays;
    tensor t is cut from ``model_kv(.., seed + t)`` (the same for every rank)."""
    head_bytes = g.head_size * g.itemsize
    return [blocks_of(g, model_kv(g.kv_heads, head_bytes, blocks * g.block_tokens, seed + t)).reshape(-1)
            for t in range(g.layers * g.kv)]
