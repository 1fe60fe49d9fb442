"""Tensor and expert parallelism inside one model instance: the rank's group, its all-reduce, and how each
checkpoint tensor is cut into this rank's shard.

Layout (one process per rank, TP group = all ranks of the instance):
* attention: query heads and KV heads split evenly (needs num_key_value_heads % size == 0); o_proj is
  row-parallel, its output all-reduced; each rank's KV cache holds its KV-head shard.
* dense MLP: gate/up column-parallel, down row-parallel, all-reduced.
* MoE, expert_parallel=False: every expert's intermediate dimension split (gate, up, down all cut);
  expert_parallel=True: experts split whole (rank r owns experts [r*E/size, (r+1)*E/size)), every token
  routed on every rank, each rank computes its local experts only; one all-reduce either way.
* embeddings, norms, router and lm_head: replicated (sampling runs on rank 0).
* the vision tower: whole on rank 0, or with EngineConfig.vision_tensor_parallel its heads and MLP split as the
  text layers' are, the mergers on rank 0 (workers/model/vision.py, shard_vision_blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.model_config import CheckpointError, TextConfig


@dataclass
class TensorParallel:
    """This rank's place in its instance. size 1: no communication at all."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    group: object | None = None  # torch.distributed group of the instance (NCCL on CUDA, gloo on CPU)

    def check(self, cfg: TextConfig) -> None:
        """Raises naming the config key that this parallel layout cannot split."""
        n = self.size
        for key, value in (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", cfg.num_key_value_heads)):
            if value % n:
                raise CheckpointError(f"text_config.{key} = {value} is not divisible by tensor_parallel_size {n}")
        if cfg.num_experts and self.expert_parallel and cfg.num_experts % n:
            raise CheckpointError(f"text_config.num_experts = {cfg.num_experts} is not divisible by tensor_parallel_size {n}")
        if cfg.num_experts and not self.expert_parallel and cfg.moe_intermediate_size % n:
            raise CheckpointError(
                f"text_config.moe_intermediate_size = {cfg.moe_intermediate_size} is not divisible by tensor_parallel_size {n}"
            )
        if cfg.intermediate_size % n and (not cfg.num_experts or cfg.mlp_only_layers):
            raise CheckpointError(f"text_config.intermediate_size = {cfg.intermediate_size} is not divisible by {n}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def part(self, n: int) -> tuple[int, int]:
        """This rank's [lo, hi) of n items split evenly."""
        step = n // self.size
        return self.rank * step, (self.rank + 1) * step

    def _cut(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        lo, hi = self.part(t.shape[dim])
        return t.narrow(dim, lo, hi - lo)

    def full_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The unsplit shape of an expert parameter whose shard has `shape`."""
        e, rows, cols = shape
        if self.expert_parallel:
            return (e * self.size, rows, cols)
        return (e, rows * self.size, cols) if name.endswith("gate_up_proj") else (e, rows, cols * self.size)

    # An FP8 weight's scale parameter (one scale per row and K block) is cut as its weight is: the same rows, and
    # along K the blocks of this rank's columns (check_scale_cut makes sure they are whole).
    _SCALE_OF = {"weight_scale": "weight", "experts.gate_up_scale": "experts.gate_up_proj", "experts.down_scale": "experts.down_proj"}
    _COLUMN_CUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")

    def _weight_name(self, name: str) -> tuple[str, bool]:
        for scale, weight in self._SCALE_OF.items():
            if name.endswith(scale):
                return name.removesuffix(scale) + weight, True
        return name, False

    def _cuts_columns(self, weight_name: str) -> bool:
        return weight_name.endswith(self._COLUMN_CUTS) or (weight_name.endswith("mlp.experts.down_proj") and not self.expert_parallel)

    def check_scale_cut(self, name: str, cols: int, block_k: int, source_name: str) -> None:
        """Raises unless this rank's input columns of the FP8 weight `name` are whole scale blocks (a K slice cannot
        split a block: its activations would be quantised in groups that straddle two ranks)."""
        if self.size == 1 or not self._cuts_columns(name) or block_k >= cols:
            return
        local = cols // self.size
        if local % block_k:
            raise CheckpointError(
                f"{source_name}: tensor_parallel_size {self.size} gives each rank {local} of its {cols} input columns, "
                f"not a whole number of the checkpoint's {block_k}-column scale blocks"
                + ("; use expert_parallel: true" if "experts" in name else "")
            )

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor `name` (engine parameter name, experts in memory layout)."""
        if self.size == 1:
            return tensor
        name, is_scale = self._weight_name(name)
        if is_scale and self._cuts_columns(name) and tensor.shape[-1] == 1:
            return tensor  # one scale for all columns (per-channel): every rank's K slice uses it
        if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                          "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                          "mlp.gate_proj.weight", "mlp.up_proj.weight")):
            return self._cut(tensor, 0)
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            return self._cut(tensor, 1)
        if name.endswith("self_attn.o_proj.bias"):  # added once, by rank 0, before the all-reduce
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            if self.expert_parallel:
                return self._cut(tensor, 0)
            gate, up = tensor.chunk(2, dim=1)
            return torch.cat([self._cut(gate, 1), self._cut(up, 1)], dim=1)
        if name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            return self._cut(tensor, 0 if self.expert_parallel else 2)
        return tensor
