"""The vision tower's attention in FP8 as a Gluon kernel for Hopper (sm_90): e4m3 Q, K, P and V on the tensor cores,
the MMAs issued asynchronously as in workers/model/vision_attention_gluon.py.

FP8 halves the MMAs' time against bf16; the exponentials stay (one a score). Where the bf16 Gluon kernel has the
tensor pipe ~55% busy and the exponentials' unit ~47% (run125, ncu), this was the lever left on one GPU. Measured
(run144-145 on an H100, benchmarks/README.md, fortieth pass), it does not pay: at 62,500 patches 400 useful TFLOP/s
against the bf16 kernel's 417-423, of which the kernel alone ~420 (the operands' quantisation takes 2.2 ms a call),
and the 4,000 px tower 1.34 s against 1.26 s, with the same error against transformers' float32 module (0.0138).
So it stays opt-in, `engine.vision_attention: gluon_fp8`.

The operands (workers/model/vision_attention.quantize_for_descriptors, one scale per head, amax / 448):
- q and k as [N, heads * 96] rows, zero past head_dim 72: each tile is a 64-wide part and a 32-wide tail (FP8's
  k-step), so the scores' MMA needs no masking;
- V transposed, [heads * 80, keys], keys contiguous in the plan's aligned key layout (each frame from a multiple of
  16 keys): Hopper's FP8 MMA reads both operands along the reduction, here the keys. Row 72 of each head is ones, so
  P @ V's 16-wide tail accumulates each row's sum of P, as the bf16 kernel's ones column does.

P is the softmax's numerator times 2^8 (vision_attention.P_SCALE; the row maximum shifted by 8 in the exponent, so the
scaling costs nothing) before its e4m3 rounding: e4m3 keeps 2^8 more range below 1. The sum of P comes from the same
rounded P as the numerator. P goes through shared memory: Triton 3.6 cannot keep an asynchronous MMA's 8-bit
register operand alive across its wait ("Unexpected bitwidth in WGMMAWaitGroupOp: 8").

Hopper's FP8 MMA accumulates with fewer bits than float32 (DeepSeek-V3's report, arXiv:2412.19437, section 3.3.2).
Accumulated across the frame in the MMA, the sums stop growing: relative error 1.09 against float32 at 62,500 patches
(0.154 at 16,384), though 15% faster (run144). So each key tile's P @ V goes into fresh accumulators and is added to
the running sums in float32 on the CUDA cores (64 keys an MMA chain, within DeepSeek-V3's 128 between promotions).

CUDA on sm_90 only, as the bf16 kernel: the CPU tests check the host side and lab/kernels/sm90_compile.py's build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workers.model.vision_attention_gluon import gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from workers.model.vision_attention_gluon import (
        _init_barriers, _invalidate_barriers, _issue_scores, _load_queries, _load_stage, _load_tile, _softmax,
        _store_rows,
    )

QK_PART, QK_TAIL = 64, 32  # q's and k's columns: a 64-wide part and FP8's 32-wide k-step (72 padded to 96)
V_PART, V_TAIL = 64, 16  # V^T's rows a head: 64, then 16 (8 of head_dim, the ones row, 7 zeros)
QK_COLS, V_ROWS = QK_PART + QK_TAIL, V_PART + V_TAIL


@dataclass(frozen=True)
class GluonFp8Config:
    """Query rows and keys a tile, warps (4: one warpgroup; 8: two), K/V ring stages, and a register cap a thread
    (0: ptxas's choice; 128 lets two 256-thread programs share a multiprocessor)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    stages: int = 2
    max_registers: int = 0


# Two 256-thread programs an SM, as the bf16 kernel's tiles: the float32 running sums take ptxas to 141 registers, and
# a cap of 128 costs one 8-byte spill (lab/kernels/sm90_compile.py)
DEFAULT_GLUON_FP8_CONFIG = GluonFp8Config(128, 64, 8, 2, max_registers=128)


def check_operands(q8: torch.Tensor, k8: torch.Tensor, vt: torch.Tensor, head_dim: int) -> tuple[int, int]:
    """q8, k8 e4m3 [N, heads, 96]; vt e4m3 [heads * 80, keys] -> (N, heads)."""
    if q8.shape != k8.shape or q8.dim() != 3 or q8.shape[2] != QK_COLS:
        raise ValueError(f"q8, k8 must be [N, heads, {QK_COLS}] alike, got {tuple(q8.shape)}, {tuple(k8.shape)}")
    seq, heads, _ = q8.shape
    if not QK_PART < head_dim < V_ROWS:
        raise ValueError(f"the FP8 Gluon vision attention takes head_dim between {QK_PART + 1} and {V_ROWS - 1}, "
                         f"got {head_dim}")
    if vt.dim() != 2 or vt.shape[0] != heads * V_ROWS:
        raise ValueError(f"vt must be [heads * {V_ROWS}, keys], got {tuple(vt.shape)}")
    for name, t in (("q8", q8), ("k8", k8), ("vt", vt)):
        if t.dtype != torch.float8_e4m3fn or not t.is_contiguous() or t.data_ptr() % 16 or t.stride(0) % 16:
            raise ValueError(f"{name}: the FP8 Gluon vision attention needs contiguous e4m3 rows, 16-byte aligned "
                             f"({t.dtype}, strides {tuple(t.stride())})")
    return seq, heads


def attention_gluon_fp8(q8: torch.Tensor, k8: torch.Tensor, vt: torch.Tensor, table: torch.Tensor,
                        qk_scales: torch.Tensor, v_scales: torch.Tensor, head_dim: int, scale: float,
                        config: GluonFp8Config = DEFAULT_GLUON_FP8_CONFIG) -> torch.Tensor:
    """The quantised operands (module docstring), the plan's block table for config.block_m (its fourth column:
    each frame's first key in vt), the per-head scales of q * k and of v -> out bf16 [N, heads * head_dim]."""
    seq, heads = check_operands(q8, k8, vt, head_dim)
    out = torch.empty(seq, heads * head_dim, dtype=torch.bfloat16, device=q8.device)
    if not seq:
        return out
    args, constants = kernel_args(q8, k8, vt, table, out, qk_scales, v_scales, head_dim, scale, config)
    _gluon_fp8_vision_attention_kernel[(table.shape[0], heads)](*args, **constants)
    return out


def kernel_args(q8: torch.Tensor, k8: torch.Tensor, vt: torch.Tensor, table: torch.Tensor, out: torch.Tensor,
                qk_scales: torch.Tensor, v_scales: torch.Tensor, head_dim: int, scale: float,
                config: GluonFp8Config) -> tuple[tuple, dict]:
    """The kernel's arguments and compile-time constants (also what an ahead-of-time compile for sm_90 takes)."""
    seq, heads = q8.shape[:2]

    def desc(t: torch.Tensor, shape: list[int], block: list[int]) -> TensorDescriptor:
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
        return TensorDescriptor(t, shape, [shape[1], 1], block, layout)

    rows = [seq, heads * QK_COLS]
    m, n = config.block_m, config.block_n
    args = (desc(q8, rows, [m, QK_PART]), desc(q8, rows, [m, QK_TAIL]), desc(k8, rows, [n, QK_PART]),
            desc(k8, rows, [n, QK_TAIL]), desc(vt, list(vt.shape), [V_PART, n]), desc(vt, list(vt.shape), [V_TAIL, n]),
            out, table, qk_scales, v_scales, out.stride(0), scale * math.log2(math.e))
    constants = dict(HEAD_DIM=head_dim, BLOCK_M=m, BLOCK_N=n, STAGES=config.stages, num_warps=config.num_warps)
    if config.max_registers:
        constants["maxnreg"] = config.max_registers
    return args, constants


if gluon is not None:

    @gluon.jit
    def _load_values(part_desc, tail_desc, part_s, tail_s, bars, tile, v_row, key_col, pred, STAGES: gl.constexpr,
                     BLOCK_N: gl.constexpr):
        """One key tile of V^T (its 64 rows and 16-row tail, BLOCK_N keys each) into its ring stage, through TMA."""
        col = key_col + tile * BLOCK_N
        _load_stage(part_desc, tail_desc, part_s, tail_s, bars, tile, [v_row, col], [v_row + 64, col], pred, STAGES)

    @gluon.jit
    def _stage_p(p, p_s):
        """P (fp16, rounded to e4m3 here) into shared memory, where P @ V's MMAs read it (Triton 3.6 cannot keep an
        asynchronous MMA's 8-bit register operands alive across its wait), visible to the tensor cores' proxy before
        any warp issues one."""
        p_s.store(p.to(gl.float8e4nv))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _gluon_fp8_vision_attention_kernel(q0_desc, q1_desc, k0_desc, k1_desc, v0_desc, v1_desc, o_ptr, table_ptr,
                                           qk_scales_ptr, v_scales_ptr, stride_on, qk_scale_base,
                                           HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                           STAGES: gl.constexpr, num_warps: gl.constexpr):
        """Program (table row, head): BLOCK_M query rows of one frame against all its keys."""
        D0: gl.constexpr = 64
        D1: gl.constexpr = 32
        DV1: gl.constexpr = 16
        row = gl.program_id(0)
        head = gl.program_id(1)
        q_start = gl.load(table_ptr + row * 4)
        start = gl.load(table_ptr + row * 4 + 1)
        end = gl.load(table_ptr + row * 4 + 2)
        key_col = gl.load(table_ptr + row * 4 + 3)
        n_tiles = (end - start + BLOCK_N - 1) // BLOCK_N
        qk_col = head * (D0 + D1)
        v_row = head * (D0 + DV1)
        qk_scale = qk_scale_base * gl.load(qk_scales_ptr + head)

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 32])
        o0_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, D0, 32])
        o1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, DV1, 32])

        q0_s = gl.allocate_shared_memory(q0_desc.dtype, [BLOCK_M, D0], q0_desc.layout)
        q1_s = gl.allocate_shared_memory(q1_desc.dtype, [BLOCK_M, D1], q1_desc.layout)
        k0_s = gl.allocate_shared_memory(k0_desc.dtype, [STAGES, BLOCK_N, D0], k0_desc.layout)
        k1_s = gl.allocate_shared_memory(k1_desc.dtype, [STAGES, BLOCK_N, D1], k1_desc.layout)
        v0_s = gl.allocate_shared_memory(v0_desc.dtype, [STAGES, D0, BLOCK_N], v0_desc.layout)
        v1_s = gl.allocate_shared_memory(v1_desc.dtype, [STAGES, DV1, BLOCK_N], v1_desc.layout)
        p_s = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, BLOCK_N],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float8e4nv))
        q_bar, k_bars, v_bars = _init_barriers(STAGES)
        _load_queries(q0_desc, q1_desc, q0_s, q1_s, q_bar, q_start, qk_col)
        for i in gl.static_range(STAGES):
            _load_tile(k0_desc, k1_desc, k0_s, k1_s, k_bars, i, start, qk_col, i < n_tiles, STAGES, BLOCK_N)
            _load_values(v0_desc, v1_desc, v0_s, v1_s, v_bars, i, v_row, key_col, i < n_tiles, STAGES, BLOCK_N)

        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        zero0 = gl.zeros([BLOCK_M, D0], gl.float32, o0_layout)
        zero1 = gl.zeros([BLOCK_M, DV1], gl.float32, o1_layout)
        acc0 = gl.zeros([BLOCK_M, D0], gl.float32, o0_layout)
        acc1 = gl.zeros([BLOCK_M, DV1], gl.float32, o1_layout)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))

        mbarrier.wait(q_bar, 0)
        s = _issue_scores(q0_s, q1_s, k0_s, k1_s, k_bars, 0, zero_s, STAGES)
        s = warpgroup_mma_wait(0, deps=(s,))
        # P times 2^8 (vision_attention.P_SCALE: the module docstring) before its e4m3 rounding
        p, m_i, alpha = _softmax(s, m_i, start, end, qk_scale, s_layout, BLOCK_N, 8.0)
        _stage_p(p, p_s)
        _load_tile(k0_desc, k1_desc, k0_s, k1_s, k_bars, STAGES, start, qk_col, STAGES < n_tiles, STAGES, BLOCK_N)
        for tile in range(1, n_tiles):
            s = _issue_scores(q0_s, q1_s, k0_s, k1_s, k_bars, tile, zero_s, STAGES)
            prev = tile - 1
            stage = prev % STAGES
            mbarrier.wait(v_bars.index(stage), (prev // STAGES) & 1)
            t0 = warpgroup_mma(p_s, v0_s.index(stage).permute((1, 0)), zero0, use_acc=False, is_async=True)
            t1 = warpgroup_mma(p_s, v1_s.index(stage).permute((1, 0)), zero1, use_acc=False, is_async=True)
            # both MMAs waited for before the softmax (where ptxas put P @ V's wait in any case: the bf16 kernel's
            # docstring), prev's tile added to the running sums, which hold the tiles before it in prev's
            # reference; its registers are free again for the softmax's
            s, t0, t1 = warpgroup_mma_wait(0, deps=(s, t0, t1))
            acc0 = acc0 + t0
            acc1 = acc1 + t1
            p, m_i, alpha = _softmax(s, m_i, start + tile * BLOCK_N, end, qk_scale, s_layout, BLOCK_N, 8.0)
            acc0 = acc0 * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o0_layout)), 1)
            acc1 = acc1 * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o1_layout)), 1)
            _stage_p(p, p_s)  # P @ V of prev is done with the buffer
            # this tile's K stage and the previous tile's V stage are free again
            _load_tile(k0_desc, k1_desc, k0_s, k1_s, k_bars, tile + STAGES, start, qk_col, tile + STAGES < n_tiles,
                       STAGES, BLOCK_N)
            _load_values(v0_desc, v1_desc, v0_s, v1_s, v_bars, prev + STAGES, v_row, key_col,
                         prev + STAGES < n_tiles, STAGES, BLOCK_N)
        last = n_tiles - 1
        stage = last % STAGES
        mbarrier.wait(v_bars.index(stage), (last // STAGES) & 1)
        t0 = warpgroup_mma(p_s, v0_s.index(stage).permute((1, 0)), zero0, use_acc=False, is_async=True)
        t1 = warpgroup_mma(p_s, v1_s.index(stage).permute((1, 0)), zero1, use_acc=False, is_async=True)
        t0, t1 = warpgroup_mma_wait(0, deps=(t0, t1))
        _invalidate_barriers(q_bar, k_bars, v_bars, STAGES)

        # V's scale on the numerators; P's 2^8 is in both the numerators and the ones row's sums, and cancels
        v_scale = gl.load(v_scales_ptr + head)
        _store_rows(acc0 + t0, acc1 + t1, o_ptr, stride_on, q_start, end, head, v_scale, HEAD_DIM, BLOCK_M,
                    o0_layout, o1_layout)
