"""The Qwen3-VL vision tower: transformers' vision module holds the checkpoint's model.visual.* weights
(workers.weights.vision_module loads them), and our own
forward runs over its parameters (fused residual add + LayerNorm and q/k rotary kernels, one SDPA call per run of
equal-size frames, the patch-embedding Conv3d as a GEMM, position and rotary tables cached per image grid).

VisionEncoder.encode() turns pixel patches of several images into main embeddings plus the DeepStack features.
With fp8_linears (EngineConfig.vision_precision "fp8") the blocks' four linears hold e4m3 weights with one scale per
output row, quantised at load, and run W8A8 with per-token activations (workers/model/fp8_gemm.py).

Tensor parallel (a TensorParallel of size n > 1, EngineConfig.vision_tensor_parallel): each rank keeps its n-th of
the blocks' attention heads and MLP columns (shard_vision_blocks), as Megatron-LM splits a transformer layer
(Shoeybi et al., arXiv:1909.08053) and vLLM's Qwen2.5-VL vision blocks do (vllm/model_executor/models/qwen2_5_vl.py):
qkv and fc1 column-parallel, proj and fc2 row-parallel, their partial outputs summed by one all-reduce each, the
bias added after it. A rank does 1/n of the attention, the tower's cost on a large image, so a lone image's pass
should take about 1/n of the time plus the all-reduces (not yet measured on GPUs). Every rank holds the whole
residual stream; the mergers (DeepStack and final) run where the outputs are kept, rank 0.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from workers.model import fp8_gemm
from workers.checkpoint_quant import BlockShape
from workers.model.fp8 import quantize_weight_blocks
from workers.model.vision_attention import IMPLEMENTATIONS, AttentionPlan, vision_attention
from workers.model.vision_kernels import add_layer_norm, rotary_qk
from workers.model_config import CheckpointError, ModelConfig
from workers.parallel import TensorParallel

TABLE_CACHE_BYTES = 256 << 20  # per-grid position/rotary tables kept on the device (~2.7 MB per 1024-patch grid)

Grid = tuple[int, int, int]  # (t, h, w): frames, patch rows, patch columns


class PatchLinear(nn.Module):
    """The patch embedding's Conv3d as the GEMM it is: its kernel covers each whole [C, T, P, P] patch with the
    same stride, so every output is one dot product of a flattened patch with a flattened filter. cuDNN has no
    good algorithm for that degenerate convolution in bf16; a linear layer runs it as one cuBLAS GEMM."""

    def __init__(self, conv: nn.Conv3d):
        super().__init__()
        if tuple(conv.stride) != tuple(conv.kernel_size) or any(conv.padding) or conv.groups != 1 or any(d != 1 for d in conv.dilation):
            raise ValueError(f"patch embedding {conv} is not a non-overlapping patch projection")
        self.weight, self.bias = conv.weight, conv.bias  # [out, C, T, P, P]: the checkpoint's own tensors

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [N, C*T*P*P] (or [N, C, T, P, P]) -> [N, out]."""
        return F.linear(patches.reshape(patches.shape[0], -1), self.weight.view(self.weight.shape[0], -1), self.bias)


def frame_runs(grid_thw: torch.Tensor) -> list[tuple[int, int]]:
    """(patches per frame, consecutive frames of that size) for grid_thw [n, 3] (t frames of h*w each)."""
    lengths = [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]
    return [(length, len(list(group))) for length, group in itertools.groupby(lengths)]


def merge_block_order(h: int, w: int, merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of an h x w grid in the tower's order: merge x merge blocks row-major, the
    patches of a block row-major inside it."""
    rows = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    return rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For positions `index` on an axis of `size` patches: the two taps into the `side`-long learned axis
    (align_corners) and their weights, [len, 2] each, in float32 as transformers computes them."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class GridTables:
    """Per image grid (t, h, w), built once on the device: the learned position embeddings bilinearly resampled
    to the grid [t*h*w, hidden] (activation dtype) and the rotary cos/sin [t*h*w, head_dim / 2] (float32), in the
    tower's patch order. Least recently used grids are dropped beyond `budget_bytes`."""

    def __init__(self, pos_embed: nn.Embedding, inv_freq: torch.Tensor, merge: int, budget_bytes: int = TABLE_CACHE_BYTES):
        self.pos_embed = pos_embed.weight
        self.side = int(self.pos_embed.shape[0] ** 0.5)
        self.inv_freq = inv_freq.float()
        self.merge = merge
        self.budget_bytes = budget_bytes
        self._tables: OrderedDict[Grid, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = OrderedDict()
        self._bytes = 0

    def __call__(self, grids: list[Grid]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pos [patches, hidden], cos, sin [patches, head_dim / 2]) for the images' grids, concatenated."""
        parts = [self._get(grid) for grid in grids]
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(column) for column in zip(*parts))

    def _get(self, grid: Grid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tables = self._tables.get(grid)
        if tables is not None:
            self._tables.move_to_end(grid)
            return tables
        tables = self._build(*grid)
        self._tables[grid] = tables
        self._bytes += sum(t.nbytes for t in tables)
        while self._bytes > self.budget_bytes and len(self._tables) > 1:
            self._bytes -= sum(t.nbytes for t in self._tables.popitem(last=False)[1])
        return tables

    def _build(self, t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if h % self.merge or w % self.merge:
            raise ValueError(f"image grid {(t, h, w)} is not a multiple of the spatial merge size {self.merge}")
        rows, cols = merge_block_order(h, w, self.merge, self.pos_embed.device)
        row_taps, row_weights = _bilinear_taps(rows, h, self.side)
        col_taps, col_weights = _bilinear_taps(cols, w, self.side)
        taps = (row_taps[:, :, None] * self.side + col_taps[:, None, :]).flatten(1)
        weights = (row_weights[:, :, None] * col_weights[:, None, :]).flatten(1)
        pos = (self.pos_embed[taps] * weights[:, :, None]).sum(1).to(self.pos_embed.dtype)
        freqs = torch.stack([rows, cols], dim=-1)[..., None].float() * self.inv_freq  # [h*w, 2, head_dim / 4]
        freqs = freqs.flatten(1)
        return pos.repeat(t, 1), freqs.cos().repeat(t, 1), freqs.sin().repeat(t, 1)


@dataclass
class TowerState:
    """A tower pass between blocks, so that a large image's encoding can be spread over several engine steps: the
    residual stream, the update the next LayerNorm adds first, DeepStack features so far, the next block."""

    plan: AttentionPlan
    cos: torch.Tensor
    sin: torch.Tensor
    residual: torch.Tensor
    pending: torch.Tensor | None
    features: list[torch.Tensor] = field(default_factory=list)
    next_block: int = 0


class VisionTower:
    """Our forward over a transformers Qwen3-VL vision module's parameters (the module itself is not run).
    gelu_epilogue: on CUDA, the blocks' fc1 + GELU(tanh) as one cuBLASLt GEMM with a GELU epilogue (one rounding
    instead of two; elsewhere the unfused pair, since the CPU kernel's epilogue is the erf GELU).
    tp: with size n > 1, the module's blocks are cut to this rank's shard here (shard_vision_blocks) and every rank
    of the group runs the same calls in the same order (their all-reduces); only rank 0 returns outputs."""

    def __init__(self, module: nn.Module, gelu_epilogue: bool = False, fp8_linears: bool = False,
                 attention: str = "sdpa", tp: TensorParallel | None = None):
        config = module.config
        if attention not in IMPLEMENTATIONS:
            raise ValueError(f"vision attention {attention!r}: expected one of {IMPLEMENTATIONS}")
        self.attention = attention  # EngineConfig.vision_attention
        if gelu_epilogue and config.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"gelu_epilogue computes gelu_pytorch_tanh, the config's hidden_act is {config.hidden_act!r}")
        self.tp = tp or TensorParallel()
        if self.tp.size > 1:
            shard_vision_blocks(module, self.tp)  # before quantising: the FP8 row scales are the shard's
        self.module = module
        self.gelu_epilogue = gelu_epilogue
        # the blocks' linears in e4m3 (one scale per output row), keyed by module; their float weights are dropped
        self.fp8: dict[nn.Module, Fp8Weight] = quantize_block_linears(module) if fp8_linears else {}
        self.patch = PatchLinear(module.patch_embed.proj)
        self.head_dim = config.hidden_size // config.num_heads
        self.num_heads = config.num_heads // self.tp.size  # this rank's
        self.keeps_outputs = self.tp.rank == 0  # the mergers run on rank 0 alone
        self.merge_unit = config.spatial_merge_size**2
        self.deepstack = dict(zip(config.deepstack_visual_indexes, module.deepstack_merger_list))
        self.tables = GridTables(module.pos_embed, module.rotary_pos_emb.inv_freq, config.spatial_merge_size)

    @property
    def depth(self) -> int:
        return len(self.module.blocks)

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
                 ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """pixel_values [patches, C*T*P*P] (activation dtype, device), grid_thw [n, 3] -> (embeds [patches / 4, out],
        DeepStack features [[patches / 4, out], ...]) as transformers' module returns them (None where finish
        keeps no outputs)."""
        state = self.begin(pixel_values, grid_thw)
        self.run_blocks(state, self.depth)
        return self.finish(state)

    def begin(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerState:
        """The patch embedding and the position tables: the state before the first block."""
        grids = [tuple(g) for g in grid_thw.tolist()]
        pos, cos, sin = self.tables(grids)
        residual = self.patch(pixel_values)
        if residual.shape[0] != pos.shape[0]:
            raise ValueError(f"pixel_values has {residual.shape[0]} patches, grid_thw {grids} says {pos.shape[0]}")
        # each LayerNorm first adds the last pending update (here the position embeddings)
        return TowerState(AttentionPlan(frame_runs(grid_thw)), cos, sin, residual, pos)

    def run_blocks(self, state: TowerState, count: int) -> None:
        """Runs the next `count` blocks (fewer when the tower ends first)."""
        for index in range(state.next_block, min(state.next_block + count, self.depth)):
            block = self.module.blocks[index]
            normed, state.residual = add_layer_norm(state.residual, state.pending, block.norm1.weight,
                                                    block.norm1.bias, block.norm1.eps)
            state.pending = self._attention(block.attn, normed, state.cos, state.sin, state.plan)
            normed, state.residual = add_layer_norm(state.residual, state.pending, block.norm2.weight,
                                                    block.norm2.bias, block.norm2.eps)
            state.pending = self._mlp(block.mlp, normed)
            merger = self.deepstack.get(index)
            if merger is not None:  # post-shuffle norm: over merge blocks, rows of merge_unit x hidden
                width = merger.norm.weight.shape[0]
                normed, residual = add_layer_norm(
                    state.residual.view(-1, width), state.pending.view(-1, width), merger.norm.weight,
                    merger.norm.bias, merger.norm.eps,
                )
                state.residual, state.pending = residual.view(state.pending.shape), None
                if self.keeps_outputs:
                    state.features.append(self._merger_mlp(merger, normed))
            state.next_block = index + 1

    def finish(self, state: TowerState) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The final merger over the last block's output (every block must have run); None on a rank that keeps no
        outputs (ranks 1..n-1 of a tensor-parallel tower)."""
        if state.next_block != self.depth:
            raise RuntimeError(f"vision tower state at block {state.next_block} of {self.depth}: not finished")
        if not self.keeps_outputs:
            return None
        merger = self.module.merger
        normed, _ = add_layer_norm(state.residual, state.pending, merger.norm.weight, merger.norm.bias, merger.norm.eps)
        return self._merger_mlp(merger, normed.view(-1, normed.shape[1] * self.merge_unit)), state.features

    def _attention(self, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   plan: AttentionPlan) -> torch.Tensor:
        """Bidirectional attention within each frame (workers/model/vision_attention.py)."""
        q, k, v = rotary_qk(self._linear(attn.qkv, x), cos, sin, self.num_heads)
        return self._row_parallel(attn.proj, vision_attention(q, k, v, plan, attn.scaling, self.attention))

    def _mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
        if self.gelu_epilogue and x.is_cuda and fc1 not in self.fp8:  # CUDA's epilogue is the tanh GELU (CPU: erf)
            h = torch._addmm_activation(fc1.bias, x, fc1.weight.t(), use_gelu=True)
        else:
            h = mlp.act_fn(self._linear(fc1, x))
        return self._row_parallel(fc2, h)

    def _row_parallel(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """proj and fc2: this rank's input columns, the ranks' partial sums added by an all-reduce, then the bias."""
        if self.tp.size == 1:
            return self._linear(linear, x)
        out = self.tp.all_reduce(self._linear(linear, x, bias=False))
        return out if linear.bias is None else out.add_(linear.bias)

    def _linear(self, linear: nn.Linear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        b = linear.bias if bias else None
        quantised = self.fp8.get(linear)
        if quantised is None:
            return F.linear(x, linear.weight, b)
        return fp8_gemm.fp8_linear(x, quantised.weight, quantised.scale, quantised.block, b)

    @staticmethod
    def _merger_mlp(merger: nn.Module, normed: torch.Tensor) -> torch.Tensor:
        return merger.linear_fc2(merger.act_fn(merger.linear_fc1(normed)))


def check_vision_split(vision_config, size: int) -> None:
    """Raises naming the vision_config key that `size` ranks cannot split (heads, MLP columns)."""
    for key in ("num_heads", "intermediate_size"):
        value = getattr(vision_config, key)
        if value % size:
            raise CheckpointError(f"vision_config.{key} = {value} is not divisible by tensor_parallel_size {size} "
                                  "(engine.vision_tensor_parallel splits the tower's heads and MLP)")


@torch.no_grad()
def shard_vision_blocks(module: nn.Module, tp: TensorParallel) -> None:
    """Cuts each block's linears to rank tp.rank's shard, in place: qkv's rows and bias to this rank's heads (the
    rows are [q | k | v] x heads x head_dim), proj's input columns to the same heads, fc1's rows and bias and fc2's
    input columns to this rank's n-th of the MLP. proj's and fc2's biases stay whole (added once, after the
    all-reduce). Raises naming the vision_config key that tp.size does not divide."""
    config = module.config
    check_vision_split(config, tp.size)
    heads, head_dim = config.num_heads, config.hidden_size // config.num_heads
    lo, hi = tp.part(heads)
    inter_lo, inter_hi = tp.part(config.intermediate_size)

    def keep(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
        linear.out_features, linear.in_features = linear.weight.shape

    for block in module.blocks:
        qkv, proj = block.attn.qkv, block.attn.proj
        rows = qkv.weight.view(3, heads, head_dim, -1)[:, lo:hi].reshape(-1, qkv.in_features)
        bias = None if qkv.bias is None else qkv.bias.view(3, heads, head_dim)[:, lo:hi].reshape(-1)
        keep(qkv, rows, bias)
        keep(proj, proj.weight[:, lo * head_dim : hi * head_dim], None)
        fc1, fc2 = block.mlp.linear_fc1, block.mlp.linear_fc2
        keep(fc1, fc1.weight[inter_lo:inter_hi], None if fc1.bias is None else fc1.bias[inter_lo:inter_hi])
        keep(fc2, fc2.weight[:, inter_lo:inter_hi], None)
        block.attn.num_heads = hi - lo


@dataclass(frozen=True)
class Fp8Weight:
    """A linear's weight in e4m3 [N, K] with one float32 scale per output row [N, 1]."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def block(self) -> BlockShape:
        return BlockShape(1, self.weight.shape[1])


@torch.no_grad()
def quantize_block_linears(module: nn.Module) -> dict[nn.Module, Fp8Weight]:
    """Each block's attn.qkv, attn.proj, mlp.linear_fc1 and mlp.linear_fc2 quantised per output row (amax / 448, as
    fp8.quantize_weight_blocks); the float weight is replaced by an empty tensor (the tower reads the FP8 copy)."""
    out = {}
    for block in module.blocks:
        for linear in (block.attn.qkv, block.attn.proj, block.mlp.linear_fc1, block.mlp.linear_fc2):
            weight = linear.weight
            q, scale = quantize_weight_blocks(weight.float(), BlockShape(1, weight.shape[1]))
            out[linear] = Fp8Weight(q, scale)
            linear.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
    return out


def build_vision_module(arch: str, vision_config, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """transformers' vision module for the config, uninitialised, on the device (attention through SDPA)."""
    from transformers.initialization import no_init_weights

    if arch == "moe":
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel as cls
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as cls
    with no_init_weights(), torch.device(device):
        return cls._from_config(vision_config, attn_implementation="sdpa", dtype=dtype)


class VisionEncoder:
    """module: transformers' vision module (build_vision_module) holding its weights, built directly on `device` in
    `dtype` (workers.weights.vision_module: the checkpoint's, or random ones)."""

    def __init__(
        self, model_config: ModelConfig, module: nn.Module, device: torch.device, dtype: torch.dtype,
        fp8_linears: bool = False, attention: str = "sdpa", tp: TensorParallel | None = None,
    ):
        # Built in dtype on the device (.to(dtype) would also round the float32 inv_freq); inference only.
        self.model = module.eval().requires_grad_(False)
        # fc1 + GELU as one cuBLASLt epilogue on CUDA: 3% faster, and as close to float32 as transformers' bf16 module
        # (scripts/bench_vision.py, 2026-11-30 H200: relative error 0.0137 vs its 0.0140, 2.16 vs 2.23 ms per image).
        self.tower = VisionTower(self.model, gelu_epilogue=self.model.config.hidden_act == "gelu_pytorch_tanh",
                                 fp8_linears=fp8_linears, attention=attention, tp=tp)
        self.device = device
        self.dtype = dtype
        self.spatial_merge_unit = model_config.spatial_merge_size**2

    @property
    def depth(self) -> int:
        return self.tower.depth

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
               ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """pixel_values [patches, C*T*P*P], grid_thw [n, 3] -> (embeds [tokens, H], DeepStack [[tokens, H], ...]);
        None on ranks 1..n-1 of a tensor-parallel tower."""
        return self.tower(pixel_values.to(device=self.device, dtype=self.dtype), grid_thw)

    @torch.inference_mode()
    def begin(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerState:
        """A pass to run block by block (run_blocks), then finish(): encode()'s result, in several parts."""
        return self.tower.begin(pixel_values.to(device=self.device, dtype=self.dtype), grid_thw)

    @torch.inference_mode()
    def run_blocks(self, state: TowerState, count: int) -> None:
        self.tower.run_blocks(state, count)

    @torch.inference_mode()
    def finish(self, state: TowerState) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        return self.tower.finish(state)
