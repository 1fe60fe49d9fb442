"""The vision tower's attention as a Gluon kernel for Hopper (sm_90): the tensor cores' work runs beneath the
softmax's.

Triton 3.6 waits for every MMA whose result is not another MMA's accumulator right after issuing it
(`warp_group_dot_wait {pendings = 0}` after the scores' MMA in the TTGIR of workers/model/vision_attention.py's
kernel, even with the next tile's scores asked for first: run92). So there each tile's scores MMA, its softmax and its
P @ V run one after another. Gluon (triton.experimental.gluon) issues the MMAs and their waits where the kernel says.
Here each key tile j goes:

    issue S_j = Q K_j^T                    (asynchronous)
    issue O += P_{j-1} V_{j-1}              (asynchronous)
    wait until only the P @ V groups are in flight; softmax of S_j beneath them -> P_j, the rows' new maxima
    wait for P @ V; rescale O to the new maxima; refill the freed K and V stages through TMA

which is FlashAttention-3's overlap within a warpgroup (Shah et al., arXiv:2407.08608, section 3.2, "intra-warpgroup
overlapping"), written for the tower's shapes: head_dim 72 split into a 64-wide part and a 16-wide tail (Q's tail
masked past 72 once a program, in registers), P and V in fp16 with V's column 72 all ones so that P @ V's tail
accumulates each row's sum of P (vision_attention.values_with_ones), the exponentials two at a time
(ex2.approx.f16x2), K and V tiles in a ring of STAGES buffers filled by TMA, frames of any length (the tile that
crosses a frame's end masks its keys; keys past the tensor come back as zeros).

What the machine code does (run104, benchmarks/README.md): ptxas schedules P @ V's wait (WARPGROUP.DEPBAR) at the top
of the softmax's block, so each warpgroup's exponentials run after its P @ V, not beneath it; the overlap comes from
the other three warpgroups on the SM (two programs of two). Forcing the written order (the wait behind a loop of one
pass, which ptxas does not reorder across) was slower: 343 against 435 useful TFLOP/s at 62,500 patches, tensor pipe
active 47% against 55% (ncu).

Measured and removed (benchmarks/README.md, run94-run105): the next tile's scores issued a tile ahead (more registers
than two programs an SM allow), the exponential on float32 arguments (fewer instructions, slower), the TMA loads in a
warp of their own (warp specialisation: as fast with two programs an SM, 20% slower with one), the wait kept after
the softmax (above), and 256-row tiles of 16 warps (half the L2 traffic, 344 TFLOP/s: one program an SM). run122:
FlashAttention-3's ping-pong (the two warpgroups of a program as gl.warp_specialize partitions taking turns on the
tensor cores through mbarriers; arXiv:2407.08608, section 3.1) was correct and slower, 337-393 against 439 useful
TFLOP/s at 62,500 patches on an H100 (lab/kernels/vision_attention_pingpong.py until commit 4bd8daa). run125: a
share of the exponentials as an fp16 cubic on the FMA pipes (FlashAttention-4's split, GluonConfig.poly_exp_every in
commit 6b1e7f1), one pair in 4 / 2 / all: 355 / 395 / 358 against 432 at 62,500 patches (H100). ncu had the
multi-function unit 47% busy in the default, the tensor pipe 55% and issue 60%: no unit sets the pace.

CUDA on sm_90 only: Gluon runs no interpreter, so on the CPU the tests check this kernel's host side and the GPU tests
its numbers against float32 attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # CPU-only installs, or a Triton without Gluon
    gluon = None


@dataclass(frozen=True)
class GluonConfig:
    """Query rows and keys a tile, warps (4: one warpgroup; 8: two, each with half the rows), K/V ring stages."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    stages: int = 2


# run94 (benchmarks/README.md): 423 useful TFLOP/s at 62,500 patches with 8 warps, 406.7 with 4; 127 registers a
# thread, so two 256-thread programs share an SM
DEFAULT_GLUON_CONFIG = GluonConfig(128, 64, 8, 2)
HEAD_PART, TAIL = 64, 16  # head_dim as a 64-wide part (128-byte rows) and a 16-wide tail (the MMA's k-step)


def supports_gluon(x: torch.Tensor) -> bool:
    """Whether the Gluon kernel runs for x: Gluon present, x on a CUDA device of compute capability 9.x."""
    return gluon is not None and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    """q, k, v [N, heads, head_dim] alike, bf16, head_dim in (64, 80) (the tail holds the ones column), q and k
    rows a tensor descriptor can address."""
    if not (q.shape == k.shape == v.shape) or q.dim() != 3:
        raise ValueError(f"q, k, v must be [N, heads, head_dim] alike, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    seq, heads, dim = q.shape
    if not HEAD_PART < dim < HEAD_PART + TAIL:
        raise ValueError(f"the Gluon vision attention takes head_dim between {HEAD_PART + 1} and "
                         f"{HEAD_PART + TAIL - 1}, got {dim}")
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        raise ValueError(f"the Gluon vision attention takes bf16 q and k, got {q.dtype}, {k.dtype}")
    for name, t in (("q", q), ("k", k)):
        if t.stride(2) != 1 or t.stride(1) != dim or (t.stride(0) * 2) % 16 or t.data_ptr() % 16:
            raise ValueError(f"{name}: the Gluon vision attention needs [N, heads * head_dim] rows, 16-byte aligned "
                             f"(strides {tuple(t.stride())})")
    return seq, heads, dim


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether check_shapes accepts q, k, v (else the caller runs another kernel)."""
    try:
        check_shapes(q, k, v)
    except ValueError:
        return False
    return True


def attention_gluon(q: torch.Tensor, k: torch.Tensor, values_ones: torch.Tensor, table: torch.Tensor, scale: float,
                    config: GluonConfig = DEFAULT_GLUON_CONFIG) -> torch.Tensor:
    """q, k bf16 [N, heads, dim]; values_ones fp16 [N, heads, 80] (vision_attention.values_with_ones); table: the
    plan's block table for config.block_m -> out bf16 [N, heads * dim]."""
    seq, heads, dim = q.shape
    out = q.new_empty(seq, heads * dim)
    if not seq:
        return out
    args, constants = kernel_args(q, k, values_ones, table, out, scale, config)
    _gluon_vision_attention_kernel[(table.shape[0], heads)](*args, **constants)
    return out


def descriptors(q: torch.Tensor, k: torch.Tensor, values_ones: torch.Tensor, q_rows: int, key_rows: int) -> tuple:
    """TMA descriptors of q's, k's and values_ones' [N, heads * width] rows, each as its 64-wide part and 16-wide
    tail: q_rows rows a block of q, key_rows of k and values_ones."""
    seq, heads = q.shape[:2]

    def rows(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
        dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
        layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
        return TensorDescriptor(t, [seq, heads * t.shape[2]], [t.stride(0), 1], block, layout)

    return (rows(q, [q_rows, HEAD_PART]), rows(q, [q_rows, TAIL]), rows(k, [key_rows, HEAD_PART]),
            rows(k, [key_rows, TAIL]), rows(values_ones, [key_rows, HEAD_PART]), rows(values_ones, [key_rows, TAIL]))


def kernel_args(q: torch.Tensor, k: torch.Tensor, values_ones: torch.Tensor, table: torch.Tensor, out: torch.Tensor,
                scale: float, config: GluonConfig) -> tuple[tuple, dict]:
    """The kernel's arguments and compile-time constants for attention_gluon's tensors (also what an ahead-of-time
    compile for sm_90 takes: tensors of these shapes on any device)."""
    args = (*descriptors(q, k, values_ones, config.block_m, config.block_n), out, table, out.stride(0),
            scale * math.log2(math.e))
    constants = dict(HEAD_DIM=q.shape[2], V_COLS=values_ones.shape[2], BLOCK_M=config.block_m,
                     BLOCK_N=config.block_n, STAGES=config.stages, num_warps=config.num_warps)
    return args, constants


if gluon is not None:

    @gluon.jit
    def _exp2_f16(x):
        """2^x for float32 x as fp16, two values an instruction (x rounded to f16 first)."""
        return gl.inline_asm_elementwise("{ .reg .b32 h; cvt.rn.f16x2.f32 h, $2, $1; ex2.approx.f16x2 $0, h; }",
                                         "=r,r,r", [x], dtype=gl.float16, is_pure=True, pack=2)

    @gluon.jit
    def _init_barriers(STAGES: gl.constexpr):
        """The Q tile's barrier and the K and V rings' (one a stage), in shared memory, initialised."""
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)
        return q_bar, k_bars, v_bars

    @gluon.jit
    def _invalidate_barriers(q_bar, k_bars, v_bars, STAGES: gl.constexpr):
        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))

    @gluon.jit
    def _load_queries(part_desc, tail_desc, part_s, tail_s, bar, row, col):
        """The program's query rows (their 64-wide part and tail) into shared memory, through TMA."""
        mbarrier.expect(bar, part_desc.block_type.nbytes + tail_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(part_desc, [row, col], bar, part_s)
        tma.async_copy_global_to_shared(tail_desc, [row, col + 64], bar, tail_s)

    @gluon.jit
    def _load_stage(part_desc, tail_desc, part_s, tail_s, bars, tile, part_at, tail_at, pred, STAGES: gl.constexpr):
        """A tile's part and tail, from part_at and tail_at, into its ring stage through TMA, on the stage's barrier."""
        stage = tile % STAGES
        bar = bars.index(stage)
        mbarrier.expect(bar, part_desc.block_type.nbytes + tail_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(part_desc, part_at, bar, part_s.index(stage), pred=pred)
        tma.async_copy_global_to_shared(tail_desc, tail_at, bar, tail_s.index(stage), pred=pred)

    @gluon.jit
    def _load_tile(part_desc, tail_desc, part_s, tail_s, bars, tile, start, col, pred, STAGES: gl.constexpr,
                   BLOCK_N: gl.constexpr):
        """One key tile of K or V (its 64-wide part and 16-wide tail) into its ring stage, through TMA."""
        row = start + tile * BLOCK_N
        _load_stage(part_desc, tail_desc, part_s, tail_s, bars, tile, [row, col], [row, col + 64], pred, STAGES)

    @gluon.jit
    def _issue_scores(q0_s, q1, k0_s, k1_s, k_bars, tile, zero_s, STAGES: gl.constexpr):
        stage = tile % STAGES
        mbarrier.wait(k_bars.index(stage), (tile // STAGES) & 1)
        s = warpgroup_mma(q0_s, k0_s.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        return warpgroup_mma(q1, k1_s.index(stage).permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _issue_values(p, acc0, acc1, v0_s, v1_s, v_bars, tile, p0_layout: gl.constexpr, p1_layout: gl.constexpr,
                      STAGES: gl.constexpr):
        """Issue P @ V of key tile `tile` into the accumulators (asynchronous), once its V stage has landed; returns
        the accumulators and the two P operands, which stay read until the MMAs are waited for."""
        stage = tile % STAGES
        mbarrier.wait(v_bars.index(stage), (tile // STAGES) & 1)
        p0 = gl.convert_layout(p, p0_layout)
        p1 = gl.convert_layout(p, p1_layout)
        acc0 = warpgroup_mma(p0, v0_s.index(stage), acc0, is_async=True)
        acc1 = warpgroup_mma(p1, v1_s.index(stage), acc1, is_async=True)
        return acc0, acc1, p0, p1

    @gluon.jit
    def _softmax(s, m_i, tile_start, end, qk_scale, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                 LOG2_SCALE: gl.constexpr = 0.0):
        """A tile's raw scores -> (fp16 P times 2^LOG2_SCALE, the rows' new maxima, the old maxima's rescale
        factors)."""
        if tile_start + BLOCK_N > end:  # the tile that crosses the frame's end: its keys past it are masked
            cols = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(gl.expand_dims(cols < end, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = _exp2_f16(s * qk_scale - gl.expand_dims(m_new - LOG2_SCALE, 1))
        return p, m_new, gl.exp2(m_i - m_new)

    @gluon.jit
    def _gluon_vision_attention_kernel(q0_desc, q1_desc, k0_desc, k1_desc, v0_desc, v1_desc, o_ptr, table_ptr,
                                       stride_on, qk_scale, HEAD_DIM: gl.constexpr, V_COLS: gl.constexpr,
                                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                       num_warps: gl.constexpr):
        """Program (table row, head): BLOCK_M query rows of one frame against all its keys."""
        D0: gl.constexpr = 64
        D1: gl.constexpr = 16
        row = gl.program_id(0)
        head = gl.program_id(1)
        q_start = gl.load(table_ptr + row * 4)
        start = gl.load(table_ptr + row * 4 + 1)
        end = gl.load(table_ptr + row * 4 + 2)
        n_tiles = (end - start + BLOCK_N - 1) // BLOCK_N
        k_col = head * HEAD_DIM
        v_col = head * V_COLS

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o0_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, D0, 16])
        o1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, D1, 16])
        q1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        p0_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o0_layout, k_width=2)
        p1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o1_layout, k_width=2)
        tail_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[16, 2],
                                                     warps_per_cta=[num_warps, 1], order=[1, 0])

        q0_s = gl.allocate_shared_memory(q0_desc.dtype, [BLOCK_M, D0], q0_desc.layout)
        q1_s = gl.allocate_shared_memory(q1_desc.dtype, [BLOCK_M, D1], q1_desc.layout)
        k0_s = gl.allocate_shared_memory(k0_desc.dtype, [STAGES, BLOCK_N, D0], k0_desc.layout)
        k1_s = gl.allocate_shared_memory(k1_desc.dtype, [STAGES, BLOCK_N, D1], k1_desc.layout)
        v0_s = gl.allocate_shared_memory(v0_desc.dtype, [STAGES, BLOCK_N, D0], v0_desc.layout)
        v1_s = gl.allocate_shared_memory(v1_desc.dtype, [STAGES, BLOCK_N, D1], v1_desc.layout)
        q_bar, k_bars, v_bars = _init_barriers(STAGES)
        _load_queries(q0_desc, q1_desc, q0_s, q1_s, q_bar, q_start, k_col)
        for i in gl.static_range(STAGES):
            _load_tile(k0_desc, k1_desc, k0_s, k1_s, k_bars, i, start, k_col, i < n_tiles, STAGES, BLOCK_N)
            _load_tile(v0_desc, v1_desc, v0_s, v1_s, v_bars, i, start, v_col, i < n_tiles, STAGES, BLOCK_N)

        # q's tail past head_dim holds the next head's columns: zeroed once, in registers (the scores' A operand)
        mbarrier.wait(q_bar, 0)
        q1 = q1_s.load(tail_layout)
        tail_cols = gl.arange(0, D1, layout=gl.SliceLayout(0, tail_layout))
        q1 = gl.where(gl.expand_dims(tail_cols < HEAD_DIM - D0, 0), q1, gl.zeros_like(q1))
        q1 = gl.convert_layout(q1, q1_layout)

        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        acc0 = gl.zeros([BLOCK_M, D0], gl.float32, o0_layout)
        acc1 = gl.zeros([BLOCK_M, D1], gl.float32, o1_layout)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))

        s = _issue_scores(q0_s, q1, k0_s, k1_s, k_bars, 0, zero_s, STAGES)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, m_i, alpha = _softmax(s, m_i, start, end, qk_scale, s_layout, BLOCK_N)
        _load_tile(k0_desc, k1_desc, k0_s, k1_s, k_bars, STAGES, start, k_col, STAGES < n_tiles, STAGES,
                   BLOCK_N)
        for tile in range(1, n_tiles):
            s = _issue_scores(q0_s, q1, k0_s, k1_s, k_bars, tile, zero_s, STAGES)
            prev = tile - 1
            acc0, acc1, p0, p1 = _issue_values(p, acc0, acc1, v0_s, v1_s, v_bars, prev, p0_layout, p1_layout, STAGES)
            # the scores' two groups done, P @ V's two still in flight beneath this tile's softmax
            s = warpgroup_mma_wait(2, deps=(s,))
            p, m_i, alpha = _softmax(s, m_i, start + tile * BLOCK_N, end, qk_scale, s_layout, BLOCK_N)
            acc0, acc1, p0, p1 = warpgroup_mma_wait(0, deps=(acc0, acc1, p0, p1))
            acc0 = acc0 * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o0_layout)), 1)
            acc1 = acc1 * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o1_layout)), 1)
            # this tile's K stage and the previous tile's V stage are free again
            _load_tile(k0_desc, k1_desc, k0_s, k1_s, k_bars, tile + STAGES, start, k_col,
                       tile + STAGES < n_tiles, STAGES, BLOCK_N)
            _load_tile(v0_desc, v1_desc, v0_s, v1_s, v_bars, prev + STAGES, start, v_col,
                       prev + STAGES < n_tiles, STAGES, BLOCK_N)
        acc0, acc1, p0, p1 = _issue_values(p, acc0, acc1, v0_s, v1_s, v_bars, n_tiles - 1, p0_layout, p1_layout,
                                           STAGES)
        acc0, acc1, p0, p1 = warpgroup_mma_wait(0, deps=(acc0, acc1, p0, p1))
        _invalidate_barriers(q_bar, k_bars, v_bars, STAGES)

        _store_rows(acc0, acc1, o_ptr, stride_on, q_start, end, head, 1.0, HEAD_DIM, BLOCK_M, o0_layout, o1_layout)

    @gluon.jit
    def _store_rows(acc0, acc1, o_ptr, stride_on, row0, end, head, v_scale, HEAD_DIM: gl.constexpr,
                    ROWS: gl.constexpr, o0_layout: gl.constexpr, o1_layout: gl.constexpr):
        """ROWS query rows from row0 (those before the frame's end) of one head, P @ V's 64-wide part and tail
        divided by each row's sum of P, which sits in the tail's column HEAD_DIM (V's ones column), times v_scale
        (V's quantisation scale; 1.0 for bf16)."""
        D0: gl.constexpr = 64
        D1: gl.constexpr = 16
        cols1 = gl.arange(0, D1, layout=gl.SliceLayout(0, o1_layout))
        l_i = gl.sum(gl.where(gl.expand_dims(cols1 == HEAD_DIM - D0, 0), acc1, gl.zeros_like(acc1)), 1)
        rows1 = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o1_layout))
        base1 = o_ptr + gl.expand_dims(rows1.to(gl.int64) * stride_on + head * HEAD_DIM + D0, 1)
        out1 = (acc1 / gl.expand_dims(l_i, 1) * v_scale).to(gl.bfloat16)
        gl.store(base1 + gl.expand_dims(cols1, 0), out1,
                 mask=gl.expand_dims(rows1 < end, 1) & gl.expand_dims(cols1 < HEAD_DIM - D0, 0))
        cols0 = gl.arange(0, D0, layout=gl.SliceLayout(0, o0_layout))
        rows0 = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o0_layout))
        base0 = o_ptr + gl.expand_dims(rows0.to(gl.int64) * stride_on + head * HEAD_DIM, 1)
        l0 = gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o0_layout)), 1)
        out0 = (acc0 / l0 * v_scale).to(gl.bfloat16)
        gl.store(base0 + gl.expand_dims(cols0, 0), out0, mask=gl.expand_dims(rows0 < end, 1))
