"""The paged KV cache tensors ([num_blocks, block_size, kv_heads, head_dim] per layer) and KV hand-off.

KvExport carries a request's prompt KV from a prefill engine to a decode engine (disaggregation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KvExport:
    """A request's KV cache, layer by layer, on the CPU.

    keys[i] / values[i]: [num_tokens, num_kv_heads, head_dim] of layer i for the prompt tokens.
    first_token_id: the token the exporting engine sampled after them (not in the cache).
    mrope_position_delta: continues the prompt's MRoPE positions (decode position = index + delta)."""

    num_tokens: int
    first_token_id: int
    mrope_position_delta: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def stacked(self) -> torch.Tensor:
        """[layers, 2, tokens, kv_heads, head_dim] (a copy)."""
        return torch.stack([torch.stack(self.keys), torch.stack(self.values)], dim=1)

    @property
    def num_kv_heads(self) -> int:
        return self.keys[0].shape[1]

    @property
    def head_dim(self) -> int:
        return self.keys[0].shape[2]

    @property
    def dtype_name(self) -> str:
        return str(self.keys[0].dtype).removeprefix("torch.")

    def layer_bytes(self, layer: int) -> tuple[bytes, bytes]:
        """Raw little-endian bytes of one layer's keys and values (for KvChunk.key / .value)."""
        return _to_bytes(self.keys[layer]), _to_bytes(self.values[layer])

    @classmethod
    def from_layer_bytes(
        cls,
        *,
        num_tokens: int,
        first_token_id: int,
        mrope_position_delta: int,
        num_kv_heads: int,
        head_dim: int,
        dtype_name: str,
        layers: list[tuple[bytes, bytes]],
    ) -> KvExport:
        """Rebuilds an export from per-layer (key bytes, value bytes), e.g. received KvChunks."""
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown KV dtype {dtype_name!r}")
        shape = (num_tokens, num_kv_heads, head_dim)
        keys, values = [], []
        for k, v in layers:
            keys.append(_from_bytes(k, dtype, shape))
            values.append(_from_bytes(v, dtype, shape))
        return cls(num_tokens, first_token_id, mrope_position_delta, keys, values)


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    expected = torch.Size(shape).numel() * dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"KV payload of {len(data)} bytes, expected {expected} for {shape} {dtype}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class KvCache:
    """One tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim]; layer(i) gives (keys, values)."""

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tensor = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.layers = [(self.tensor[i, 0], self.tensor[i, 1]) for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def gather(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """The first num_tokens tokens' KV of a sequence, [layers, 2, tokens, kv_heads, head_dim], on the device."""
        table = torch.tensor(block_table, dtype=torch.long, device=self.tensor.device)
        num_blocks = -(-num_tokens // self.block_size)
        return self.tensor[:, :, table[:num_blocks]].flatten(2, 3)[:, :, :num_tokens]

    def write(self, block_table: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Writes per-layer KV of the first tokens of a sequence into its blocks."""
        if len(keys) != len(self.layers):
            raise ValueError(f"KV for {len(keys)} layers, this model has {len(self.layers)}")
        num_tokens = keys[0].shape[0]
        table = torch.tensor(block_table, dtype=torch.long)
        slots = (table[torch.arange(num_tokens) // self.block_size] * self.block_size
                 + torch.arange(num_tokens) % self.block_size).to(self.tensor.device)
        for (k_cache, v_cache), k, v in zip(self.layers, keys, values):
            if k.shape[1:] != k_cache.shape[2:]:
                raise ValueError(f"KV rows of shape {tuple(k.shape[1:])}, cache holds {tuple(k_cache.shape[2:])}")
            k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.device, k_cache.dtype))
            v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.device, v_cache.dtype))
