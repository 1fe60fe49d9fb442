"""The Qwen3-VL text tower (dense or MoE) over a flat batch of tokens and a paged KV cache.

Visual embeddings replace the <|image_pad|> rows; DeepStack features are added after the first layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workers.model.attention import AttentionMetadata, paged_attention, write_kv
from workers.model.layers import DenseMLP, MRotaryEmbedding, RMSNorm, apply_rope
from workers.model.moe import SparseMoeBlock
from workers.parallel import TensorParallel
from workers.weights import TextConfig


@dataclass
class VisualRows:
    """Visual embeddings for some rows of the flat batch."""

    rows: torch.Tensor  # [n] int64 row indices
    embeds: torch.Tensor  # [n, hidden]
    deepstack: list[torch.Tensor]  # per early layer, [n, hidden]


class Attention(nn.Module):
    """This rank's query and KV heads; o_proj is row-parallel (its output all-reduced)."""

    def __init__(self, cfg: TextConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = cfg.num_key_value_heads // tp.size
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.tp.all_reduce(self.o_proj(o.reshape(t, -1)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.self_attn = Attention(cfg, tp)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, tp)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size // tp.size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x)))


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3VLTextForEngine(nn.Module):
    """language_model.* and lm_head.* of a Qwen3-VL checkpoint (this rank's shard of them under tensor or
    expert parallelism); forward returns final hidden states, the same on every rank."""

    def __init__(self, cfg: TextConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TensorParallel()
        self.tp.check(cfg)
        self.language_model = TextModel(cfg, self.tp)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: MRotaryEmbedding | None = None

    def init_rotary(self, device: torch.device) -> None:
        self.rotary = MRotaryEmbedding(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.mrope_section, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        visual: VisualRows | None = None,
    ) -> torch.Tensor:
        """input_ids [T], positions [3, T] -> hidden [T, H] after the final norm."""
        lm = self.language_model
        h = lm.embed_tokens(input_ids)
        if visual is not None:
            h = h.index_copy(0, visual.rows, visual.embeds.to(h.dtype))
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        for i, layer in enumerate(lm.layers):
            h = layer(h, cos, sin, kv_caches[i], meta)
            if visual is not None and i < len(visual.deepstack):
                h = h.index_add(0, visual.rows, visual.deepstack[i].to(h.dtype))
        return lm.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
