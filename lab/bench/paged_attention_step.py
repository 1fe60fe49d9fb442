"""Inputs of one paged-attention step on random data: what the attention kernel tests and
scripts/bench_attention.py run the kernels on."""

from __future__ import annotations

import torch

from workers.model.attention import AttentionMetadata, write_kv


def paged_step(chunks, heads, kv_heads, head_dim, block_size, dtype, device, seed=0):
    """A step over chunks [(rows, context)] (single-row chunks first) whose earlier context is already cached,
    blocks scattered over the pool: (q, this step's k, v, k_cache, v_cache, metadata)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-ctx // block_size) for _, ctx in chunks]
    order = torch.randperm(sum(blocks) + 3, generator=gen)
    tables = torch.zeros(len(chunks), max(blocks) + 2, dtype=torch.int32)  # padded wider than needed
    slots, starts, used = [], [0], 0
    for i, ((rows, ctx), count) in enumerate(zip(chunks, blocks)):
        tables[i, :count] = order[used : used + count].int()
        used += count
        slots += [int(tables[i, j // block_size]) * block_size + j % block_size for j in range(ctx - rows, ctx)]
        starts.append(starts[-1] + rows)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    k_cache, v_cache = randn(len(order), block_size, kv_heads, head_dim), randn(len(order), block_size, kv_heads, head_dim)
    q, k, v = randn(starts[-1], heads, head_dim), randn(starts[-1], kv_heads, head_dim), randn(starts[-1], kv_heads, head_dim)
    contexts = [ctx for _, ctx in chunks]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        block_tables=tables.to(device),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=device),
        block_size=block_size,
        num_decodes=sum(rows == 1 for rows, _ in chunks),
        query_starts=starts,
        context_lens_host=contexts,
    )
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta
