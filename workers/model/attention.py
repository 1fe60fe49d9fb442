"""Attention over the paged KV cache: write this step's K/V into their slots, attend per sequence.

The reference backend gathers each sequence's blocks and calls SDPA; a fused paged kernel can replace
`paged_attention` with the same arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what each sequence attends to.

    Tokens of sequence i are rows query_starts[i]:query_starts[i+1] of the flat batch; after this
    step the sequence holds context_lens[i] tokens of KV in blocks block_tables[i]."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each token
    query_starts: list[int]  # [B + 1]
    context_lens: list[int]  # [B]
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    block_size: int


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k_cache [num_blocks, block_size, kv_heads, head_dim]; k [T, kv_heads, head_dim]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first num_tokens rows [num_tokens, kv_heads, head_dim] of a sequence's blocks."""
    num_blocks = -(-num_tokens // cache.shape[1])
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:num_tokens]


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q [T, heads, head_dim] -> [T, heads, head_dim]; causal within each sequence's context."""
    out = torch.empty_like(q)
    starts = meta.query_starts
    for i, ctx in enumerate(meta.context_lens):
        lo, hi = starts[i], starts[i + 1]
        n = hi - lo
        k = gather_kv(k_cache, meta.block_tables[i], ctx).transpose(0, 1).unsqueeze(0)
        v = gather_kv(v_cache, meta.block_tables[i], ctx).transpose(0, 1).unsqueeze(0)
        mask = None
        if n > 1:
            q_pos = torch.arange(ctx - n, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[lo:hi] = o.squeeze(0).transpose(0, 1)
    return out
