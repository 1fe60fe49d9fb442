"""Fused MoE experts in Triton: up to SMALL_BATCH_TOKENS tokens, two GEMV kernels straight from the routing;
above it, pairs sorted and padded per expert to BLOCK_M rows (moe_routing.align_pairs) and two tiled GEMMs.

Both paths fuse gate and up with silu(gate) * up, and the down projection with the routing weight; the GEMV
down kernel also sums each token's k outputs. Every shape is fixed by the token count, so both run inside
CUDA graphs (no host sync).

FP8 experts (block scales given): the tiled path is W8A8 (x quantised per token and group of 128 once; the gated
GEMM's epilogue quantises its own output tile rows, BLOCK_N == 128 being one group, for the down GEMM: no bf16
round trip of the gated output and no extra launch), the GEMV path W8A16 (weights dequantised in registers;
activations stay bf16, as decode streams weights and the activation bytes are negligible). TMA weight tiles
serve fp8 too: the descriptor's tile is [BLOCK_N, 128] fp8 elements, 128 bytes a row.
"""

from __future__ import annotations

import functools
import json
from dataclasses import astuple, dataclass
from pathlib import Path

import torch

from workers.checkpoint_quant import BlockShape
from workers.model.fp8 import FP8_DTYPE
from workers.model.fp8_gemm import quantize_activations
from workers.model.moe_routing import Alignment, align_pairs
from workers.model.norm_quant import Fp8Rows

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

if triton is not None:
    from workers.model.fp8_gemm import quantize_group  # the gated GEMM's fp8 epilogue


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # Launch order of the tiled GEMMs: GROUP_M blocks of rows go through every BLOCK_N column before the next
    # group starts, so programs running together share A rows and expert weight tiles in L2. 0: column order
    # (each column over all row blocks in turn; what a tuned-table row of five numbers means).
    group_m: int = 0
    # 1: the tiled GEMMs read expert weight tiles through TMA (a tensor descriptor: one async bulk copy per tile,
    # no per-element addresses in registers); 0: pointer loads. The activation rows are gathered either way.
    tma: int = 0


# Decode batches up to this many tokens take the GEMV kernels: one program per (pair, BLOCK_N rows of gate
# and up) reads its slice of the expert weights in a few wide loads, and one program per (token, BLOCK_N
# output columns) runs the k down projections and sums them. Above it the tiled GEMMs (BLOCK_M >= 16 rows
# per expert) reuse each weight tile across the expert's rows.
SMALL_BATCH_TOKENS = 8
GEMV_GATED = TileConfig(1, 4, 512, 4, 1)
GEMV_DOWN = TileConfig(1, 4, 128, 8, 1)
# FP8 GEMV: BLOCK_K is the scale block (128 fp8 bytes a row), so more rows per program keep the loads as wide.
GEMV_GATED_FP8 = TileConfig(1, 16, 128, 4, 1)
GEMV_DOWN_FP8 = TileConfig(1, 8, 128, 8, 1)
FP8_BLOCK_K = 128  # the fp8 paths' K tile: one activation and one weight scale per tile

TUNED_DIR = Path(__file__).with_name("fused_moe_configs")  # {device name}.json: scripts/tune_fused_moe.py (bf16), tune_fp8.py (",fp8" rows)


def shape_key(num_experts: int, n: int, k: int, gated: bool, fp8: bool = False) -> str:
    """A tuned table's key; fp8 experts have their own rows (",fp8"), which keep BLOCK_K 128 (and gated BLOCK_N 128)."""
    return f"E={num_experts},N={n},K={k},{'gated' if gated else 'down'}{',fp8' if fp8 else ''}"


def read_table(path: Path) -> dict[str, list[tuple[int, TileConfig]]]:
    """A tuned table: {shape_key: [[pairs, [block_m, block_n, block_k, num_warps, num_stages(, group_m(, tma))]], ...]}
    -> rows sorted by pairs."""
    table = json.loads(path.read_text())
    return {key: sorted(((pairs, TileConfig(*cfg)) for pairs, cfg in rows), key=lambda row: row[0]) for key, rows in table.items()}


def merged_table(old: dict[str, list[tuple[int, TileConfig]]], new: dict[str, list]) -> dict[str, list]:
    """read_table's rows with new rows ({shape_key: [[pairs, [block_m, ...]], ...]}) replacing or adding their pair
    counts, as plain lists sorted by pairs (table_text's input)."""
    out = {key: {pairs: list(astuple(cfg)) for pairs, cfg in rows} for key, rows in old.items()}
    for key, rows in new.items():
        out.setdefault(key, {}).update({pairs: list(cfg) for pairs, cfg in rows})
    return {key: [[pairs, rows[pairs]] for pairs in sorted(rows)] for key, rows in out.items()}


def table_text(table: dict[str, list]) -> str:
    """A tuned table as JSON with one [pairs, config] row a line (read_table reads it back)."""
    keys = [f' {json.dumps(key)}: [\n' + ",\n".join(f"  {json.dumps(row)}" for row in rows) + "\n ]" for key, rows in table.items()]
    return "{\n" + ",\n".join(keys) + "\n}\n"


@functools.cache
def _tuned(device_name: str) -> dict[str, list[tuple[int, TileConfig]]]:
    path = TUNED_DIR / f"{device_name.replace(' ', '_')}.json"
    return read_table(path) if path.is_file() else {}


def tile_config(
    num_pairs: int, gated: bool, shape: str | None = None, device_name: str | None = None, fp8: bool = False,
) -> TileConfig:
    """Tiles by token-expert pairs: the tuned table of this device and shape where there is one (the entry
    of the smallest tuned pair count >= num_pairs, else the largest), else small BLOCK_M while each expert
    sees few rows (decode streams weights) and large tiles once experts see hundreds of rows (prefill)."""
    rows = _tuned(device_name).get(shape) if shape and device_name else None
    if rows:
        cfg = next((cfg for pairs, cfg in rows if pairs >= num_pairs), rows[-1][1])
        if fp8 and (cfg.block_k != FP8_BLOCK_K or (gated and cfg.block_n != 128)):
            raise ValueError(f"tuned fp8 tiles {cfg} for {shape}: fp8 needs BLOCK_K 128 (and BLOCK_N 128 when gated)")
        return cfg
    if fp8:  # the bf16 heuristic's row counts, K tiles of one scale block (fp8 tiles are half the bytes)
        if num_pairs <= 64:
            return TileConfig(16, 128 if gated else 64, 128, 4, 4, 1)
        if num_pairs <= 4096:
            return TileConfig(16, 128, 128, 4, 4, 1)
        if num_pairs <= 16384:
            return TileConfig(64, 128, 128, 4, 3, 1)
        # H200 sweep at 65,536 pairs (scripts/tune_fp8.py): 64-row tiles, 4 warps, TMA weight tiles; 128 x 128 x 8 warps
        # took 2.8x bf16's time (the fp8 dot's scaled float32 result beside two accumulators spills).
        return TileConfig(64, 128, 128, 4, 2 if gated else 3, 8, 1)
    if num_pairs <= 64:
        return TileConfig(16, 64, 128, 4, 4, 1)
    if num_pairs <= 4096:
        return TileConfig(16, 128 if gated else 256, 64, 4 if gated else 8, 4, 1)
    if num_pairs <= 16384:
        return TileConfig(64, 64 if gated else 128, 64, 4, 4, 1)
    return TileConfig(128, 128 if gated else 256, 64, 8, 4 if gated else 3, 1)


HEURISTIC_PAIR_BOUNDS = (64, 4096, 16384)  # where tile_config's untuned choice changes (pairs <= bound), both dtypes


def warm_up_tokens(gate_up_proj: torch.Tensor, top_k: int, max_tokens: int, device_name: str | None = None) -> list[int]:
    """Step sizes (tokens, above the GEMV path's SMALL_BATCH_TOKENS and at most max_tokens) that between them take
    every pair of tile configs the tiled path uses for steps of up to max_tokens tokens: one per pair, the
    smallest. Each config compiles its own Triton kernels on first use; a step of each size compiles them all."""
    num_experts, two_i, hidden = gate_up_proj.shape
    fp8 = gate_up_proj.dtype == FP8_DTYPE
    keys = shape_key(num_experts, two_i // 2, hidden, True, fp8), shape_key(num_experts, hidden, two_i // 2, False, fp8)
    bounds = {pairs for key in keys for pairs, _ in _tuned(device_name).get(key, [])} if device_name else set()
    bounds.update(HEURISTIC_PAIR_BOUNDS)
    # A row holds pair counts up to its bound: the bound's own token count falls in it, one more token past it.
    candidates = {t for b in bounds for t in (b // top_k, b // top_k + 1)} | {max_tokens}
    tokens, seen = [], set()
    for t in sorted(t for t in candidates if SMALL_BATCH_TOKENS < t <= max_tokens):
        pair = (tile_config(t * top_k, True, keys[0], device_name, fp8),
                tile_config(t * top_k, False, keys[1], device_name, fp8))
        if pair not in seen:
            seen.add(pair)
            tokens.append(t)
    return tokens


def supports(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


if triton is not None:

    # num_pairs and num_blocks vary with the token count: one compile per tile config
    @triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
    def _moe_gemm_kernel(
        a_ptr, b_ptr, b_desc, c_ptr, w_ptr, sorted_ids_ptr, block_expert_ptr,
        num_pairs, num_blocks, num_experts, N, K, row_div,
        stride_am, stride_be, stride_bn, stride_bk, stride_cm,
        as_ptr, bs_ptr, cs_ptr, scale_rows, stride_asm, stride_bse, stride_bsn, stride_bsk, stride_csm,
        GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        OUT_TY: tl.constexpr, FP8: tl.constexpr,
    ):
        """FP8: a and b are e4m3 with per-(row, K tile) scales as (as_ptr: [pairs or tokens, K / BLOCK_K]) and
        per-(scale_rows rows, K tile) expert scales bs ([E, rows / scale_rows, K / BLOCK_K]); BLOCK_K is the
        scale block (128). Gated FP8 (BLOCK_N == 128): the output tile's rows are quantised per token and group
        of 128 as the down GEMM reads them, scales into cs ([pairs, N / 128]); OUT_TY: the dtype the epilogue
        rounds to before that (x's), c being fp8 then."""
        pid = tl.program_id(0)  # one program per (BLOCK_M rows, BLOCK_N columns), in TileConfig.group_m's order
        if GROUP_M == 0:
            pid_m = pid % num_blocks
            pid_n = pid // num_blocks
        else:
            in_group = GROUP_M * tl.cdiv(N, BLOCK_N)
            first_m = pid // in_group * GROUP_M
            rows_in_group = tl.minimum(num_blocks - first_m, GROUP_M)
            pid_m = first_m + pid % in_group % rows_in_group
            pid_n = pid % in_group // rows_in_group
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
        if FP8:
            as_ptrs = as_ptr + rows * stride_asm
            bs_ptrs = bs_ptr + expert.to(tl.int64) * stride_bse + (offs_n // scale_rows) * stride_bsn
            if GATED:
                us_ptrs = bs_ptr + expert.to(tl.int64) * stride_bse + ((N + offs_n) // scale_rows) * stride_bsn
        # TMA: b_desc views the weights as [experts * rows, K]; a tile past N reads the next rows (the up
        # rows, or the next expert's), which only feed columns the store masks off; past K it reads zeros.
        b_row = expert * (2 * N if GATED else N) + pid_n * BLOCK_N
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            else:
                k_mask = offs_k < K - k
                a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            if USE_TMA:
                b = tl.trans(b_desc.load([b_row, k]))
            elif EVEN_K:
                b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
            else:
                b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if FP8:  # one scale per row and K tile on each side: applied to the tile's float32 dot
                a_s = tl.load(as_ptrs + k // BLOCK_K, mask=valid, other=0.0)
                b_s = tl.load(bs_ptrs + k // BLOCK_K * stride_bsk, mask=n_mask, other=0.0)
                acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            else:
                acc = tl.dot(a, b, acc)
            if GATED:
                if USE_TMA:
                    u = tl.trans(b_desc.load([b_row + N, k]))
                elif EVEN_K:
                    u = tl.load(up_ptrs, mask=n_mask[None, :], other=0.0)
                else:
                    u = tl.load(up_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                if FP8:
                    u_s = tl.load(us_ptrs + k // BLOCK_K * stride_bsk, mask=n_mask, other=0.0)
                    acc_up += tl.dot(a, u) * a_s[:, None] * u_s[None, :]
                else:
                    acc_up = tl.dot(a, u, acc_up)
                up_ptrs += BLOCK_K * stride_bk
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk
        out_ty = OUT_TY
        # Rounded to the storage dtype at the same points as the unfused torch path.
        if GATED:
            gate = acc.to(out_ty).to(tl.float32)
            up = acc_up.to(out_ty).to(tl.float32)
            act = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32)
            out = (act * up).to(out_ty)
            if FP8:  # columns past N are 0 (their weight scales load as 0, TMA or not): no effect on the amax
                q, q_scale = quantize_group(out.to(tl.float32))
                out = q.to(c_ptr.dtype.element_ty)
                tl.store(cs_ptr + ids.to(tl.int64) * stride_csm + pid_n, q_scale, mask=valid)
        elif MUL_WEIGHT:
            weight = tl.load(w_ptr + ids, mask=valid, other=0.0).to(tl.float32)
            out = (acc.to(out_ty).to(tl.float32) * weight[:, None]).to(out_ty)
        else:
            out = acc.to(out_ty)
        c_ptrs = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, out, mask=valid[:, None] & n_mask[None, :])

    @triton.jit
    def _gemv_gated_kernel(
        x_ptr, w_ptr, act_ptr, ids_ptr, num_experts, top_k, stride_xm, stride_we, stride_wn, stride_am,
        s_ptr, scale_rows, stride_se, stride_sn, stride_sk,
        N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        FP8: tl.constexpr,
    ):
        """act[pair, n] = silu(gate[e] . x[token]) * (up[e] . x[token]); grid (pairs, N / BLOCK_N): the pairs of one
        column slice run together, so experts chosen by several tokens are read from L2 after the first.
        FP8 (W8A16): e4m3 weights times their block scale s[e, row / scale_rows, k / BLOCK_K] in registers, then
        times x as it is (BLOCK_K is the scale block, 128)."""
        pair = tl.program_id(0)
        expert = tl.load(ids_ptr + pair)
        if expert >= num_experts:  # served by another rank: the down kernel skips the pair
            return
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        # x is read as a [BLOCK_N, BLOCK_K] tile of equal rows: the weights' layout, so no shuffle (and no
        # barrier) between the loads, which can then all be in flight at once.
        x_ptrs = x_ptr + (pair // top_k).to(tl.int64) * stride_xm + offs_n[:, None] * 0 + offs_k[None, :]
        gate_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
        mask = offs_n[:, None] < N
        acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if FP8:
            gate_s_ptrs = s_ptr + expert.to(tl.int64) * stride_se + (offs_n // scale_rows) * stride_sn
            up_s_ptrs = s_ptr + expert.to(tl.int64) * stride_se + ((N + offs_n) // scale_rows) * stride_sn
        for k in tl.static_range(0, K, BLOCK_K):
            if not EVEN_K:
                mask = (offs_n[:, None] < N) & (offs_k[None, :] < K - k)
            x = tl.load(x_ptrs + k, mask=mask, other=0.0).to(tl.float32)
            gate_w = tl.load(gate_ptrs + k, mask=mask, other=0.0).to(tl.float32)
            up_w = tl.load(gate_ptrs + N * stride_wn + k, mask=mask, other=0.0).to(tl.float32)
            if FP8:
                gate_w *= tl.load(gate_s_ptrs + k // BLOCK_K * stride_sk, mask=offs_n < N, other=0.0)[:, None]
                up_w *= tl.load(up_s_ptrs + k // BLOCK_K * stride_sk, mask=offs_n < N, other=0.0)[:, None]
            acc_gate += gate_w * x
            acc_up += up_w * x
        out_ty = act_ptr.dtype.element_ty
        gate = tl.sum(acc_gate, axis=1).to(out_ty).to(tl.float32)
        up = tl.sum(acc_up, axis=1).to(out_ty).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32)
        tl.store(act_ptr + pair.to(tl.int64) * stride_am + offs_n, (act * up).to(out_ty), mask=offs_n < N)

    @triton.jit
    def _gemv_down_kernel(
        act_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr, num_experts, stride_am, stride_we, stride_wn, stride_om,
        s_ptr, scale_rows, stride_se, stride_sn, stride_sk,
        N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FP8: tl.constexpr,
    ):
        """out[token, n] = sum over its k pairs of weight * (down[e] . act[pair]); grid (tokens, N / BLOCK_N).
        The k experts' tiles are one [BLOCK_S, BLOCK_N, BLOCK_K] load each step, all in flight together; a pair
        of another rank's expert loads nothing (masked) and adds zero. FP8: as the gated kernel (W8A16)."""
        token = tl.program_id(0)
        slots = tl.arange(0, BLOCK_S)
        pairs = token * TOP_K + slots
        expert = tl.load(ids_ptr + pairs, mask=slots < TOP_K, other=num_experts)
        local = expert < num_experts
        weight = tl.load(weights_ptr + pairs, mask=local, other=0.0).to(tl.float32)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = (w_ptr + tl.where(local, expert, 0).to(tl.int64)[:, None, None] * stride_we
                  + offs_n[None, :, None] * stride_wn + offs_k[None, None, :])
        a_ptrs = act_ptr + pairs.to(tl.int64)[:, None, None] * stride_am + offs_n[None, :, None] * 0 + offs_k[None, None, :]
        mask = local[:, None, None] & (offs_n[None, :, None] < N)
        acc = tl.zeros((BLOCK_S, BLOCK_N, BLOCK_K), dtype=tl.float32)
        if FP8:
            s_ptrs = (s_ptr + tl.where(local, expert, 0).to(tl.int64)[:, None] * stride_se
                      + (offs_n // scale_rows)[None, :] * stride_sn)
            s_mask = local[:, None] & (offs_n[None, :] < N)
        for k in tl.static_range(0, K, BLOCK_K):
            if not EVEN_K:
                mask = local[:, None, None] & (offs_n[None, :, None] < N) & (offs_k[None, None, :] < K - k)
            a = tl.load(a_ptrs + k, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs + k, mask=mask, other=0.0).to(tl.float32)
            if FP8:
                w *= tl.load(s_ptrs + k // BLOCK_K * stride_sk, mask=s_mask, other=0.0)[:, :, None]
            acc += w * a
        out_ty = out_ptr.dtype.element_ty
        # Rounded where the tiled path rounds: each expert's output, then times its routing weight.
        y = tl.sum(acc, axis=2).to(out_ty).to(tl.float32)
        out = tl.sum((y * weight[:, None]).to(out_ty).to(tl.float32), axis=0)
        tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n, out.to(out_ty), mask=offs_n < N)

    @triton.jit
    def _k_sum_kernel(ys_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
        """out[token] = the sum of its TOP_K rows ys[token * TOP_K + j], in float32; grid (tokens, H / BLOCK_H)."""
        token = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        slots = tl.arange(0, BLOCK_S)
        mask = (slots[:, None] < TOP_K) & (offs[None, :] < H)
        y = tl.load(ys_ptr + (token * TOP_K + slots)[:, None] * H + offs[None, :], mask=mask, other=0.0)
        total = tl.sum(y.to(tl.float32), axis=0)
        tl.store(out_ptr + token * H + offs, total.to(out_ptr.dtype.element_ty), mask=offs < H)


K_SUM_BLOCK_H = 1024


def k_sum(ys: torch.Tensor, top_k: int) -> torch.Tensor:
    """ys [tokens * top_k, H] (a token's k expert outputs in consecutive rows, contiguous) -> [tokens, H]: each
    token's k rows summed in float32 and rounded once (torch's sum over dim 1 rounds the same; this reads them at
    full bandwidth)."""
    pairs, hidden = ys.shape
    out = ys.new_empty(pairs // top_k, hidden)
    if not ys.is_cuda or triton is None or pairs == 0:
        return torch.sum(ys.view(-1, top_k, hidden), dim=1, out=out)
    block_h = min(K_SUM_BLOCK_H, triton.next_power_of_2(hidden))
    _k_sum_kernel[(pairs // top_k, triton.cdiv(hidden, block_h))](
        ys, out, hidden, TOP_K=top_k, BLOCK_S=triton.next_power_of_2(top_k), BLOCK_H=block_h, num_warps=4,
    )
    return out


TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}  # names in triton.language


def _gemm(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None, sorted_ids: torch.Tensor,
    block_expert: torch.Tensor, row_div: int, gated: bool, cfg: TileConfig, fp8: Fp8Operands | None = None,
) -> None:
    """out[pair] = a[pair // row_div] @ b[expert(pair)].T (gated: silu(gate) * up; weights: times weight[pair]).
    fp8: a and b are e4m3 with the scales it holds (gated: out is e4m3 too, its scales into fp8.out_scale)."""
    num_experts, rows, k = b.shape
    n = rows // 2 if gated else rows
    num_blocks = block_expert.numel()
    if fp8 is not None and (cfg.block_k != FP8_BLOCK_K or (gated and cfg.block_n != 128)):
        raise ValueError(f"fp8 expert GEMM tiles {cfg}: BLOCK_K must be 128 (and BLOCK_N 128 for the gated GEMM)")
    if fp8 is None:  # the scale pointers are dead code in the bf16 kernel
        scale_args = (out, out, out, 1, 0, 0, 0, 0, 0)
    else:
        out_scale = fp8.out_scale if gated else out  # the down GEMM writes no scales
        scale_args = (fp8.a_scale, fp8.b_scale, out_scale, fp8.scale_rows, fp8.a_scale.stride(0), *fp8.b_scale.stride(),
                      out_scale.stride(0))
    _moe_gemm_kernel[(num_blocks * triton.cdiv(n, cfg.block_n),)](
        a, b, weight_descriptor(b, cfg) if cfg.tma else b, out, weights if weights is not None else out,
        sorted_ids, block_expert, out.shape[0], num_blocks, num_experts, n, k, row_div,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        *scale_args,
        GATED=gated, MUL_WEIGHT=weights is not None, EVEN_K=k % cfg.block_k == 0, USE_TMA=bool(cfg.tma),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        OUT_TY=getattr(tl, TL_DTYPES[fp8.dtype if fp8 else out.dtype]), FP8=fp8 is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


@dataclass(frozen=True)
class Fp8Operands:
    """What an fp8 expert GEMM needs beside its operands: the activations' scales [rows of a, K / 128], the
    experts' block scales [E, rows / scale_rows, K / 128], the gated GEMM's output scales [pairs, N / 128], and
    the dtype the epilogue rounds to (x's)."""

    a_scale: torch.Tensor
    b_scale: torch.Tensor
    scale_rows: int
    dtype: torch.dtype
    out_scale: torch.Tensor | None = None


def weight_descriptor(b: torch.Tensor, cfg: TileConfig):
    """A TMA descriptor of expert weights [E, rows, K] (contiguous) viewed as [E * rows, K], tiles [BLOCK_N, BLOCK_K].
    Built per call (a few microseconds of Python beside a GEMM of a thousand tokens or more); a cache would keep
    the weights of a discarded model alive."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not b.is_contiguous():
        raise ValueError("TMA weight tiles need contiguous expert weights")
    return TensorDescriptor.from_tensor(b.view(-1, b.shape[2]), [cfg.block_n, cfg.block_k])


def _check_layout(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
    if x.stride(1) != 1 or gate_up_proj.stride(2) != 1 or down_proj.stride(2) != 1:
        raise ValueError("fused_experts needs row-major activations and expert weights")


@dataclass(frozen=True)
class ExpertScales:
    """FP8 experts' block scales: gate_up [E, ceil(2I/bn), ceil(H/128)], down [E, ceil(H/bn), ceil(I/128)] float32."""

    gate_up: torch.Tensor
    down: torch.Tensor
    block: BlockShape


def _expert_scales(
    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, gate_up_scale: torch.Tensor | None,
    down_scale: torch.Tensor | None, block: BlockShape | None,
) -> ExpertScales | None:
    """The fp8 operands checked against each other (None: bf16 experts); a mismatch names the tensor."""
    given = (gate_up_scale is not None, down_scale is not None, block is not None)
    if not any(given):
        return None
    if not all(given):
        raise ValueError("fp8 experts need gate_up_scale, down_scale and block together")
    if block.k != FP8_BLOCK_K:
        raise ValueError(f"fp8 expert weight blocks {block.n}x{block.k}: the fused MoE needs block.k == {FP8_BLOCK_K}")
    for name, w, scale in (("gate_up_proj", gate_up_proj, gate_up_scale), ("down_proj", down_proj, down_scale)):
        if w.dtype != FP8_DTYPE:
            raise ValueError(f"{name} is {w.dtype}; with scales given it must be float8_e4m3fn")
        want = (w.shape[0], *block.grid(w.shape[1], w.shape[2]))
        if tuple(scale.shape) != want or scale.dtype != torch.float32:
            raise ValueError(f"{name} scale is {scale.dtype} {tuple(scale.shape)}; {tuple(w.shape)} in blocks of "
                             f"{block.n}x{block.k} needs float32 {want}")
    return ExpertScales(gate_up_scale, down_scale, block)


def fused_experts(
    x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    foreign: bool = False, *, gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
    block: BlockShape | None = None, aligned: Alignment | None = None, x_fp8: Fp8Rows | None = None,
) -> torch.Tensor:
    """x [T, H]; top_w/top_i [T, k]; gate_up_proj [E, 2I, H]; down_proj [E, H, I] -> [T, H]:
    sum over the k chosen experts of weight * down(silu(gate(x)) * up(x)). foreign: top_i may hold E (a pair
    served by another rank under expert parallelism): it contributes zero. With gate_up_scale, down_scale and
    block (block.k 128): the weights are float8_e4m3fn with those block scales (ExpertScales). aligned: top_i's
    pairs already aligned (route_align, in the router's launch); x_fp8: x already quantised (the norm's launch);
    the tiled path uses either where it fits."""
    _check_layout(x, gate_up_proj, down_proj)
    scales = _expert_scales(gate_up_proj, down_proj, gate_up_scale, down_scale, block)
    if top_i.shape[0] <= SMALL_BATCH_TOKENS:
        return small_batch_experts(x, top_w, top_i, gate_up_proj, down_proj, scales)
    return tiled_experts(x, top_w, top_i, gate_up_proj, down_proj, foreign, scales, aligned, x_fp8)


def gated_tiles(num_pairs: int, gate_up_proj: torch.Tensor, device_name: str | None) -> TileConfig:
    """The tiled path's gated-GEMM tiles for num_pairs pairs (its BLOCK_M is the first alignment's)."""
    num_experts, two_i, hidden = gate_up_proj.shape
    fp8 = gate_up_proj.dtype == FP8_DTYPE
    return tile_config(num_pairs, True, shape_key(num_experts, two_i // 2, hidden, True, fp8), device_name, fp8)


def small_batch_experts(
    x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """The GEMV path (any token count works; it pays off for a few tokens). Pairs with top_i >= E add zero.
    scales: fp8 weights, W8A16 (dequantised in registers; x and the gated output stay in x's dtype)."""
    tokens, k = top_i.shape
    num_experts, two_i, hidden = gate_up_proj.shape
    inter = two_i // 2
    top_i, top_w = top_i.contiguous(), top_w.contiguous()
    act = x.new_empty(tokens * k, inter)
    out = x.new_empty(tokens, hidden)
    if tokens == 0:
        return out
    fp8 = scales is not None
    # the scale arguments: pointer, rows per scale, strides (dead code in the bf16 kernels)
    gate_up_s = (scales.gate_up, scales.block.n, *scales.gate_up.stride()) if fp8 else (out, 1, 0, 0, 0)
    down_s = (scales.down, scales.block.n, *scales.down.stride()) if fp8 else (out, 1, 0, 0, 0)
    cfg = GEMV_GATED_FP8 if fp8 else GEMV_GATED
    block_k = cfg.block_k if fp8 else min(cfg.block_k, triton.next_power_of_2(hidden))
    _gemv_gated_kernel[(tokens * k, triton.cdiv(inter, cfg.block_n))](
        x, gate_up_proj, act, top_i, num_experts, k, x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1),
        act.stride(0), *gate_up_s, N=inter, K=hidden, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        EVEN_K=hidden % block_k == 0, FP8=fp8, num_warps=cfg.num_warps,
    )
    cfg = GEMV_DOWN_FP8 if fp8 else GEMV_DOWN
    block_k = cfg.block_k if fp8 else min(cfg.block_k, triton.next_power_of_2(inter))
    _gemv_down_kernel[(tokens, triton.cdiv(hidden, cfg.block_n))](
        act, down_proj, out, top_i, top_w, num_experts, act.stride(0), down_proj.stride(0), down_proj.stride(1),
        out.stride(0), *down_s, N=hidden, K=inter, TOP_K=k, BLOCK_S=triton.next_power_of_2(k), BLOCK_N=cfg.block_n,
        BLOCK_K=block_k, EVEN_K=inter % block_k == 0, FP8=fp8,
        num_warps=cfg.num_warps,
    )
    return out


def tiled_experts(
    x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    foreign: bool = False, scales: ExpertScales | None = None, aligned: Alignment | None = None,
    x_fp8: Fp8Rows | None = None,
) -> torch.Tensor:
    """The sorted-and-padded GEMM path; foreign: top_i may hold E (its blocks are skipped, its rows stay zero).
    scales: fp8 weights, W8A8: x quantised per token and group of 128 once, the gated output by the gated GEMM.
    aligned / x_fp8: as fused_experts (each used where its block_m / group is the one this path wants)."""
    tokens, k = top_i.shape
    num_experts, two_i, hidden = gate_up_proj.shape
    inter = two_i // 2
    num_pairs = tokens * k
    fp8 = scales is not None
    device = torch.cuda.get_device_name(x.device) if x.is_cuda else None
    cfg1 = gated_tiles(num_pairs, gate_up_proj, device)
    cfg2 = tile_config(num_pairs, False, shape_key(num_experts, hidden, inter, False, fp8), device, fp8)
    bins = num_experts + foreign  # the foreign bin's blocks have expert id E: the kernel skips them
    ids1, experts1 = _aligned(top_i, bins, cfg1.block_m, aligned)
    ids2, experts2 = (ids1, experts1) if cfg2.block_m == cfg1.block_m else _aligned(top_i, bins, cfg2.block_m, aligned)
    ys = (x.new_zeros if foreign else x.new_empty)(num_pairs, hidden)
    weights = top_w.reshape(-1).contiguous()
    if not fp8:
        act = x.new_empty(num_pairs, inter)
        _gemm(x, gate_up_proj, act, None, ids1, experts1, k, True, cfg1)
        _gemm(act, down_proj, ys, weights, ids2, experts2, 1, False, cfg2)
        return k_sum(ys, k)
    xq, xs = (x_fp8.q, x_fp8.scales) if x_fp8 is not None and x_fp8.group == FP8_BLOCK_K else \
        quantize_activations(x, FP8_BLOCK_K)
    act = torch.empty(num_pairs, inter, dtype=FP8_DTYPE, device=x.device)
    act_s = torch.empty(num_pairs, -(-inter // FP8_BLOCK_K), dtype=torch.float32, device=x.device)
    rows = scales.block.n
    _gemm(xq, gate_up_proj, act, None, ids1, experts1, k, True, cfg1, Fp8Operands(xs, scales.gate_up, rows, x.dtype, act_s))
    _gemm(act, down_proj, ys, weights, ids2, experts2, 1, False, cfg2, Fp8Operands(act_s, scales.down, rows, x.dtype))
    return k_sum(ys, k)


def _aligned(top_i: torch.Tensor, bins: int, block_m: int, aligned: Alignment | None) -> tuple[torch.Tensor, torch.Tensor]:
    if aligned is not None and aligned.block_m == block_m:
        return aligned.sorted_ids, aligned.block_expert
    return align_pairs(top_i, bins, block_m)
