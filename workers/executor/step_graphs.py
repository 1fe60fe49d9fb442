"""Piecewise CUDA graphs for steps that carry prompt chunks (MixedStepGraphs).

A step of prompt chunks (with or without decodes) runs the text tower as a few hundred small kernels a layer's worth
of host work each; run eagerly, the host's launches, not the GPU, set such a step's pace (benchmarks/README.md,
run50: FP8 steps of 16k tokens took 223 ms of wall for 148 ms of kernels). Here everything between two layers'
attention is one CUDA graph, captured once per bucketed token count: o_proj, the residual add and norm, the MoE or
MLP, the next layer's norm, q/k/v projection, q/k norm, RoPE and the K/V cache write. Attention itself runs eagerly
between the graphs, because its launch shape follows the step's chunks (this is vLLM v1's piecewise split:
https://docs.vllm.ai/en/latest/design/cuda_graphs.html). A step of T tokens replays the graphs of the smallest
captured size n >= T: rows T..n-1 are padding, zeroed before the first graph (so every value they carry stays
finite), writing their K/V into one scratch slot, and never read back.

The graphs read and write static buffers: the hidden state's residual stream (`res`), this layer's q/k/v, the
attention output, RoPE's cos/sin and the final hidden state. The DeepStack layers (visual features added to the
hidden state after the first few layers, as Qwen3-VL does) end their graph at the residual add, so that the step's
visual rows can be added eagerly before the next graph; steps without images replay the same graphs and add nothing.
Every add rounds where the eager forward (Qwen3VLTextForEngine.forward) rounds, so the two give the same numbers.

With capture False the pieces run eagerly over the same buffers: the CPU tests check the piecewise forward itself
(padding, in-place residual, the DeepStack split) against the plain forward.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from workers.executor.decode_graphs import StepBatch
from workers.host_copy import copy_into
from workers.kv_cache import KvCache
from workers.model.attention import AttentionMetadata
from workers.model.text import Qwen3VLTextForEngine, VisualRows

log = logging.getLogger(__name__)


def step_graph_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture, ascending, the last max_tokens: powers of two from 16 to 128, then every 128 to 1,024,
    every 256 to 4,096, every 512 to 8,192 and every 1,024 beyond. A step pads to the next size: above 1,024 tokens by
    at most a quarter of its rows, above 4,096 by at most an eighth (a 4,097-token step runs 4,608), and small mixed
    steps keep small MoE batches."""
    sizes = [16, 32, 64, 128]
    size = 128
    while size < max_tokens:
        size += 128 if size < 1024 else 256 if size < 4096 else 512 if size < 8192 else 1024
        sizes.append(size)
    return [s for s in sizes if s < max_tokens] + [max_tokens]


class MixedStepGraphs:
    """The text tower's hidden states for steps of up to max(sizes) tokens, as graph pieces around eager attention.

    num_deepstack: how many first layers take visual features after them (len(deepstack_visual_indexes)).
    scratch_block: a KV block no request holds; padded rows write there. capture False: no CUDA graphs (the pieces
    run eagerly; for the CPU tests)."""

    def __init__(
        self, model: Qwen3VLTextForEngine, kv: KvCache, sizes: list[int], num_deepstack: int, scratch_block: int,
        capture: bool = True,
    ):
        cfg = model.cfg
        self.model = model
        self.kv = kv
        self.sizes = sorted(sizes)
        self.num_layers = cfg.num_hidden_layers
        self.num_deepstack = min(num_deepstack, self.num_layers - 1)
        self.capture = capture
        device = kv.tensor.device
        dtype = model.lm_head.weight.dtype
        attn = model.language_model.layers[0].self_attn
        most = self.sizes[-1]
        self.scratch_slot = scratch_block * kv.block_size
        self.input_ids = torch.zeros(most, dtype=torch.long, device=device)
        self.positions = torch.zeros(3, most, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((most,), self.scratch_slot, dtype=torch.long, device=device)
        self.res = torch.zeros(most, cfg.hidden_size, dtype=dtype, device=device)  # the residual stream
        self.hidden = torch.zeros(most, cfg.hidden_size, dtype=dtype, device=device)  # after the final norm
        self.q = torch.zeros(most, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(most, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.attn = torch.zeros_like(self.q)  # attention output, o_proj's input
        self.cos = torch.zeros(most, attn.head_dim, dtype=dtype, device=device)
        self.sin = torch.zeros_like(self.cos)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        if capture:
            t0 = time.perf_counter()
            self._capture()
            log.info("captured mixed-step CUDA graphs (%d pieces each) for %d token counts up to %d in %.1f s",
                     len(self._pieces(self.sizes[0])), len(self.sizes), most, time.perf_counter() - t0)

    def fits(self, batch: StepBatch, visual: VisualRows | None) -> bool:
        return batch.num_tokens <= self.sizes[-1] and (visual is None or len(visual.deepstack) <= self.num_deepstack)

    # ---- the pieces ---------------------------------------------------------------------------------

    def _pieces(self, n: int) -> list[Callable[[], None]]:
        """The graph pieces of an n-row step in the order run() replays them, attention and DeepStack between."""
        pieces = [lambda: (self._rope_tables(n), self._before_attention(0, n))]
        for i in range(self.num_layers):
            if 0 < i <= self.num_deepstack:
                pieces.append(lambda i=i: self._before_attention(i, n))
            pieces.append(lambda i=i: self._after_attention(i, n))
        return pieces

    def _rope_tables(self, n: int) -> None:
        cos, sin = self.model.rotary.cos_sin(self.positions[:, :n], self.cos.dtype)
        self.cos[:n].copy_(cos)
        self.sin[:n].copy_(sin)

    def _qkv(self, i: int, h: torch.Tensor, n: int) -> None:
        layer = self.model.language_model.layers[i]
        layer.self_attn.qkv_to_cache(h, self.cos[:n], self.sin[:n], self.kv.layers[i], self.slot_mapping[:n],
                                     out=(self.q[:n], self.k[:n], self.v[:n]))

    def _before_attention(self, i: int, n: int) -> None:
        """Layer i up to its attention, from the residual stream alone (layer 0, and the layers after DeepStack's)."""
        layer = self.model.language_model.layers[i]
        self._qkv(i, layer.input_layernorm.norm_for(self.res[:n], None, layer.self_attn)[0], n)

    def _after_attention(self, i: int, n: int) -> None:
        """Layer i from its attention output on; then the final norm (last layer), or the residual add (a DeepStack
        layer: the visual features are added before the next piece), or the next layer up to its attention."""
        layers = self.model.language_model.layers
        layer, res = layers[i], self.res[:n]
        h = layer.self_attn.project_out(self.attn[:n])
        h, _ = layer.post_attention_layernorm.norm_for(h, res, layer.mlp, res_out=res)
        x = layer.tp.all_reduce(layer.mlp(h))
        if i == self.num_layers - 1:
            self.model.language_model.norm.add_and_norm(x, res, out=self.hidden[:n], res_out=res)
        elif i < self.num_deepstack:
            res.add_(x)
        else:
            h, _ = layers[i + 1].input_layernorm.norm_for(x, res, layers[i + 1].self_attn, res_out=res)
            self._qkv(i + 1, h, n)

    # ---- capture and replay -------------------------------------------------------------------------

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for n in reversed(self.sizes):  # largest first, so smaller sizes reuse its pool memory
            pieces = self._pieces(n)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for piece in pieces:  # warm-up: compiles kernels, creates handles
                    piece()
            torch.cuda.current_stream().wait_stream(side)
            graphs = []
            for piece in pieces:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    piece()
                graphs.append(graph)
            self.graphs[n] = graphs
        torch.cuda.synchronize()

    def run(self, batch: StepBatch, meta: AttentionMetadata, visual: VisualRows | None) -> torch.Tensor:
        """Final hidden states [T, hidden] of a step of T <= max(sizes) tokens (a view into a static buffer, valid
        until the next step). meta: the step's attention metadata, as the eager forward takes it."""
        t = batch.num_tokens
        n = next(s for s in self.sizes if s >= t)
        copy_into(self.input_ids[:t], batch.input_ids)
        copy_into(self.positions[:, :t], batch.positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)  # already on the device: no second host copy
        if n > t:  # padding rows: no real slot may be written, and every value they carry stays finite
            self.slot_mapping[t:n].fill_(self.scratch_slot)
            self.res[t:n].zero_()
            self.attn[t:n].zero_()
        torch.index_select(self.model.language_model.embed_tokens.weight, 0, self.input_ids[:t], out=self.res[:t])
        if visual is not None:
            self.res.index_copy_(0, visual.rows, visual.embeds.to(self.res.dtype))
        pieces = self.graphs[n] if self.capture else self._pieces(n)
        replay: Callable[[int], None] = (lambda p: pieces[p].replay()) if self.capture else (lambda p: pieces[p]())
        q, k, v, attn = self.q[:t], self.k[:t], self.v[:t], self.attn[:t]
        p = 0
        replay(p)
        for i, layer in enumerate(self.model.language_model.layers):
            if 0 < i <= self.num_deepstack:
                if visual is not None and i - 1 < len(visual.deepstack):
                    self.res.index_add_(0, visual.rows, visual.deepstack[i - 1].to(self.res.dtype))
                p += 1
                replay(p)
            layer.self_attn.attend(q, k, v, self.kv.layers[i], meta, out=attn)
            p += 1
            replay(p)
        return self.hidden[:t]
