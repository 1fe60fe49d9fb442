"""Attention over the paged KV cache: write this step's K/V into their slots, then attend.

On CUDA, single-query rows (decodes) go to one Triton kernel and all multi-row chunks to another, both
over the block tables. Elsewhere (CPU, and as the kernels' reference) SDPA runs per sequence. An FP8 cache
(workers/kv_cache.py) is written quantized with its layer's scales and read back times them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from workers.host_copy import to_device
from workers.kv_cache import FP8_DTYPE, copy_rows, from_cache, quantize_fp8
from workers.model import paged_decode, paged_prefill


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what each sequence attends to.

    Sequences 0..num_decodes-1 have one query row each (rows 0..num_decodes-1); after them come the
    multi-row chunks. Tokens of sequence i are rows query_starts[i]:query_starts[i+1] of the flat batch;
    after this step it holds context_lens[i] tokens of KV in blocks block_tables[i]. Inside a CUDA graph
    every sequence is a decode and the host lists are empty."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with anything
    context_lens: torch.Tensor  # [B] int32, on the device
    block_size: int
    num_decodes: int
    query_starts: list[int]  # [B + 1], host
    context_lens_host: list[int]  # [B], host
    # query_starts as [B + 1] int32 on the device, for the prefill kernel; None without multi-row chunks.
    query_starts_device: torch.Tensor | None = field(init=False)

    def __post_init__(self) -> None:
        # Built with the rest of the step's metadata, before the forward pass; no device sync.
        self.query_starts_device = None
        if len(self.query_starts) - 1 > self.num_decodes:
            self.query_starts_device = to_device(torch.tensor(self.query_starts, dtype=torch.int32), self.block_tables.device)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """k_cache [num_blocks, block_size, kv_heads, head_dim]; k [T, kv_heads, head_dim]. An FP8 cache stores
    quantize_fp8(k, k_scale) and quantize_fp8(v, v_scale)."""
    if k_cache.dtype == FP8_DTYPE:
        k, v = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    copy_rows(k_cache, slot_mapping, k)
    copy_rows(v_cache, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int, scale: float = 1.0,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """The first num_tokens rows [num_tokens, kv_heads, head_dim] of a sequence's blocks, in `dtype` (default the
    cache's): FP8 rows are multiplied by their scale."""
    num_blocks = -(-num_tokens // cache.shape[1])
    rows = cache[block_table[:num_blocks].long()].flatten(0, 1)[:num_tokens]
    return rows if dtype is None else from_cache(rows, scale, dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, heads, head_dim], this step's k/v [T, kv_heads, head_dim] (already in the cache) -> [T, heads,
    head_dim]; causal within each sequence's context. k_scale/v_scale: an FP8 cache's dequantisation scales.
    out: rows like q's to write into (default a new tensor)."""
    if out is None:
        out = torch.empty_like(q)
    if not paged_decode.supports(q, k_cache):
        sdpa_attention(q, k, v, k_cache, v_cache, meta, scale, out, k_scale, v_scale)
        return out
    nd = meta.num_decodes
    if nd:
        paged_decode.decode_attention(
            q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.context_lens[:nd], scale, out[:nd],
            k_scale=k_scale, v_scale=v_scale,
        )
    if meta.query_starts_device is not None:
        paged_prefill.prefill_attention(
            q, k_cache, v_cache, meta.block_tables[nd:], meta.query_starts_device[nd:], meta.context_lens[nd:],
            meta.query_starts[nd], meta.query_starts[-1], scale, out, k_new=k, v_new=v, k_scale=k_scale, v_scale=v_scale,
        )
    return out


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """paged_attention by one SDPA call per sequence into out: the CPU path and the kernels' reference. A first
    chunk attends to this step's own k/v (exact, as the kernels' fresh-row path does); other rows read the cache,
    dequantized (FP8 rows times k_scale / v_scale) to q's dtype."""
    starts = meta.query_starts
    for i, ctx in enumerate(meta.context_lens_host):
        lo, hi = starts[i], starts[i + 1]
        n = hi - lo
        qi = q[lo:hi].transpose(0, 1).unsqueeze(0)
        if n == ctx and n > 1:  # a first chunk: its own K/V are the whole context
            o = F.scaled_dot_product_attention(
                qi, k[lo:hi].transpose(0, 1).unsqueeze(0), v[lo:hi].transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=scale, enable_gqa=True,
            )
        else:  # a later chunk or a decode: attend to the gathered blocks, causal aligned to the end
            ki = gather_kv(k_cache, meta.block_tables[i], ctx, k_scale, q.dtype).transpose(0, 1).unsqueeze(0)
            vi = gather_kv(v_cache, meta.block_tables[i], ctx, v_scale, q.dtype).transpose(0, 1).unsqueeze(0)
            if n == 1:
                o = F.scaled_dot_product_attention(qi, ki, vi, scale=scale, enable_gqa=True)
            else:  # heads expanded: the fused kernels take a lower-right causal bias but not GQA with it
                group = q.shape[1] // k.shape[1]
                o = F.scaled_dot_product_attention(
                    qi, ki.repeat_interleave(group, dim=1), vi.repeat_interleave(group, dim=1),
                    attn_mask=causal_lower_right(n, ctx), scale=scale,
                )
        out[lo:hi] = o.squeeze(0).transpose(0, 1)
