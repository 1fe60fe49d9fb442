"""Fused MoE experts in Triton: token-expert pairs sorted by expert and padded per expert to BLOCK_M rows,
then one kernel per expert GEMM that gathers its input rows through the sorted pair ids.

GEMM 1 computes gate and up tiles together and writes silu(gate) * up; GEMM 2 multiplies by the routing
weight. Every shape is fixed by the token count, so both run inside CUDA graphs (no host sync).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


TUNED_DIR = Path(__file__).with_name("fused_moe_configs")  # {device name}.json, written by scripts/tune_fused_moe.py


def shape_key(num_experts: int, n: int, k: int, gated: bool) -> str:
    return f"E={num_experts},N={n},K={k},{'gated' if gated else 'down'}"


@functools.cache
def _tuned(device_name: str) -> dict[str, list[tuple[int, TileConfig]]]:
    path = TUNED_DIR / f"{device_name.replace(' ', '_')}.json"
    if not path.is_file():
        return {}
    table = json.loads(path.read_text())
    return {key: [(pairs, TileConfig(*cfg)) for pairs, cfg in rows] for key, rows in table.items()}


def tile_config(num_pairs: int, gated: bool, shape: str | None = None, device_name: str | None = None) -> TileConfig:
    """Tiles by token-expert pairs: the tuned table of this device and shape where there is one (the entry
    of the smallest tuned pair count >= num_pairs, else the largest), else small BLOCK_M while each expert
    sees few rows (decode streams weights) and large tiles once experts see hundreds of rows (prefill)."""
    rows = _tuned(device_name).get(shape) if shape and device_name else None
    if rows:
        return next((cfg for pairs, cfg in rows if pairs >= num_pairs), rows[-1][1])
    if num_pairs <= 64:
        return TileConfig(16, 64, 128, 4, 4)
    if num_pairs <= 4096:
        return TileConfig(16, 128 if gated else 256, 64, 4 if gated else 8, 4)
    if num_pairs <= 16384:
        return TileConfig(64, 64 if gated else 128, 64, 4, 4)
    return TileConfig(128, 64 if gated else 128, 64, 8, 4)


def supports(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def align_pairs(top_i: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair ids (token * k + slot) grouped by expert, each group padded to a multiple of block_m with the
    id P (= number of pairs, an invalid row), and the expert of every block_m rows (num_experts: empty).
    Sizes depend only on P: the worst case P + E * (block_m - 1) rows."""
    flat = top_i.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat.to(torch.int32), stable=True)  # 32-bit keys: half the radix passes of int64
    counts = torch.histc(flat.float(), bins=num_experts, min=0, max=num_experts).to(torch.int64)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    sorted_expert = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[sorted_expert]
    dest = (padded_end - padded)[sorted_expert] + rank
    num_blocks = (num_pairs + num_experts * (block_m - 1) + block_m - 1) // block_m
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids.index_put_((dest,), order.to(torch.int32))
    block_start = torch.arange(num_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_ids, block_expert


if triton is not None:

    @triton.jit
    def _moe_gemm_kernel(
        a_ptr, b_ptr, c_ptr, w_ptr, sorted_ids_ptr, block_expert_ptr,
        num_pairs, num_experts, N, K, row_div,
        stride_am, stride_be, stride_bn, stride_bk, stride_cm,
        GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert >= num_experts:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ids = tl.load(sorted_ids_ptr + offs_m)
        valid = ids < num_pairs
        rows = (ids // row_div).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        b_base = b_ptr + expert.to(tl.int64) * stride_be
        b_ptrs = b_base + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATED:  # the up rows of the fused gate_up weight start N rows after the gate rows
            up_ptrs = b_ptrs + N * stride_bn
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
            else:
                k_mask = offs_k < K - k
                a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            if GATED:
                if EVEN_K:
                    u = tl.load(up_ptrs, mask=n_mask[None, :], other=0.0)
                else:
                    u = tl.load(up_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                acc_up = tl.dot(a, u, acc_up)
                up_ptrs += BLOCK_K * stride_bk
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk
        out_ty = c_ptr.dtype.element_ty
        # Rounded to the storage dtype at the same points as the unfused torch path.
        if GATED:
            gate = acc.to(out_ty).to(tl.float32)
            up = acc_up.to(out_ty).to(tl.float32)
            act = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32)
            out = (act * up).to(out_ty)
        elif MUL_WEIGHT:
            weight = tl.load(w_ptr + ids, mask=valid, other=0.0).to(tl.float32)
            out = (acc.to(out_ty).to(tl.float32) * weight[:, None]).to(out_ty)
        else:
            out = acc.to(out_ty)
        c_ptrs = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, out, mask=valid[:, None] & n_mask[None, :])


def _gemm(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None, sorted_ids: torch.Tensor,
    block_expert: torch.Tensor, row_div: int, gated: bool, cfg: TileConfig,
) -> None:
    """out[pair] = a[pair // row_div] @ b[expert(pair)].T (gated: silu(gate) * up; weights: times weight[pair])."""
    num_experts, rows, k = b.shape
    n = rows // 2 if gated else rows
    grid = (block_expert.numel(), triton.cdiv(n, cfg.block_n))
    _moe_gemm_kernel[grid](
        a, b, out, weights if weights is not None else out, sorted_ids, block_expert,
        out.shape[0], num_experts, n, k, row_div,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        GATED=gated, MUL_WEIGHT=weights is not None, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def fused_experts(
    x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    foreign: bool = False,
) -> torch.Tensor:
    """x [T, H]; top_w/top_i [T, k]; gate_up_proj [E, 2I, H]; down_proj [E, H, I] -> [T, H]:
    sum over the k chosen experts of weight * down(silu(gate(x)) * up(x)). foreign: top_i may hold E (a pair
    served by another rank under expert parallelism): its blocks are skipped and it contributes zero."""
    tokens, k = top_i.shape
    num_experts, two_i, hidden = gate_up_proj.shape
    if x.stride(1) != 1 or gate_up_proj.stride(2) != 1 or down_proj.stride(2) != 1:
        raise ValueError("fused_experts needs row-major activations and expert weights")
    num_pairs = tokens * k
    device = torch.cuda.get_device_name(x.device)
    cfg1 = tile_config(num_pairs, True, shape_key(num_experts, two_i // 2, hidden, True), device)
    cfg2 = tile_config(num_pairs, False, shape_key(num_experts, hidden, two_i // 2, False), device)
    bins = num_experts + foreign  # the foreign bin's blocks have expert id E: the kernel skips them
    ids1, experts1 = align_pairs(top_i, bins, cfg1.block_m)
    ids2, experts2 = (ids1, experts1) if cfg2.block_m == cfg1.block_m else align_pairs(top_i, bins, cfg2.block_m)
    act = x.new_empty(num_pairs, two_i // 2)
    _gemm(x, gate_up_proj, act, None, ids1, experts1, k, True, cfg1)
    ys = (x.new_zeros if foreign else x.new_empty)(num_pairs, hidden)
    _gemm(act, down_proj, ys, top_w.reshape(-1).contiguous(), ids2, experts2, 1, False, cfg2)
    return ys.view(tokens, k, hidden).sum(dim=1)
