"""The vision tower's attention: bidirectional, within each frame, over the packed patches of a step's images
(varlen), at the tower's head_dim 72.

Six implementations, and a rule among them, chosen by EngineConfig.vision_attention:
- "sdpa": torch's scaled_dot_product_attention, one call per run of equal-size frames (cuDNN on the H200; it runs
  head_dim 72 as fast as 128, so it does 128/72 of the useful work);
- "triton": our flash-attention forward in Triton. One launch covers every frame of the call: a table lists each
  program's query tile and the frame it belongs to. head_dim 72 is split into a 64-wide part and a 16-wide tail
  (the tensor cores' k-step), so the tiles carry 80/72 of the useful work, padded in registers, never in memory.
  K and V tiles come through tensor descriptors (Hopper's bulk copies), read as [N, heads * 72] rows straight from
  the rotary's output and the fused qkv; a tail tile's columns past 72 belong to the next head and meet q's tail,
  zeroed past 72, so they add nothing, and are never stored. Softmax in float32, base 2, as FlashAttention's, each
  score scaled and shifted in one FMA. With KernelConfig.half_exp (the default) the exponentials run in f16
  (ex2.approx.f16x2), P and V are fp16 (V copied once a call into [N, heads, 80] with a column of ones past 72, so
  P @ V's tail accumulates each row's sum of P: no row sums on the CUDA cores);
- "triton_fp8": e4m3 Q, K and V with one scale per head (amax / 448 over the call's patches), the probabilities
  scaled by 256 before their e4m3 rounding (their small values keep precision), float32 softmax and accumulation.
  The same kernel through descriptors, on operands quantised into layouts they can address (a descriptor's offsets
  along a row must be 16-byte aligned, one byte an element): q and k padded to [N, heads, 96] (64 + FP8's 32-wide
  k-step), V transposed to [heads * 72, keys] with each frame from a multiple of 16 keys, so the tensor cores read
  both operands of P @ V along the keys, as Hopper's FP8 MMA requires. (Pointer loads remain, for
  KernelConfig(tma=False): 143 TFLOP/s.);
- "gluon": workers/model/vision_attention_gluon.py, the same attention with the MMAs issued beneath the softmax
  (Hopper only);
- "gluon_fp8": workers/model/vision_attention_gluon_fp8.py, the Gluon kernel on e4m3 Q, K, P and V, quantised as
  "triton_fp8"'s with V^T's ones row, each key tile's P @ V added in float32 (Hopper only; "triton_fp8" on other
  GPUs): the tower's error as bf16's, and no faster (400 against 417-423 useful TFLOP/s at 62,500 patches, run144);
- "flash_attn4": FlashAttention-4's CuTe DSL kernels (workers/model/vision_attention_fa4.py), where the optional
  flash-attn-4 package is installed, for a call whose largest frame has FA4_FROM_PATCHES or more, else "sdpa";
  named only, never chosen by "auto" (not in the GPU image; thirty-ninth pass);
- "auto": "gluon" (on sm_90; "triton" on other GPUs) for a call whose largest frame has AUTO_KERNEL_FROM_PATCHES or
  more, or (on Hopper) whose frames come in several sizes (SDPA: a call a size, then a concatenation) with
  AUTO_MIXED_FROM_PATCHES in all and a frame of AUTO_MIXED_LARGEST_FROM or more; else "sdpa" (call_kernel).

On the H200 (benchmarks/README.md, runs 79-84), 16 heads, useful TFLOP/s: "triton" 386 at 62,500 patches against
cuDNN's 331 (1.17x), 340-368 against 371-383 at 16,384, 168-263 against 250-296 at 4,096; the 235B tower on a
4,000 px image 1.37 s against 1.59 s, with the same error against transformers' float32 module. "triton_fp8" runs
320-369 at 62,500: halving the MMAs' time gains nothing while the exponentials and the softmax's other per-score
work set the pace, so FP8 does not pay here. The pace is the sum of the three, as if none overlapped: per 128 x 64
tile, ~640 cycles of MMAs, 512 of exponentials (8,192 at 16 a cycle an SM) and ~300 of other float32 work, 1,450
against the 1,464 that 374 TFLOP/s means. ex2.approx.f16x2 compiles to one MUFU.EX2.F16 per value on sm_90
(cuobjdump), so half_exp saves the row sums and conversions, not the exponentials. Going further needs the MMAs to
run under the softmax (FlashAttention-3's ping-pong of two warpgroups), which Triton 3.6's warp_specialize did not
give (run79).

On the CPU (no Triton, not interpreted) every name runs the torch reference, which is SDPA itself.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

from workers.host_copy import to_device
from workers.model.vision_attention_fa4 import attention_fa4
from workers.model.vision_attention_fa4 import require as require_fa4
from workers.model import vision_attention_gluon_fp8 as fp8_gluon
from workers.model import vision_fp8_operands as fp8_operands
from workers.model.vision_attention_gluon import (
    DEFAULT_GLUON_CONFIG, HEAD_PART, TAIL, GluonConfig, attention_gluon, supports_gluon, takes,
)
from workers.model.vision_attention_gluon_fp8 import DEFAULT_GLUON_FP8_CONFIG, GluonFp8Config

IMPLEMENTATIONS = ("auto", "sdpa", "triton", "triton_fp8", "gluon", "gluon_fp8", "flash_attn4")
# "auto": our kernel for a call whose largest frame has at least AUTO_KERNEL_FROM_PATCHES patches, or whose frames
# come in more than one size with AUTO_MIXED_FROM_PATCHES in all and one of AUTO_MIXED_LARGEST_FROM or more; cuDNN's
# for the rest. On an H100 (run156, benchmarks/README.md, the forty-fifth pass; calls queued back to back, as a tower
# pass queues them) one frame of 4,096 patches ran 354 useful TFLOP/s on cuDNN against 279 on the Gluon kernel, one
# of 16,384 389 against 418. Over a step's images of the realistic catalogue's sizes, where SDPA takes a call a size
# and a concatenation and the Gluon kernel one launch, the tower pass took 33.5 -> 32.9 ms (62, 62 and 48 patches a
# side: 9,992 patches), 62.1 -> 56.7 ms (88, 62, 48, 32: 14,916) and 179.2 -> 156.6 ms (124, 88, 62, 48, 32). Until
# then (run94, an H200: 0.71x cuDNN at 4,096, 1.02x at 16,384, single calls whose events also timed the host's
# launch work) the kernel took only calls with a frame of 24,000 patches. One frame between 4,096 and 16,384 patches
# is not measured: 12,000 is a guess at where the two cross. The smallest mix measured had 9,992 patches and a
# largest frame of 3,844; a frame of 1,024 ran 48.7 useful TFLOP/s on cuDNN against 22.7 on ours.
AUTO_KERNEL_FROM_PATCHES = 12_000
AUTO_MIXED_FROM_PATCHES = 8_192
AUTO_MIXED_LARGEST_FROM = 3_600
# "flash_attn4": FlashAttention-4 for a call whose largest frame has at least this many patches, cuDNN's below. On an
# H100 (run136) it ran 0.83x cuDNN at 4,096 patches, 1.25x at 16,384 and 1.30x at 35,344 and 62,500 (between 4,096
# and 16,384 not measured).
FA4_FROM_PATCHES = 16_384
P_SCALE = 256.0  # probabilities in [0, 1] times this before their e4m3 rounding: 2^8 more range below 1
# bf16 with lazy rescaling: a row keeps its softmax reference until its maximum grows by more than 2^8, so its
# probabilities stay below 256 (bf16 and float32 hold that with their full precision). FP8's probabilities, already
# scaled by P_SCALE up to 256, have no such room below e4m3's 448: there a row's reference moves whenever it grows.
BF16_RESCALE_GROWTH = 8.0


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration of the Triton kernels: query rows and keys per tile, warps, pipeline stages, whether
    K and V tiles come through tensor descriptors (else pointer loads), and whether Triton splits the key loop into
    warps that load and warps that compute (warp specialisation)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = True
    warp_specialize: bool = False  # the key loop's tl.range(warp_specialize=...): descriptor kernels only
    lazy_rescale: bool = False  # descriptor kernels: rescale the accumulators only on tiles where a row's max moved
    half_exp: bool = False  # bf16 descriptor kernel: exponentials two at a time in f16, P and V in fp16 (below)


# Chosen on the H200 by scripts/bench_vision_attention.py (runs 74-84 in benchmarks/README.md): the highest rate at
# 62,500 patches of the tile shapes swept (warp specialisation and lazy rescaling gained nothing, run79-80; half_exp
# 386 against 374 TFLOP/s, with P and V in fp16 a third less error against float32, run84).
DEFAULT_CONFIGS = {"triton": KernelConfig(128, 64, 4, 3, half_exp=True), "triton_fp8": KernelConfig(128, 64, 4, 3),
                   "gluon": DEFAULT_GLUON_CONFIG, "gluon_fp8": DEFAULT_GLUON_FP8_CONFIG}


def supports_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for x: Triton present and x on CUDA (or the interpreter on the CPU)."""
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def frame_bounds(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, end) of each frame in the packed patches, for runs of (patches per frame, consecutive frames)."""
    bounds, start = [], 0
    for length, count in runs:
        for _ in range(count):
            bounds.append((start, start + length))
            start += length
    return bounds


KEY_ALIGN = 16  # keys: a frame's first column in V^T (FP8, keys contiguous) is 16-byte aligned, as descriptors need


def aligned_starts(bounds: list[tuple[int, int]], align: int = KEY_ALIGN) -> tuple[list[int], int]:
    """(each frame's first column, the width) of a layout of the keys where every frame starts at a multiple of
    align."""
    starts, at = [], 0
    for start, end in bounds:
        starts.append(at)
        at += -(-(end - start) // align) * align
    return starts, at


def block_table(runs: list[tuple[int, int]], block_m: int, device: torch.device) -> torch.Tensor:
    """int32 [programs, 4]: each program's first query row, its frame's first and end rows, and the frame's first
    column in the aligned key layout (aligned_starts). Frames are listed largest first, so the longest programs
    start first and the short frames fill the tail of the launch."""
    bounds = frame_bounds(runs)
    key_starts = dict(zip(bounds, aligned_starts(bounds)[0]))
    rows = []
    for start, end in sorted(bounds, key=lambda b: b[0] - b[1]):
        rows.extend((q, start, end, key_starts[(start, end)]) for q in range(start, end, block_m))
    return to_device(torch.tensor(rows, dtype=torch.int32).reshape(-1, 4), device)


class AttentionPlan:
    """What one tower pass's 27 attention calls share: the frames, the Triton block table per block_m, and where
    each key goes in the aligned key layout."""

    def __init__(self, runs: list[tuple[int, int]]):
        self.runs = runs
        self.patches = sum(length * count for length, count in runs)
        self.largest_frame = max((length for length, _ in runs), default=0)
        self._bounds = frame_bounds(runs)
        self._key_starts, self.key_width = aligned_starts(self._bounds)  # the aligned key layout's, in columns
        self._tables: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._key_columns: dict[torch.device, torch.Tensor] = {}
        self._cu_lengths: dict[torch.device, torch.Tensor] = {}

    def table(self, block_m: int, device: torch.device) -> torch.Tensor:
        key = (block_m, device)
        if key not in self._tables:
            self._tables[key] = block_table(self.runs, block_m, device)
        return self._tables[key]

    def key_columns(self, device: torch.device) -> torch.Tensor:
        """int64 [N]: each key's column in the aligned key layout (key_width columns wide), made once a device."""
        if device not in self._key_columns:
            shifts = torch.tensor([a - s for (s, _), a in zip(self._bounds, self._key_starts)], dtype=torch.int64)
            lengths = torch.tensor([e - s for s, e in self._bounds], dtype=torch.int64)
            self._key_columns[device] = to_device(torch.arange(self.patches) + shifts.repeat_interleave(lengths), device)
        return self._key_columns[device]

    def cu_lengths(self, device: torch.device) -> torch.Tensor:
        """int32 [frames + 1]: each frame's first row, then the patches (FlashAttention's cu_seqlens)."""
        if device not in self._cu_lengths:
            starts = [start for start, _ in self._bounds] + [self.patches]
            self._cu_lengths[device] = to_device(torch.tensor(starts, dtype=torch.int32), device)
        return self._cu_lengths[device]

    def useful_flops(self, num_heads: int, head_dim: int) -> float:
        """4 * heads * head_dim * sum of frame_len^2: QK^T and PV, multiply-adds counted as two."""
        return 4.0 * num_heads * head_dim * sum(length * length * count for length, count in self.runs)


def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, scale: float,
                     impl: str = "sdpa", config: KernelConfig | GluonConfig | None = None) -> torch.Tensor:
    """q, k, v [N, heads, head_dim] (any strides with unit stride along head_dim) -> out [N, heads * head_dim] in
    q's dtype: softmax(q k^T * scale) v within each frame of the plan. "gluon" (a GluonConfig) runs on sm_90, for
    bf16 q and k at head_dim 65-79 in [N, heads * head_dim] rows; elsewhere on CUDA it takes "triton"'s kernel."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"vision attention {impl!r}: expected one of {IMPLEMENTATIONS}")
    if q.shape[0] != plan.patches:
        raise RuntimeError(f"vision attention planned for {plan.patches} patches, got {q.shape[0]}")
    impl = call_kernel(impl, plan, gluon=supports_gluon(q))
    if impl == "flash_attn4" and q.is_cuda:
        return attention_fa4(q, k, v, plan.cu_lengths(q.device), plan.largest_frame, scale)
    if impl in ("sdpa", "flash_attn4") or not supports_triton(q):
        return attention_reference(q, k, v, plan.runs, scale)
    if impl == "gluon":
        if gluon_runs(q, k, v):
            gluon_config = config or DEFAULT_CONFIGS["gluon"]
            table = plan.table(gluon_config.block_m, q.device)
            return attention_gluon(q, k, values_with_ones(v, HEAD_PART + TAIL), table, scale, gluon_config)
        impl, config = "triton", None
    if impl == "gluon_fp8":
        if gluon_fp8_runs(q):
            return attention_gluon_fp8(q, k, v, plan, scale, config or DEFAULT_CONFIGS["gluon_fp8"])
        impl, config = "triton_fp8", None
    if impl == "triton":
        return attention_triton(q, k, v, plan, scale, config or DEFAULT_CONFIGS["triton"])
    return attention_triton_fp8(q, k, v, plan, scale, config or DEFAULT_CONFIGS["triton_fp8"])


def gluon_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether "gluon" runs the Gluon kernel for these inputs (else Triton's)."""
    return supports_gluon(q) and takes(q, k, v)


def gluon_fp8_runs(q: torch.Tensor) -> bool:
    """Whether "gluon_fp8" runs the FP8 Gluon kernel for q (else Triton's FP8 kernel)."""
    return supports_gluon(q) and fp8_gluon.QK_PART < q.shape[2] < fp8_gluon.V_ROWS


def call_kernel(impl: str, plan: AttentionPlan, gluon: bool = True) -> str:
    """The implementation a call over plan's frames runs under `impl`: "auto" takes SDPA unless auto_takes_ours(plan,
    gluon), "flash_attn4" takes it for a call whose largest frame is under FA4_FROM_PATCHES. gluon: whether the Gluon
    kernel runs where the call does (Hopper)."""
    if impl == "auto":
        return large_frame_kernel(impl) if auto_takes_ours(plan, gluon) else "sdpa"
    if impl == "flash_attn4" and plan.largest_frame < FA4_FROM_PATCHES:
        return "sdpa"
    return impl


def auto_takes_ours(plan: AttentionPlan, gluon: bool = True) -> bool:
    """Whether "auto" runs our kernel over plan's frames: a frame of AUTO_KERNEL_FROM_PATCHES or more, or, where the
    Gluon kernel runs (gluon), frames of more than one run (SDPA's calls: one a run of equal frames) with
    AUTO_MIXED_FROM_PATCHES in all and one of AUTO_MIXED_LARGEST_FROM (the Triton kernel, which runs elsewhere, was
    0.94x SDPA on the smallest mix measured, run156)."""
    if plan.largest_frame >= AUTO_KERNEL_FROM_PATCHES:
        return True
    return (gluon and len(plan.runs) > 1 and plan.patches >= AUTO_MIXED_FROM_PATCHES
            and plan.largest_frame >= AUTO_MIXED_LARGEST_FROM)


def large_frame_kernel(impl: str) -> str:
    """The implementation `impl` runs where it takes our kernel (for "auto": where auto_takes_ours says so)."""
    return "gluon" if impl == "auto" else impl


def warm_up_kernel(impl: str, num_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> str:
    """Compile, on one small frame, the kernel that `impl` runs for large frames, so that the first large image does
    not pay its compile (with "auto", the Gluon kernel's took a lone 4,000 px query from 2.0 to 3.4 s, run95: the
    warm-up's images are small, and run SDPA). Returns the implementation run, "none" where nothing compiles."""
    kernel = large_frame_kernel(impl)
    if kernel == "sdpa" or device.type != "cuda":
        return "none"
    if kernel == "flash_attn4":
        require_fa4()  # before anything starts: the key and the missing package named
    elif triton is None:
        return "none"
    frame = FA4_FROM_PATCHES if kernel == "flash_attn4" else 256  # "flash_attn4" takes SDPA below its size
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(frame, num_heads, head_dim, device=device, generator=generator).to(dtype)
               for _ in range(3))
    vision_attention(q, k, v, AttentionPlan([(frame, 1)]), head_dim**-0.5, kernel)
    if kernel == "gluon" and not gluon_runs(q, k, v):
        return "triton"  # what "gluon" runs where the Gluon kernel does not
    if kernel == "gluon_fp8" and not gluon_fp8_runs(q):
        return "triton_fp8"
    return kernel


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list[tuple[int, int]],
                        scale: float) -> torch.Tensor:
    """SDPA, one call per run of equal-size frames (its [batch, heads, len, dim] view reads [N, heads, dim] memory
    through a transpose, without a copy)."""
    seq, heads, dim = q.shape
    outs, start = [], 0
    for length, count in runs:
        end = start + length * count
        qs, ks, vs = (t[start:end].view(count, length, heads, dim).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        outs.append(o.transpose(1, 2).reshape(end - start, heads * dim))
        start = end
    if start != seq:
        raise RuntimeError(f"vision attention planned for {start} patches, got {seq}")
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    if not (q.shape == k.shape == v.shape) or q.dim() != 3:
        raise ValueError(f"q, k, v must be [N, heads, head_dim] alike, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if any(t.stride(2) != 1 for t in (q, k, v)):
        raise ValueError("q, k, v need unit stride along head_dim")
    if q.shape[2] < 16:
        raise ValueError(f"the vision attention kernel needs head_dim >= 16, got {q.shape[2]}")
    return tuple(q.shape)


def head_split(dim: int, min_tail: int) -> tuple[int, int]:
    """(D0, D1): head_dim as a power-of-two part D0 (at most 64) and a tail of D1 columns (a power of two, at least
    min_tail, the tensor cores' k-step; 0 when D0 covers it all) whose columns past head_dim are masked to zero."""
    d0 = 1 << min(dim.bit_length() - 1, 6)
    tail = dim - d0
    if tail > 64:
        raise ValueError(f"the vision attention kernel takes head_dim up to 128, got {dim}")
    return d0, 0 if tail == 0 else max(min_tail, triton.next_power_of_2(tail))


def attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, scale: float,
                     config: KernelConfig = DEFAULT_CONFIGS["triton"]) -> torch.Tensor:
    """The bf16/fp16 kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1): tensor descriptors where the rows fit
    them, else pointer loads."""
    seq, heads, dim = _check(q, k, v)
    d0, d1 = head_split(dim, 16)
    out = q.new_empty(seq, heads * dim)
    if not seq:
        return out
    if config.tma and config.half_exp and dim < d0 + max(d1, 16) and _rows_fit_descriptors(q, k):
        # the ones column sits in P @ V's tail, which then runs even where head_dim has no tail of its own
        _launch_descriptors(q, k, values_with_ones(v, d0 + max(d1, 16)), out, plan, scale, config, d0, 16)
    elif config.tma and _rows_fit_descriptors(q, k, v):
        _launch_descriptors(q, k, v, out, plan, scale, config, d0, d1)
    else:
        _launch_pointers(q, k, keys_contiguous(v), out, plan, scale, None, config, d0, d1)
    return out


def quantize_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, heads, dim] -> (e4m3 [N, heads, dim], float32 scale [heads]): one scale per head, amax / 448."""
    scale = fp8_operands.head_scales(x)
    return (x.float() / scale[None, :, None]).to(torch.float8_e4m3fn), scale


def attention_triton_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, scale: float,
                         config: KernelConfig = DEFAULT_CONFIGS["triton_fp8"]) -> torch.Tensor:
    """The FP8 kernel: Q, K and V quantised per head, V in a [heads, dim, N] layout; the output in q's dtype."""
    seq, heads, dim = _check(q, k, v)
    if dim < 32:
        raise ValueError(f"the FP8 vision attention kernel needs head_dim >= 32 (FP8's k-step), got {dim}")
    d0, d1 = head_split(dim, 32)
    out = q.new_empty(seq, heads * dim)
    if not seq:
        return out
    if config.tma and d1 > 0:
        _launch_fp8_descriptors(q, k, v, out, plan, scale, config, d0, d1)
        return out
    (q8, q_scale), (k8, k_scale), (v8, v_scale) = map(quantize_per_head, (q, k, v))
    _launch_pointers(q8, k8, keys_contiguous(v8), out, plan, scale, (q_scale * k_scale, v_scale), config, d0, d1)
    return out


def keys_contiguous(v: torch.Tensor) -> torch.Tensor:
    """v [N, heads, dim] as [heads, dim, N]. The pointer kernel reads V this way: Hopper's FP8 MMA needs it, and
    Triton 3.6 on the H200 drops the masks of bf16 V tiles loaded from [N, heads, dim] rows (wrong tail columns,
    reads past the frame; run73)."""
    return v.permute(1, 2, 0).contiguous()


def _rows_fit_descriptors(*tensors: torch.Tensor) -> bool:
    """Whether each [N, heads, dim] tensor reads as 2-D rows a tensor descriptor takes: heads and dim packed; the
    base, the row stride and each head's first column 16-byte aligned (a descriptor's offsets along its contiguous
    dimension must be)."""
    return all(t.stride(1) == t.shape[2] and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               and (t.shape[2] * t.element_size()) % 16 == 0 for t in tensors)


# the largest value that bf16 and fp16 both hold (fp16's largest, 65504, rounds to 65536 in bf16, infinite in fp16)
F16_SAFE_MAX = 65280.0


def values_with_ones(v: torch.Tensor, width: int) -> torch.Tensor:
    """v [N, heads, dim] as fp16 [N, heads, width] for the half_exp kernel: v's columns (clamped to fp16's range,
    exact for bf16 values within it), then a column of ones, so that P @ V's tail accumulates each row's sum of P in
    the tensor cores' float32 (the kernel then adds no row sums of its own), then zeros. Needs width > dim. One
    Triton launch where Triton runs (values_with_ones_reference's four torch ops wrote and read a clamped copy of v
    and crossed every row twice more for the ones and the zeros; each tower block makes this once)."""
    seq, heads, dim = v.shape
    if width <= dim:
        raise ValueError(f"values_with_ones: no column for the row sums past head_dim {dim} in width {width}")
    if not supports_triton(v) or v.stride(2) != 1 or v.stride(1) != dim:
        return values_with_ones_reference(v, width)
    out = v.new_empty(seq, heads, width, dtype=torch.float16)
    rows = seq * heads
    if rows:
        block_r = 32
        _values_with_ones_kernel[(triton.cdiv(rows, block_r),)](
            v, out, rows, heads, v.stride(0), F16_SAFE_MAX,
            DIM=dim, WIDTH=width, BLOCK_R=block_r, COLS=triton.next_power_of_2(width), num_warps=4,
        )
    return out


def values_with_ones_reference(v: torch.Tensor, width: int) -> torch.Tensor:
    """values_with_ones in torch."""
    seq, heads, dim = v.shape
    out = v.new_empty(seq, heads, width, dtype=torch.float16)
    out[:, :, :dim] = v.clamp(-F16_SAFE_MAX, F16_SAFE_MAX)
    out[:, :, dim] = 1.0
    out[:, :, dim + 1:] = 0.0
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["rows"])
    def _values_with_ones_kernel(v_ptr, out_ptr, rows, heads, stride_n, safe_max, DIM: tl.constexpr,
                                 WIDTH: tl.constexpr, BLOCK_R: tl.constexpr, COLS: tl.constexpr):
        """BLOCK_R rows (token, head) of v (a token's heads DIM apart) -> their fp16 rows of WIDTH: v's DIM columns
        clamped to +-safe_max (NaN kept), a one at column DIM, zeros after; rounded once, float32 to fp16 to nearest
        even, as torch's copy rounds. DIM and WIDTH known at compile time, so that rows of 72 and 80 go in 16-byte
        pieces (a head's stride as an argument, 72 is no multiple of 16, and Triton read every element alone)."""
        row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        col = tl.arange(0, COLS)
        live = row < rows
        src = v_ptr + (row // heads)[:, None] * stride_n + (row % heads)[:, None] * DIM + col[None, :]
        x = tl.load(src, mask=live[:, None] & (col < DIM)[None, :], other=0.0).to(tl.float32)
        x = tl.clamp(x, -safe_max, safe_max, propagate_nan=tl.PropagateNan.ALL)
        x = tl.where((col == DIM)[None, :], 1.0, x)
        tl.store(out_ptr + row[:, None] * WIDTH + col[None, :], x.to(tl.float16),
                 mask=live[:, None] & (col < WIDTH)[None, :])


def _launch_descriptors(q, k, v, out, plan: AttentionPlan, scale: float, config: KernelConfig, d0: int, d1: int):
    """v: [N, heads, dim] like q, or with config.half_exp values_with_ones' fp16 [N, heads, d0 + tail]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    seq, heads, dim = q.shape
    bn, tail = config.block_n, max(d1, 16)
    v_cols = v.shape[2]

    def rows(t: torch.Tensor, block_cols: int) -> TensorDescriptor:
        return TensorDescriptor(t, [seq, heads * t.shape[2]], [t.stride(0), 1], [bn, block_cols])

    table = plan.table(config.block_m, q.device)
    _vision_attention_tma_kernel[(table.shape[0], heads)](
        q, rows(k, d0), rows(k, tail), rows(v, d0), rows(v, tail), out, table, q.stride(0), q.stride(1),
        out.stride(0), scale * math.log2(math.e), out, out,
        HEAD_DIM=dim, K_COLS=dim, V_COLS=v_cols, D0=d0, D1=tail, DV1=tail, HAS_TAIL=d1 > 0, FP8=False,
        P_SCALE=1.0,
        BLOCK_M=config.block_m, BLOCK_N=bn, WARP_SPECIALIZE=config.warp_specialize,
        LAZY_RESCALE=config.lazy_rescale, RESCALE_GROWTH=BF16_RESCALE_GROWTH,
        HALF_EXP=config.half_exp, HALF_EXP_ASM=q.is_cuda,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def quantize_for_descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                             padded_dim: int, value_rows: int | None = None):
    """e4m3 operands laid out for tensor descriptors (whose offsets along a row must be 16-byte aligned, one byte an
    element; workers/model/vision_fp8_operands.py): q and k [N, heads, padded_dim], zero past head_dim; V transposed,
    [heads * value_rows, keys] (value_rows default head_dim; more: row head_dim of each head is ones, the rest zeros),
    keys contiguous in the plan's aligned key layout (each frame from a multiple of 16, zeros between). Returns them
    with the per-head scales of q * k and of v (amax / 448 over the call)."""
    seq, heads, dim = q.shape
    value_rows = value_rows or dim
    q_scale, k_scale, v_scale = (fp8_operands.head_scales(t) for t in (q, k, v))
    q8 = fp8_operands.quantize_rows(q, q_scale, padded_dim)
    k8 = fp8_operands.quantize_rows(k, k_scale, padded_dim)
    vt = torch.zeros(heads, value_rows, plan.key_width, dtype=torch.float8_e4m3fn, device=q.device)
    if value_rows > dim:
        vt[:, dim] = 1.0  # the ones row: P @ V's sums of P (the gaps between frames meet P = 0)
    fp8_operands.quantize_transposed(v, v_scale, plan.key_columns(q.device), vt)
    return q8, k8, vt.view(heads * value_rows, plan.key_width), q_scale * k_scale, v_scale


def attention_gluon_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, scale: float,
                        config: GluonFp8Config = DEFAULT_GLUON_FP8_CONFIG) -> torch.Tensor:
    """The FP8 Gluon kernel (workers/model/vision_attention_gluon_fp8.py) on q, k, v quantised per head; bf16 out."""
    q8, k8, vt, qk_scales, v_scales = quantize_for_descriptors(q, k, v, plan, fp8_gluon.QK_COLS, fp8_gluon.V_ROWS)
    return fp8_gluon.attention_gluon_fp8(q8, k8, vt, plan.table(config.block_m, q.device), qk_scales, v_scales,
                                         q.shape[2], scale, config)


def _launch_fp8_descriptors(q, k, v, out, plan: AttentionPlan, scale: float, config: KernelConfig, d0: int, d1: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    seq, heads, dim = q.shape
    q8, k8, vt, qk_scales, v_scales = quantize_for_descriptors(q, k, v, plan, d0 + d1)
    bn, v_tail = config.block_n, 16  # P @ V's tail: 16 rows of V^T (those past head_dim are the next head's)
    k_rows = k8.view(seq, heads * (d0 + d1))
    table = plan.table(config.block_m, q.device)
    _vision_attention_tma_kernel[(table.shape[0], heads)](
        q8, TensorDescriptor(k_rows, list(k_rows.shape), [k_rows.stride(0), 1], [bn, d0]),
        TensorDescriptor(k_rows, list(k_rows.shape), [k_rows.stride(0), 1], [bn, d1]),
        TensorDescriptor(vt, list(vt.shape), [vt.stride(0), 1], [d0, bn]),
        TensorDescriptor(vt, list(vt.shape), [vt.stride(0), 1], [v_tail, bn]),
        out, table, q8.stride(0), q8.stride(1), out.stride(0), scale * math.log2(math.e), qk_scales, v_scales,
        HEAD_DIM=dim, K_COLS=d0 + d1, V_COLS=dim, D0=d0, D1=d1, DV1=v_tail, HAS_TAIL=d1 > 0, FP8=True,
        P_SCALE=P_SCALE, BLOCK_M=config.block_m, BLOCK_N=bn, WARP_SPECIALIZE=config.warp_specialize,
        LAZY_RESCALE=config.lazy_rescale, RESCALE_GROWTH=0.0, HALF_EXP=False, HALF_EXP_ASM=False,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def _launch_pointers(q, k, vt, out, plan: AttentionPlan, scale: float, fp8_scales, config: KernelConfig,
                     d0: int, d1: int):
    """fp8_scales: None, or the per-head (q * k, v) scales of e4m3 inputs."""
    heads, dim = q.shape[1], q.shape[2]
    table = plan.table(config.block_m, q.device)
    qk_scales, v_scales = fp8_scales if fp8_scales is not None else (out, out)  # unread without FP8
    _vision_attention_kernel[(table.shape[0], heads)](
        q, k, vt, out, table, q.stride(0), q.stride(1), k.stride(0), k.stride(1), vt.stride(0), vt.stride(1),
        out.stride(0), scale * math.log2(math.e), qk_scales, v_scales,
        HEAD_DIM=dim, D0=d0, D1=max(d1, 1), HAS_TAIL=d1 > 0, FP8=fp8_scales is not None, P_SCALE=P_SCALE,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages,
    )


if triton is not None:

    @triton.jit
    def _attend_tile(acc0, acc1, m_i, l_i, q0, q1, k_base, v_base, start_n, end, stride_kn, stride_vd, qk_scale,
                     offs_d0, offs_d1, d1_mask, MASK_KEYS: tl.constexpr, HAS_TAIL: tl.constexpr, FP8: tl.constexpr,
                     P_SCALE: tl.constexpr, BLOCK_N: tl.constexpr):
        """One tile of keys through pointer loads (V keys-contiguous): scores, online softmax, both P @ V parts."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        k_ptr = k_base + offs_n[None, :] * stride_kn
        if MASK_KEYS:
            k0 = tl.load(k_ptr + offs_d0[:, None], mask=n_mask[None, :], other=0.0)
        else:
            k0 = tl.load(k_ptr + offs_d0[:, None])
        s = tl.dot(q0, k0)
        if HAS_TAIL:
            k1 = tl.load(k_ptr + offs_d1[:, None], mask=n_mask[None, :] & d1_mask[:, None], other=0.0)
            s += tl.dot(q1, k1)
        s = s * qk_scale
        if MASK_KEYS:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptr = v_base + offs_n[:, None]
        if MASK_KEYS:
            v0 = tl.load(v_ptr + offs_d0[None, :] * stride_vd, mask=n_mask[:, None], other=0.0)
        else:
            v0 = tl.load(v_ptr + offs_d0[None, :] * stride_vd)
        if FP8:
            pq = (p * P_SCALE).to(v0.dtype)
        else:
            pq = p.to(v0.dtype)
        acc0 = acc0 * alpha[:, None] + tl.dot(pq, v0)
        if HAS_TAIL:
            v1 = tl.load(v_ptr + offs_d1[None, :] * stride_vd, mask=n_mask[:, None] & d1_mask[None, :], other=0.0)
            acc1 = acc1 * alpha[:, None] + tl.dot(pq, v1)
        return acc0, acc1, m_new, l_i

    @triton.jit
    def _vision_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, stride_qn, stride_qh, stride_kn, stride_kh,
                                 stride_vh, stride_vd, stride_on, qk_scale_base, qk_scale_head_ptr, v_scale_head_ptr,
                                 HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                                 HAS_TAIL: tl.constexpr, FP8: tl.constexpr, P_SCALE: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (table row, head), pointer loads: BLOCK_M query rows of one frame against all its keys."""
        row = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        q_start = tl.load(table_ptr + row * 4)
        start = tl.load(table_ptr + row * 4 + 1)
        end = tl.load(table_ptr + row * 4 + 2)
        if FP8:  # the per-head scales of q * k, and of v
            qk_scale = qk_scale_base * tl.load(qk_scale_head_ptr + head)
            v_scale = tl.load(v_scale_head_ptr + head) / P_SCALE
        else:
            qk_scale = qk_scale_base
            v_scale = 1.0
        offs_m = (q_start + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_mask = offs_m < end
        offs_d0 = tl.arange(0, D0)
        offs_d1 = D0 + tl.arange(0, D1)
        d1_mask = offs_d1 < HEAD_DIM
        q_base = q_ptr + offs_m[:, None] * stride_qn + head * stride_qh
        q0 = tl.load(q_base + offs_d0[None, :], mask=m_mask[:, None], other=0.0)
        q1 = tl.load(q_base + offs_d1[None, :], mask=m_mask[:, None] & d1_mask[None, :] & HAS_TAIL, other=0.0)
        k_base = k_ptr + head * stride_kh
        v_base = v_ptr + head * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc0 = tl.zeros([BLOCK_M, D0], tl.float32)
        acc1 = tl.zeros([BLOCK_M, D1], tl.float32)
        full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
        for start_n in range(start, full_end, BLOCK_N):
            acc0, acc1, m_i, l_i = _attend_tile(acc0, acc1, m_i, l_i, q0, q1, k_base, v_base, start_n, end,
                                                stride_kn, stride_vd, qk_scale, offs_d0, offs_d1, d1_mask, False,
                                                HAS_TAIL, FP8, P_SCALE, BLOCK_N)
        if full_end < end:
            acc0, acc1, m_i, l_i = _attend_tile(acc0, acc1, m_i, l_i, q0, q1, k_base, v_base, full_end, end,
                                                stride_kn, stride_vd, qk_scale, offs_d0, offs_d1, d1_mask, True,
                                                HAS_TAIL, FP8, P_SCALE, BLOCK_N)
        _store_rows(o_ptr, offs_m, m_mask, stride_on, head * HEAD_DIM, acc0, acc1, v_scale / l_i, offs_d0, offs_d1,
                    d1_mask, HAS_TAIL)

    @triton.jit
    def _store_rows(o_ptr, offs_m, m_mask, stride_on, col0, acc0, acc1, inv, offs_d0, offs_d1, d1_mask,
                    HAS_TAIL: tl.constexpr):
        o_base = o_ptr + offs_m[:, None] * stride_on + col0
        tl.store(o_base + offs_d0[None, :], (acc0 * inv[:, None]).to(o_ptr.dtype.element_ty), mask=m_mask[:, None])
        if HAS_TAIL:
            tl.store(o_base + offs_d1[None, :], (acc1 * inv[:, None]).to(o_ptr.dtype.element_ty),
                     mask=m_mask[:, None] & d1_mask[None, :])

    @triton.jit
    def _exp2_half(x, ASM: tl.constexpr):
        """2^x for float32 x as fp16, two values an instruction: x rounded to f16 and both exponentials in one
        ex2.approx.f16x2 (the multi-function unit's rate is per instruction, so twice the float32 rate). The
        interpreter, which runs no PTX, rounds the same way and exponentiates in float32."""
        if ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 h; cvt.rn.f16x2.f32 h, $2, $1; ex2.approx.f16x2 $0, h; }", "=r,r,r", [x],
                dtype=tl.float16, is_pure=True, pack=2)
        else:
            return tl.math.exp2(x.to(tl.float16).to(tl.float32)).to(tl.float16)

    @triton.jit
    def _attend_tile_tma(acc0, acc1, m_i, l_i, q0, q1, k0_desc, k1_desc, v0_desc, v1_desc, start_n, end, k_col0,
                         v_at, v_shift, qk_scale, HAS_TAIL: tl.constexpr, FP8: tl.constexpr, P_SCALE: tl.constexpr,
                         D0: tl.constexpr, BLOCK_N: tl.constexpr, LAZY_RESCALE: tl.constexpr,
                         RESCALE_GROWTH: tl.constexpr, HALF_EXP: tl.constexpr, HALF_EXP_ASM: tl.constexpr):
        """One tile of keys through tensor descriptors: scores, online softmax, both P @ V parts. bf16: V's tiles
        are [keys, dims] at column v_at of [N, heads * dim] rows; FP8: [dims, keys] at row v_at of V^T, read
        transposed (Hopper's FP8 MMA reads both operands along the keys), whose keys sit v_shift columns on from
        their rows (the aligned key layout)."""
        s = tl.dot(q0, k0_desc.load([start_n, k_col0]).T)
        if HAS_TAIL:
            s += tl.dot(q1, k1_desc.load([start_n, k_col0 + D0]).T)
        # keys past the frame (the next frame's, or zero-filled past the tensor), masked on the one tile that has
        # them: masking every tile cost the 4-warp kernel 6% (run76); only with 8 warps was the branch slower (run77)
        if start_n + BLOCK_N > end:
            s = tl.where((start_n + tl.arange(0, BLOCK_N) < end)[None, :], s, float("-inf"))
        # the row maximum of the raw scores, scaled once a row, so that each score's scale and shift are one FMA
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if LAZY_RESCALE:  # a row's reference moves only when its maximum grew past RESCALE_GROWTH (base 2)
            m_new = tl.where(m_new > m_i + RESCALE_GROWTH, m_new, m_i)
        if HALF_EXP:  # fp16 P; its row sums come from V's ones column, in P @ V's tail (values_with_ones)
            p = _exp2_half(s * qk_scale - m_new[:, None], HALF_EXP_ASM)
        else:
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
        if LAZY_RESCALE:
            # the accumulators are rescaled only on the tiles where some row's reference moved: after a frame's
            # first tiles almost none does (the conditional rescaling of FlashAttention-4, flash_attn/cute in
            # https://github.com/Dao-AILab/flash-attention)
            if tl.max(m_new - m_i, 0) > 0:
                alpha = tl.math.exp2(m_i - m_new)
                acc0 = acc0 * alpha[:, None]
                acc1 = acc1 * alpha[:, None]
                l_i = l_i * alpha
        else:
            alpha = tl.math.exp2(m_i - m_new)
            acc0 = acc0 * alpha[:, None]
            acc1 = acc1 * alpha[:, None]
            l_i = l_i * alpha
        if not HALF_EXP:
            l_i = l_i + tl.sum(p, 1)
        if FP8:
            v0 = v0_desc.load([v_at, start_n + v_shift]).T
            pq = (p * P_SCALE).to(v0.dtype)
        else:
            v0 = v0_desc.load([start_n, v_at])
            pq = p.to(v0.dtype)
        # FP8: each tile's P @ V added in float32 on the CUDA cores. Hopper's FP8 MMA accumulates with fewer bits
        # than float32 (DeepSeek-V3's report, arXiv:2412.19437, section 3.3.2); chained over a 62,500-key frame in
        # the MMA's accumulator it took the tower's error against float32 from 0.014 to 0.137 (run80)
        if FP8:
            acc0 = acc0 + tl.dot(pq, v0)
        else:
            acc0 = tl.dot(pq, v0, acc0)
        if HAS_TAIL:
            if FP8:
                acc1 = acc1 + tl.dot(pq, v1_desc.load([v_at + D0, start_n + v_shift]).T)
            else:
                acc1 = tl.dot(pq, v1_desc.load([start_n, v_at + D0]), acc1)
        return acc0, acc1, m_new, l_i

    @triton.jit
    def _vision_attention_tma_kernel(q_ptr, k0_desc, k1_desc, v0_desc, v1_desc, o_ptr, table_ptr, stride_qn,
                                     stride_qh, stride_on, qk_scale_base, qk_scale_head_ptr, v_scale_head_ptr,
                                     HEAD_DIM: tl.constexpr, K_COLS: tl.constexpr, V_COLS: tl.constexpr,
                                     D0: tl.constexpr, D1: tl.constexpr, DV1: tl.constexpr, HAS_TAIL: tl.constexpr,
                                     FP8: tl.constexpr, P_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
                                     BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                                     LAZY_RESCALE: tl.constexpr, RESCALE_GROWTH: tl.constexpr,
                                     HALF_EXP: tl.constexpr, HALF_EXP_ASM: tl.constexpr):
        """Program (table row, head), tensor descriptors: BLOCK_M query rows of one frame against all its keys.
        K's head h starts at column h * K_COLS of its rows, V's (bf16: [N, heads * V_COLS] rows) at h * V_COLS;
        q's and k's tails are D1 wide, V's DV1. HALF_EXP: V's column HEAD_DIM is ones, so P @ V's tail
        accumulates the row sums."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        q_start = tl.load(table_ptr + row * 4)
        start = tl.load(table_ptr + row * 4 + 1)
        end = tl.load(table_ptr + row * 4 + 2)
        if FP8:  # the per-head scales of q * k, and of v; V^T's keys in the aligned key layout
            qk_scale = qk_scale_base * tl.load(qk_scale_head_ptr + head)
            v_scale = tl.load(v_scale_head_ptr + head) / P_SCALE
            v_shift = tl.load(table_ptr + row * 4 + 3) - start
        else:
            qk_scale = qk_scale_base
            v_scale = 1.0
            v_shift = 0
        offs_m = (q_start + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_mask = offs_m < end
        offs_d0 = tl.arange(0, D0)
        offs_d1 = D0 + tl.arange(0, D1)
        q_base = q_ptr + offs_m[:, None] * stride_qn + head.to(tl.int64) * stride_qh
        q0 = tl.load(q_base + offs_d0[None, :], mask=m_mask[:, None], other=0.0)
        q1 = tl.load(q_base + offs_d1[None, :], mask=m_mask[:, None] & (offs_d1 < HEAD_DIM)[None, :] & HAS_TAIL,
                     other=0.0)
        v_at = head * V_COLS
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc0 = tl.zeros([BLOCK_M, D0], tl.float32)
        acc1 = tl.zeros([BLOCK_M, DV1], tl.float32)
        # one loop over every tile: a separate tail tile after a pipelined loop of descriptor loads read stale tiles
        # on the H200 (Triton 3.6: NaN whenever a frame was not a whole number of 64- or 128-key tiles, run75)
        for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            acc0, acc1, m_i, l_i = _attend_tile_tma(acc0, acc1, m_i, l_i, q0, q1, k0_desc, k1_desc, v0_desc,
                                                    v1_desc, start_n, end, head * K_COLS, v_at, v_shift, qk_scale,
                                                    HAS_TAIL, FP8, P_SCALE, D0, BLOCK_N, LAZY_RESCALE,
                                                    RESCALE_GROWTH, HALF_EXP, HALF_EXP_ASM)
        offs_v1 = D0 + tl.arange(0, DV1)
        if HALF_EXP:  # each row's sum of P, accumulated against V's ones column
            l_i = tl.sum(tl.where((offs_v1 == HEAD_DIM)[None, :], acc1, 0.0), 1)
        _store_rows(o_ptr, offs_m, m_mask, stride_on, (head * HEAD_DIM).to(tl.int64), acc0, acc1, v_scale / l_i,
                    offs_d0, offs_v1, offs_v1 < HEAD_DIM, HAS_TAIL)
