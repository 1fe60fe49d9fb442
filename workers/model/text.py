"""The Qwen3-VL text tower (dense or MoE) over a flat batch of tokens and a paged KV cache.

Visual embeddings replace the <|image_pad|> rows; DeepStack features are added after the first layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from workers.kv_cache import KvLayer
from workers.model import fused_norm_rope
from workers.model.attention import AttentionMetadata, paged_attention, write_kv
from workers.checkpoint_quant import BlockShape
from workers.model.layers import DenseMLP, Fp8Linear, MRotaryEmbedding, RMSNorm, apply_rope, compact_rows_scale, fuse_linears, make_linear
from workers.model.moe import MoeExperts, SparseMoeBlock
from workers.model.norm_quant import Fp8Input, Fp8Rows
from workers.parallel import TensorParallel
from workers.model_config import TextConfig

# Which of the text tower's linear modules hold FP8 weights, by module name ("layers.3.self_attn.q_proj",
# "layers.3.mlp.experts"): the scale block they are built with (one scale per row, BlockShape(1, k): see
# workers/weights.py), or None for a module in the activation dtype.
LinearPrecision = Callable[[str], BlockShape | None]


def all_float(_name: str) -> BlockShape | None:
    return None


@dataclass
class VisualRows:
    """Visual embeddings for some rows of the flat batch."""

    rows: torch.Tensor  # [n] int64 row indices
    embeds: torch.Tensor  # [n, hidden]
    deepstack: list[torch.Tensor]  # per early layer, [n, hidden]


class Attention(nn.Module):
    """This rank's query and KV heads; o_proj is row-parallel (its output all-reduced). q/k/v_proj are what the
    checkpoint loads into; fuse_projections() then makes them one GEMM (qkv_proj)."""

    def __init__(self, cfg: TextConfig, tp: TensorParallel, prefix: str = "", precision: LinearPrecision = all_float):
        super().__init__()
        self.tp = tp
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = cfg.num_key_value_heads // tp.size
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        h, q, kv, bias = cfg.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, cfg.attention_bias
        self.q_proj = make_linear(h, q, bias, precision(prefix + "q_proj"))
        self.k_proj = make_linear(h, kv, bias, precision(prefix + "k_proj"))
        self.v_proj = make_linear(h, kv, bias, precision(prefix + "v_proj"))
        self.o_proj = make_linear(q, h, bias, precision(prefix + "o_proj"))
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv_proj: nn.Module | None = None

    def fuse_projections(self) -> None:
        parts = [self.q_proj, self.k_proj, self.v_proj]
        if len({type(p) for p in parts}) > 1:  # a checkpoint that quantised only some of them: keep three GEMMs
            return
        self.qkv_proj = fuse_linears(parts)
        del self.q_proj, self.k_proj, self.v_proj

    def project_qkv(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        if self.qkv_proj is not None:
            return self.qkv_proj(x)
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def fp8_input(self, x: torch.Tensor) -> Fp8Input | None:
        """The FP8 activations the q/k/v GEMMs read (all of them FP8 layers wanting the same), else None."""
        parts = [self.qkv_proj] if self.qkv_proj is not None else [self.q_proj, self.k_proj, self.v_proj]
        if not all(isinstance(p, Fp8Linear) for p in parts):
            return None
        wants = {p.fp8_input(x) for p in parts}
        return wants.pop() if len(wants) == 1 else None

    def forward(
        self,
        x: torch.Tensor | Fp8Rows,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KvLayer,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_to_cache(x, cos, sin, kv_cache, meta.slot_mapping)
        return self.project_out(self.attend(q, k, v, kv_cache, meta))

    def qkv_to_cache(
        self, x: torch.Tensor | Fp8Rows, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KvLayer,
        slot_mapping: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The part before attention: q, k, v [T, heads or kv_heads, head_dim] normed and rotated, k and v written to
        slot_mapping's cache rows. x: the normed rows, or their FP8 form (fp8_input). out: contiguous (q, k, v) to
        write into."""
        t = x.shape[0]
        qkv = self.project_qkv(x)
        k_cache, v_cache, k_scale, v_scale = kv_cache
        if fused_norm_rope.supports(qkv):  # one kernel: both norms, RoPE, and the K/V cache write
            return fused_norm_rope.qk_norm_rope_write_kv(
                qkv, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps,
                self.num_heads, self.num_kv_heads, k_cache, v_cache, slot_mapping, k_scale, v_scale, out,
            )
        q, k, v = qkv.split([self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2, dim=-1)
        q = apply_rope(self.q_norm(q.view(t, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rope(self.k_norm(k.view(t, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if out is not None:
            q, k, v = (o.copy_(part) for o, part in zip(out, (q, k, v)))
        write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
        return q, k, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KvLayer, meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over the paged cache (this step's k/v already in it) -> [T, heads, head_dim] (into out)."""
        k_cache, v_cache, k_scale, v_scale = kv_cache
        return paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, k_scale, v_scale, out)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """The part after attention: o_proj (all-reduced under tensor parallelism)."""
        return self.tp.all_reduce(self.o_proj(o.reshape(o.shape[0], -1)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int, tp: TensorParallel, precision: LinearPrecision = all_float):
        super().__init__()
        self.tp = tp
        prefix = f"layers.{layer_idx}."
        self.self_attn = Attention(cfg, tp, prefix + "self_attn.", precision)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(
                cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, tp,
                precision(prefix + "mlp.experts"),
            )
        else:
            mlp = prefix + "mlp."
            if len({precision(mlp + p) for p in ("gate_proj", "up_proj", "down_proj")}) > 1:
                raise ValueError(f"{mlp}gate_proj/up_proj/down_proj: all three or none of them must be quantised")
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size // tp.size, precision(mlp + "gate_proj"))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        """x: the previous layer's output before its residual add (residual None: x is the whole hidden state).
        Returns this layer's MLP output and the residual it is still to be added to (the next norm adds it)."""
        h, residual = self.input_layernorm.norm_for(x, residual, self.self_attn)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm.norm_for(h, residual, self.mlp)
        return self.tp.all_reduce(self.mlp(h)), residual


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig, tp: TensorParallel, precision: LinearPrecision = all_float):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, precision) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3VLTextForEngine(nn.Module):
    """language_model.* and lm_head.* of a Qwen3-VL checkpoint (this rank's shard of them under tensor or
    expert parallelism); forward returns final hidden states, the same on every rank."""

    def __init__(self, cfg: TextConfig, tp: TensorParallel | None = None, precision: LinearPrecision = all_float):
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TensorParallel()
        self.tp.check(cfg)
        self.language_model = TextModel(cfg, self.tp, precision)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: MRotaryEmbedding | None = None

    def finish_loading(self, device: torch.device, scale_rows: int = 1) -> None:
        """Once the weights are in place (random or checkpoint, any parallel layout): the rotary tables, and
        this rank's q/k/v (and dense gate/up) projections fused into one weight each. FP8 layers load one scale per
        row; where every scale_rows rows share one (the checkpoint's blocks, whole on this rank), they keep one per
        block, so the GEMMs read one scale per tile."""
        self.rotary = MRotaryEmbedding(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.mrope_section, device)
        for layer in self.language_model.layers:
            layer.self_attn.fuse_projections()
            if isinstance(layer.mlp, DenseMLP):
                layer.mlp.fuse_projections()
        if scale_rows > 1:
            compact_fp8_scales(self, scale_rows)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KvLayer],
        visual: VisualRows | None = None,
    ) -> torch.Tensor:
        """input_ids [T], positions [3, T] -> hidden [T, H] after the final norm."""
        lm = self.language_model
        h = lm.embed_tokens(input_ids)
        if visual is not None:
            h = h.index_copy(0, visual.rows, visual.embeds.to(h.dtype))
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        residual = None
        for i, layer in enumerate(lm.layers):
            h, residual = layer(h, residual, cos, sin, kv_caches[i], meta)
            if visual is not None and i < len(visual.deepstack):  # added to the whole hidden state, as transformers does
                h, residual = (h + residual).index_add(0, visual.rows, visual.deepstack[i].to(h.dtype)), None
        return lm.norm(h) if residual is None else lm.norm.add_and_norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


@torch.no_grad()
def compact_fp8_scales(model: nn.Module, rows: int) -> None:
    """Every FP8 layer's per-row scales in blocks of `rows` rows, where that is exact (workers/model/layers.py)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear) and module.block.n == 1:
            compact = compact_rows_scale(module.weight_scale, rows)
            if compact is not None:
                module.weight_scale = nn.Parameter(compact, requires_grad=False)
                module.block = BlockShape(rows, module.block.k)
        elif isinstance(module, MoeExperts) and module.block is not None and module.block.n == 1:
            gate_up = compact_rows_scale(module.gate_up_scale, rows)
            down = compact_rows_scale(module.down_scale, rows)
            if gate_up is not None and down is not None:
                module.gate_up_scale = nn.Parameter(gate_up, requires_grad=False)
                module.down_scale = nn.Parameter(down, requires_grad=False)
                module.block = BlockShape(rows, module.block.k)
