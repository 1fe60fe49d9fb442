"""A KV cache export on the wire: one KvChunk per layer (its key and value bytes, FP8 scales as float32), the first
also carrying the header; how a prefill worker's PullKv streams it and a decode worker rebuilds it."""

from __future__ import annotations

from contract.wire import pb
from workers.kv_cache import FP8_DTYPE, KvExport


def kv_to_chunks(export: KvExport) -> list[pb.KvChunk]:
    """One KvChunk per layer holding its key and value bytes; the first also carries the header."""
    chunks = []
    for layer in range(export.num_layers):
        key, value = export.layer_bytes(layer)
        chunk = pb.KvChunk(layer=layer, key=key, value=value)
        if export.scales is not None:  # float32 on the wire: the scales are float32 values (workers/weights.py)
            chunk.k_scale, chunk.v_scale = export.scales[layer]
        if layer == 0:
            chunk.num_tokens, chunk.num_layers = export.num_tokens, export.num_layers
            chunk.num_kv_heads, chunk.head_dim, chunk.dtype = export.num_kv_heads, export.head_dim, export.dtype_name
            chunk.mrope_position_delta.append(export.mrope_position_delta)
        chunks.append(chunk)
    return chunks


def kv_from_chunks(chunks: list[pb.KvChunk], first_token_id: int) -> KvExport:
    """Rebuild the KvExport (CPU tensors) a prefill worker streamed; checks every layer arrived."""
    if not chunks:
        raise ValueError("no KV chunks received")
    head = chunks[0]
    layers = sorted(chunks, key=lambda c: c.layer)
    if [c.layer for c in layers] != list(range(head.num_layers)):
        raise ValueError(f"KV layers received {[c.layer for c in layers]}, expected 0..{head.num_layers - 1}")
    return KvExport.from_layer_bytes(
        num_tokens=head.num_tokens,
        first_token_id=first_token_id,
        mrope_position_delta=head.mrope_position_delta[0] if head.mrope_position_delta else 0,
        num_kv_heads=head.num_kv_heads,
        head_dim=head.head_dim,
        dtype_name=head.dtype,
        layers=[(c.key, c.value) for c in layers],
        scales=[(c.k_scale, c.v_scale) for c in layers] if head.dtype == str(FP8_DTYPE).removeprefix("torch.") else None,
    )
