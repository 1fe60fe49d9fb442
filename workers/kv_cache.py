"""The paged KV cache tensors ([num_blocks, block_size, kv_heads, head_dim] per layer) and KV hand-off.

KvExport carries a request's prompt KV from a prefill engine to a decode engine (disaggregation). An FP8
cache stores float8_e4m3fn with one (k_scale, v_scale) per layer: stored = e4m3(clamp(x / scale, +-448)),
read = stored * scale, the convention of vLLM's FP8 KV cache (https://github.com/vllm-project/vllm/blob/main/
vllm/model_executor/layers/quantization/kv_cache.py: the scales are the dequantisation factors, default 1.0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448: e4m3fn has no infinity, so values are clamped, not overflowed


def cache_dtype(kv_cache_dtype: str, activation: torch.dtype) -> torch.dtype:
    """The KV cache's element type for EngineConfig.kv_cache_dtype ('auto': the activation dtype)."""
    if kv_cache_dtype == "auto":
        return activation
    if kv_cache_dtype == "fp8":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype: expected 'auto' or 'fp8', got {kv_cache_dtype!r}")


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in float32 (scale rounded to float32, as the kernels take it), clamped to +-448, rounded to the
    nearest e4m3 value (ties to even). The divisor is a tensor on x's device: CUDA torch divides by a host scalar
    through its reciprocal, which can round differently from the kernels' IEEE division."""
    divisor = torch.tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / divisor).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """KV rows as a cache of `dtype` stores them: quantized with `scale` for FP8, else cast."""
    return quantize_fp8(x, scale) if dtype == FP8_DTYPE else x.to(dtype)


def from_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows read back in `dtype`: FP8 rows times their scale (in float32), others cast."""
    return (x.float() * scale).to(dtype) if x.dtype == FP8_DTYPE else x.to(dtype)


def float32(x: float) -> float:
    """x rounded to float32: the precision the kernels and the wire (KvChunk) carry scales in."""
    return float(torch.tensor(x, dtype=torch.float32))


def check_scales(scales: list[tuple[float, float]], where: str) -> None:
    for layer, pair in enumerate(scales):
        if not all(s > 0 and s < float("inf") for s in pair):
            raise ValueError(f"{where}: layer {layer} KV scales {pair} (each must be positive and finite)")


class KvLayer(NamedTuple):
    """One layer's cache: keys, values [num_blocks, block_size, kv_heads, head_dim] and their FP8 scales (1.0 and
    unused for caches in the activation dtype)."""

    keys: torch.Tensor
    values: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass(frozen=True)
class ImageLayout:
    """One image of an exported prompt: its visual-token grid (rows x cols after the spatial merge) and content
    digest, all a decode worker needs of it (workers/inputs/mm_inputs.layout_imported_prompt)."""

    grid_rows: int
    grid_cols: int
    digest: bytes

    @property
    def num_tokens(self) -> int:
        return self.grid_rows * self.grid_cols


@dataclass
class KvExport:
    """A request's KV cache, layer by layer, on the CPU.

    keys[i] / values[i]: [num_tokens, num_kv_heads, head_dim] of layer i for the prompt tokens.
    first_token_id: the token the exporting engine sampled after them (not in the cache).
    mrope_position_delta: continues the prompt's MRoPE positions (decode position = index + delta).
    scales: (k_scale, v_scale) of each layer when the rows are FP8 as the exporting cache stores them; None
    for rows in a floating dtype."""

    num_tokens: int
    first_token_id: int
    mrope_position_delta: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    scales: list[tuple[float, float]] | None = None
    # the prompt's images (LLMEngine.export_kv on the prefill side; the KvHandle's, on the decode side)
    image_layout: tuple[ImageLayout, ...] = ()

    def __post_init__(self) -> None:
        fp8 = self.keys[0].dtype == FP8_DTYPE
        if fp8 != (self.scales is not None):
            raise ValueError(f"KV of dtype {self.dtype_name} needs per-layer scales exactly when it is FP8")
        if self.scales is not None:
            if len(self.scales) != len(self.keys):
                raise ValueError(f"{len(self.scales)} KV scale pairs for {len(self.keys)} layers")
            check_scales(self.scales, "KV export")

    def layer_rows(self, layer: int, dtype: torch.dtype, scale: tuple[float, float], device: torch.device):
        """(keys, values) of one layer as a cache of `dtype` with `scale` stores them: FP8 rows whose scales
        equal the cache's are copied bit for bit; others are dequantized and (for an FP8 cache) requantized."""
        k, v = self.keys[layer], self.values[layer]
        if self.scales is not None and dtype == FP8_DTYPE and tuple(self.scales[layer]) == tuple(scale):
            return k.to(device), v.to(device)
        src = self.scales[layer] if self.scales is not None else (1.0, 1.0)
        k, v = from_cache(k.to(device), src[0], torch.float32), from_cache(v.to(device), src[1], torch.float32)
        return to_cache(k, dtype, scale[0]), to_cache(v, dtype, scale[1])

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
        scales: list[tuple[float, float]] | None = None,
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
        return cls(num_tokens, first_token_id, mrope_position_delta, keys, values, scales)


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    expected = torch.Size(shape).numel() * dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"KV payload of {len(data)} bytes, expected {expected} for {shape} {dtype}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class KvCache:
    """One tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim]; layers[i] is layer i's KvLayer.

    scales: (k_scale, v_scale) per layer for an FP8 cache (default 1.0 each); ignored for other dtypes."""

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device, scales: list[tuple[float, float]] | None = None,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.tensor = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        if dtype != FP8_DTYPE or scales is None:
            scales = [(1.0, 1.0)] * num_layers
        if len(scales) != num_layers:
            raise ValueError(f"{len(scales)} KV scale pairs for {num_layers} layers")
        check_scales(scales, "KV cache")
        self.scales = [(float32(k), float32(v)) for k, v in scales]
        self.layers = [KvLayer(self.tensor[i, 0], self.tensor[i, 1], *self.scales[i]) for i in range(num_layers)]

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_DTYPE

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def gather(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """The first num_tokens tokens' KV of a sequence, [layers, 2, tokens, kv_heads, head_dim], on the device,
        as stored (FP8 rows stay FP8: their scales are self.scales)."""
        table = torch.tensor(block_table, dtype=torch.long, device=self.tensor.device)
        num_blocks = -(-num_tokens // self.block_size)
        return self.tensor[:, :, table[:num_blocks]].flatten(2, 3)[:, :, :num_tokens]

    def import_rows(self, kv: KvExport, device: torch.device) -> torch.Tensor:
        """An export as this cache stores it, [layers, 2, tokens, all kv heads, head_dim] on `device`."""
        if kv.num_layers != len(self.layers):
            raise ValueError(f"KV for {kv.num_layers} layers, this model has {len(self.layers)}")
        return torch.stack([
            torch.stack(kv.layer_rows(i, self.dtype, self.scales[i], device)) for i in range(kv.num_layers)
        ])

    def write(self, block_table: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Writes per-layer KV of the first tokens of a sequence into its blocks; the rows are already in this
        cache's dtype (and, for FP8, quantized with its scales: import_rows)."""
        if len(keys) != len(self.layers):
            raise ValueError(f"KV for {len(keys)} layers, this model has {len(self.layers)}")
        num_tokens = keys[0].shape[0]
        table = torch.tensor(block_table, dtype=torch.long)
        slots = (table[torch.arange(num_tokens) // self.block_size] * self.block_size
                 + torch.arange(num_tokens) % self.block_size).to(self.tensor.device)
        for layer, k, v in zip(self.layers, keys, values):
            if k.shape[1:] != layer.keys.shape[2:]:
                raise ValueError(f"KV rows of shape {tuple(k.shape[1:])}, cache holds {tuple(layer.keys.shape[2:])}")
            if k.dtype != self.dtype or v.dtype != self.dtype:
                raise ValueError(f"KV rows of dtype {k.dtype}, cache holds {self.dtype}")
            copy_rows(layer.keys, slots, k)
            copy_rows(layer.values, slots, v)


def copy_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache [num_blocks, block_size, ...] slots <- rows [T, ...] of the same dtype. One-byte dtypes go through
    uint8 views: torch's CPU index_copy_ has no float8 kernel, and a byte copy is what the cache needs."""
    if cache.dtype.itemsize == 1:
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows.to(cache.device))
