"""An experiment beside workers/model/vision_attention_gluon.py: the tower's attention with FlashAttention-3's
ping-pong between the two warpgroups of a program (Shah et al., arXiv:2407.08608, section 3.1). Not measured yet; the
product does not call it.

Why (benchmarks/README.md, thirty-fourth pass): a 4,000 px tower's attention needs at least 0.40 s of exponentials on
the multi-function unit and 0.55 s of MMAs on the tensor cores, and the product's kernel takes ~1.12 s, about the two
added: its four warpgroups an SM (two programs of two) drift in and out of phase, so the exponentials mostly run
beside the MMAs, not beneath them. Here the two warpgroups of a program take turns on the tensor cores: each issues
its tile's scores and the previous tile's P @ V, then hands the turn to the other (an mbarrier a side) and runs its
softmax while the other's MMAs run.

    warpgroup 0:  [MMAs j] softmax j ........ [MMAs j+1] softmax j+1 ....
    warpgroup 1:  ........ [MMAs j] softmax j ........ [MMAs j+1] ........

Each warpgroup is a partition of gl.warp_specialize with 64 query rows (the product kernel's layout: head_dim 72 as a
64-wide part and a 16-wide tail, V in fp16 with a ones column whose P @ V is each row's sum of P, exponentials two at a
time). K and V tiles are shared: a ring of STAGES stages that warpgroup 0 refills through TMA once both warpgroups
have released a stage (an mbarrier of count 2 a stage), one tile behind, so that it never waits for the other's
softmax. No loader warp: a ninth warp would take the registers that let two programs share an SM.

CUDA on sm_90 only, as the product's Gluon kernel; `python -m lab.kernels.sm90_compile --kernel pingpong` compiles it
on any machine (registers, spills, the machine code's counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workers.model.vision_attention_gluon import check_shapes, descriptors, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    from workers.model.vision_attention_gluon import _load_tile, _softmax, _store_rows  # the product kernel's


@dataclass(frozen=True)
class PingPongConfig:
    """Keys a tile and K/V ring stages; a program is two warpgroups of 64 query rows (block_m 128)."""

    block_n: int = 64
    stages: int = 3
    block_m: int = 128  # the block table's rows a program (vision_attention.AttentionPlan.table)
    max_registers: int = 128  # a thread's, so that two programs of 8 warps share an SM (0: ptxas's choice, 255)


def attention_pingpong(q: torch.Tensor, k: torch.Tensor, values_ones: torch.Tensor, table: torch.Tensor, scale: float,
                       config: PingPongConfig = PingPongConfig()) -> torch.Tensor:
    """q, k bf16 [N, heads, dim]; values_ones fp16 [N, heads, 80] (vision_attention.values_with_ones); table: the
    plan's block table for block_m 128 -> out bf16 [N, heads * dim]."""
    check_shapes(q, k, values_ones[:, :, :q.shape[2]])
    seq, heads, dim = q.shape
    out = q.new_empty(seq, heads * dim)
    if not seq:
        return out
    args, constants = kernel_args(q, k, values_ones, table, out, scale, config)
    _pingpong_kernel[(table.shape[0], heads)](*args, **constants)
    return out


def kernel_args(q: torch.Tensor, k: torch.Tensor, values_ones: torch.Tensor, table: torch.Tensor, out: torch.Tensor,
                scale: float, config: PingPongConfig) -> tuple[tuple, dict]:
    """The kernel's arguments and compile-time constants (also what an ahead-of-time compile for sm_90 takes)."""
    if config.block_m != 128:
        raise ValueError(f"the ping-pong kernel's programs are two warpgroups of 64 rows: block_m 128, got "
                         f"{config.block_m}")
    half = config.block_m // 2
    args = (*descriptors(q, k, values_ones, half, config.block_n), out, table, out.stride(0),
            scale * math.log2(math.e))
    constants = dict(HEAD_DIM=q.shape[2], V_COLS=values_ones.shape[2], HALF=half, BLOCK_N=config.block_n,
                     STAGES=config.stages, num_warps=4, maxnreg=config.max_registers or None)
    return args, constants


if gluon is not None:

    @gluon.jit
    def _take_turn(turn, tile, ROLE: gl.constexpr):
        """Wait until the other warpgroup has issued its MMAs of the tile before (warpgroup 0's first tile: none)."""
        if ROLE == 0:
            mbarrier.wait(turn.index(0), (tile - 1) & 1, pred=tile > 0)
        else:
            mbarrier.wait(turn.index(1), tile & 1)

    @gluon.jit
    def _refill(k0_desc, k1_desc, v0_desc, v1_desc, k0_s, k1_s, v0_s, v1_s, k_ready, v_ready, k_free, v_free, tile,
                n_tiles, start, k_col, v_col, STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
        """Warpgroup 0, after its tile `tile`: K's stage of tile - 1 and V's of tile - 2 are free (both warpgroups
        released them a tile ago): load the tiles STAGES after them."""
        k_done = tile - 1
        k_next = k_done + STAGES
        k_go = (k_done >= 0) & (k_next < n_tiles)
        mbarrier.wait(k_free.index(k_done % STAGES), (k_done // STAGES) & 1, pred=k_go)
        _load_tile(k0_desc, k1_desc, k0_s, k1_s, k_ready, k_next, start, k_col, k_go, STAGES, BLOCK_N)
        v_done = tile - 2
        v_next = v_done + STAGES
        v_go = (v_done >= 0) & (v_next < n_tiles)
        mbarrier.wait(v_free.index(v_done % STAGES), (v_done // STAGES) & 1, pred=v_go)
        _load_tile(v0_desc, v1_desc, v0_s, v1_s, v_ready, v_next, start, v_col, v_go, STAGES, BLOCK_N)

    @gluon.jit
    def _warpgroup(ROLE: gl.constexpr, q0_s, q1_s, k0_s, k1_s, v0_s, v1_s, q_bars, k_ready, v_ready, k_free, v_free,
                   turn, k0_desc, k1_desc, v0_desc, v1_desc, o_ptr, stride_on, qk_scale, q_start, start, end, n_tiles,
                   k_col, v_col, head, HEAD_DIM: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr):
        """One warpgroup's 64 query rows (ROLE 0: the program's first, 1: its second) against the frame's keys."""
        D0: gl.constexpr = 64
        D1: gl.constexpr = 16
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o0_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, D0, 16])
        o1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, D1, 16])
        q1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        p0_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o0_layout, k_width=2)
        p1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o1_layout, k_width=2)
        tail_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[16, 2],
                                                     warps_per_cta=[4, 1], order=[1, 0])

        # q's tail past head_dim holds the next head's columns: zeroed once, in registers (the scores' A operand)
        mbarrier.wait(q_bars.index(ROLE), 0)
        q0 = q0_s.index(ROLE)
        q1 = q1_s.index(ROLE).load(tail_layout)
        tail_cols = gl.arange(0, D1, layout=gl.SliceLayout(0, tail_layout))
        q1 = gl.where(gl.expand_dims(tail_cols < HEAD_DIM - D0, 0), q1, gl.zeros_like(q1))
        q1 = gl.convert_layout(q1, q1_layout)

        zero_s = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
        acc0 = gl.zeros([HALF, D0], gl.float32, o0_layout)
        acc1 = gl.zeros([HALF, D1], gl.float32, o1_layout)
        m_i = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))

        # tile 0: its scores only
        _take_turn(turn, 0, ROLE)
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q0, k0_s.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma(q1, k1_s.index(0).permute((1, 0)), s, is_async=True)
        mbarrier.arrive(turn.index(1 - ROLE))
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_free.index(0))
        p, m_i, alpha = _softmax(s, m_i, start, end, qk_scale, s_layout, BLOCK_N)
        for tile in range(1, n_tiles):
            stage = tile % STAGES
            prev = tile - 1
            v_stage = prev % STAGES
            _take_turn(turn, tile, ROLE)
            mbarrier.wait(k_ready.index(stage), (tile // STAGES) & 1)
            s = warpgroup_mma(q0, k0_s.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma(q1, k1_s.index(stage).permute((1, 0)), s, is_async=True)
            mbarrier.wait(v_ready.index(v_stage), (prev // STAGES) & 1)
            p0 = gl.convert_layout(p, p0_layout)
            p1 = gl.convert_layout(p, p1_layout)
            acc0 = warpgroup_mma(p0, v0_s.index(v_stage), acc0, is_async=True)
            acc1 = warpgroup_mma(p1, v1_s.index(v_stage), acc1, is_async=True)
            mbarrier.arrive(turn.index(1 - ROLE))  # the other's MMAs next, beneath this softmax
            s = warpgroup_mma_wait(2, deps=(s,))
            mbarrier.arrive(k_free.index(stage))
            p, m_i, alpha = _softmax(s, m_i, start + tile * BLOCK_N, end, qk_scale, s_layout, BLOCK_N)
            acc0, acc1, p0, p1 = warpgroup_mma_wait(0, deps=(acc0, acc1, p0, p1))
            mbarrier.arrive(v_free.index(v_stage))
            acc0 = acc0 * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o0_layout)), 1)
            acc1 = acc1 * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o1_layout)), 1)
            if ROLE == 0:
                _refill(k0_desc, k1_desc, v0_desc, v1_desc, k0_s, k1_s, v0_s, v1_s, k_ready, v_ready, k_free,
                        v_free, tile, n_tiles, start, k_col, v_col, STAGES, BLOCK_N)
        last = n_tiles - 1
        v_stage = last % STAGES
        mbarrier.wait(v_ready.index(v_stage), (last // STAGES) & 1)
        p0 = gl.convert_layout(p, p0_layout)
        p1 = gl.convert_layout(p, p1_layout)
        acc0 = warpgroup_mma(p0, v0_s.index(v_stage), acc0, is_async=True)
        acc1 = warpgroup_mma(p1, v1_s.index(v_stage), acc1, is_async=True)
        acc0, acc1, p0, p1 = warpgroup_mma_wait(0, deps=(acc0, acc1, p0, p1))

        _store_rows(acc0, acc1, o_ptr, stride_on, q_start + ROLE * HALF, end, head, HEAD_DIM, HALF, o0_layout,
                    o1_layout)

    @gluon.jit
    def _pingpong_kernel(q0_desc, q1_desc, k0_desc, k1_desc, v0_desc, v1_desc, o_ptr, table_ptr, stride_on, qk_scale,
                         HEAD_DIM: gl.constexpr, V_COLS: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
                         STAGES: gl.constexpr, num_warps: gl.constexpr):
        """Program (table row, head): 2 x HALF query rows of one frame against all its keys, a warpgroup each."""
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

        q0_s = gl.allocate_shared_memory(q0_desc.dtype, [2, HALF, D0], q0_desc.layout)
        q1_s = gl.allocate_shared_memory(q1_desc.dtype, [2, HALF, D1], q1_desc.layout)
        k0_s = gl.allocate_shared_memory(k0_desc.dtype, [STAGES, BLOCK_N, D0], k0_desc.layout)
        k1_s = gl.allocate_shared_memory(k1_desc.dtype, [STAGES, BLOCK_N, D1], k1_desc.layout)
        v0_s = gl.allocate_shared_memory(v0_desc.dtype, [STAGES, BLOCK_N, D0], v0_desc.layout)
        v1_s = gl.allocate_shared_memory(v1_desc.dtype, [STAGES, BLOCK_N, D1], v1_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_bars.index(i), count=1)
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_free.index(i), count=2)  # both warpgroups release a stage
            mbarrier.init(v_free.index(i), count=2)

        for i in gl.static_range(2):
            bar = q_bars.index(i)
            mbarrier.expect(bar, q0_desc.block_type.nbytes + q1_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q0_desc, [q_start + i * HALF, k_col], bar, q0_s.index(i))
            tma.async_copy_global_to_shared(q1_desc, [q_start + i * HALF, k_col + D0], bar, q1_s.index(i))
        for i in gl.static_range(STAGES):
            _load_tile(k0_desc, k1_desc, k0_s, k1_s, k_ready, i, start, k_col, i < n_tiles, STAGES, BLOCK_N)
            _load_tile(v0_desc, v1_desc, v0_s, v1_s, v_ready, i, start, v_col, i < n_tiles, STAGES, BLOCK_N)

        gl.warp_specialize([
            (_warpgroup, (0, q0_s, q1_s, k0_s, k1_s, v0_s, v1_s, q_bars, k_ready, v_ready, k_free, v_free, turn,
                          k0_desc, k1_desc, v0_desc, v1_desc, o_ptr, stride_on, qk_scale, q_start, start, end, n_tiles,
                          k_col, v_col, head, HEAD_DIM, HALF, BLOCK_N, STAGES)),
            (_warpgroup, (1, q0_s, q1_s, k0_s, k1_s, v0_s, v1_s, q_bars, k_ready, v_ready, k_free, v_free, turn,
                          k0_desc, k1_desc, v0_desc, v1_desc, o_ptr, stride_on, qk_scale, q_start, start, end, n_tiles,
                          k_col, v_col, head, HEAD_DIM, HALF, BLOCK_N, STAGES)),
        ], [4], [128])

        for i in gl.static_range(2):
            mbarrier.invalidate(q_bars.index(i))
            mbarrier.invalidate(turn.index(i))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(k_free.index(i))
            mbarrier.invalidate(v_free.index(i))
