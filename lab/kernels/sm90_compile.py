"""Kernels compiled for sm_90 on any machine, GPU or not (the Gluon vision attention kernels, bf16 and FP8, from the
command line; the text layer's fused norm and quantisation from compile_add_norm_quant, the FP8 MoE's silu and
quantisation from compile_silu_mul_quant, the paged decode attention from compile_paged_decode, the tower's V with
its ones column from compile_values_with_ones): their registers, spills and the machine code's counts, read off the
cubin with the tools Triton ships (cuobjdump).

Triton compiles for the target it is given; only launching needs a device. A stand-in driver names sm_90 as the
current target, so `warmup` compiles the kernel for tensors of the tower's shapes on the CPU.
Usage: python -m lab.kernels.sm90_compile [--configs M:N:W:S,...] [--fp8-configs M:N:W:S[:R],...]
       [--sass-dir DIR]
(prints one JSON object)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

HEADS, HEAD_DIM, V_COLS = 16, 72, 80


@dataclass(frozen=True)
class CompiledKernel:
    registers: int
    stack_bytes: int
    spill_instructions: int  # LDL/STL in the SASS
    sass_instructions: int
    hgmma: int
    qgmma: int  # FP8 wgmma
    bar_sync: int
    sass: str


class _Sm90Target:
    """What Triton's launcher asks of the active driver before it compiles, answered for an sm_90 device."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda


def _tool(name: str) -> str:
    import triton
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.is_file():
        raise FileNotFoundError(f"{name} is not in this Triton install ({path})")
    return str(path)


def compile_attention(config) -> CompiledKernel:
    """Compile the product's Gluon kernel for sm_90 at the tower's shapes, with config's tiles: a GluonConfig (bf16)
    or a GluonFp8Config (FP8)."""
    from workers.model import vision_attention_gluon as vag
    from workers.model import vision_attention_gluon_fp8 as fp8
    if vag.gluon is None:
        raise RuntimeError("this Triton has no Gluon (triton.experimental.gluon)")
    seq = 4096
    table = torch.empty(seq // config.block_m, 4, dtype=torch.int32)
    out = torch.empty(seq, HEADS * HEAD_DIM, dtype=torch.bfloat16)
    if isinstance(config, fp8.GluonFp8Config):
        qk = torch.empty(seq, HEADS, fp8.QK_COLS, dtype=torch.float8_e4m3fn)
        vt = torch.empty(HEADS * fp8.V_ROWS, seq, dtype=torch.float8_e4m3fn)
        scales = torch.empty(HEADS)
        args, constants = fp8.kernel_args(qk, qk, vt, table, out, scales, scales, HEAD_DIM, HEAD_DIM**-0.5, config)
        return _compile(fp8._gluon_fp8_vision_attention_kernel, args, constants)
    q = torch.empty(seq, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    values = torch.empty(seq, HEADS, V_COLS, dtype=torch.float16)
    args, constants = vag.kernel_args(q, q, values, table, out, HEAD_DIM**-0.5, config)
    return _compile(vag._gluon_vision_attention_kernel, args, constants)


def compile_add_norm_quant(hidden: int = 2048, rows_too: bool = True, group: int = 128) -> CompiledKernel:
    """Compile the text layer's fused residual add + RMSNorm + FP8 quantisation (norm_quant) for sm_90, as
    add_norm_quantize launches it for rows of `hidden` columns (the 30B-A3B's 2,048)."""
    import triton

    from workers.model import norm_quant
    t = 8192
    x = torch.empty(t, hidden, dtype=torch.bfloat16)
    q = torch.empty(t, hidden, dtype=torch.float8_e4m3fn)
    scales = torch.empty(t, -(-hidden // group))
    block = triton.next_power_of_2(hidden)
    args = (x, x, x[0], x, x, q, scales, hidden, 1e-6, hidden, hidden, hidden, hidden, hidden, scales.stride(0))
    constants = dict(HAS_RESIDUAL=True, WRITE_ROWS=rows_too, GROUP=group, BLOCK=block,
                     num_warps=min(max(block // 512, 1), 8))
    return _compile(norm_quant._add_norm_quant_kernel, args, constants)


def compile_silu_mul_quant(inter: int = 768, block_r: int = 2) -> CompiledKernel:
    """Compile the FP8 MoE's silu(gate) * up and per-row quantisation (grouped_fp8_moe) for sm_90, as
    silu_mul_quantize launches it for rows of `inter` columns (the 30B-A3B's 768)."""
    import triton.language as tl

    from workers.model import grouped_fp8_moe
    rows = 8192
    h = torch.empty(rows, 2 * inter, dtype=torch.bfloat16)
    q = torch.empty(rows, inter, dtype=torch.float8_e4m3fn)
    scales = torch.empty(rows)
    wide, narrow = grouped_fp8_moe.row_pieces(inter)
    return _compile(grouped_fp8_moe._silu_mul_quant_kernel, (h, q, scales, rows, inter, h.stride(0), q.stride(0)),
                    dict(ROUND_TY=tl.bfloat16, WIDE=wide, NARROW=narrow, BLOCK_R=block_r, num_warps=4))


def compile_pair_layout(tokens: int = 8192, experts: int = 128, k: int = 8) -> CompiledKernel:
    """Compile the grouped FP8 experts' pair-layout scatter (moe_routing.pair_layout_triton's second launch) for
    sm_90, as it launches for a step of `tokens` tokens at the 30B-A3B's 128 experts and top-8."""
    import triton

    from workers.model import moe_routing
    pairs = tokens * k
    (chunk, chunks), bins = moe_routing.pair_chunks(pairs), triton.next_power_of_2(experts)
    ids, counts = torch.empty(pairs, dtype=torch.int64), torch.empty(chunks, bins, dtype=torch.int32)
    scales, offs = torch.empty(tokens), torch.empty(experts, dtype=torch.int32)
    pos, source, row_scales = torch.empty(pairs, dtype=torch.int64), torch.empty(pairs, dtype=torch.int64), torch.empty(pairs)
    return _compile(moe_routing._pair_layout_kernel,
                    (ids, counts, scales, offs, pos, source, row_scales, pairs, chunk, chunks, experts),
                    dict(TOP_K=k, SUB=moe_routing.ALIGN_SUB, BINS=bins, CHUNK_TILE=32, num_warps=8))


def compile_values_with_ones(patches: int = 16384) -> CompiledKernel:
    """Compile the tower's fp16 V with its ones column (vision_attention.values_with_ones) for sm_90, as the Gluon
    kernel's call launches it: V a view of the fused qkv projection's rows, 16 heads of 72, out rows of 80."""
    from workers.model import vision_attention as va
    qkv = torch.empty(patches, 3, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    v = qkv[:, 2]
    out = torch.empty(patches, HEADS, V_COLS, dtype=torch.float16)
    return _compile(va._values_with_ones_kernel, (v, out, patches * HEADS, HEADS, v.stride(0), va.F16_SAFE_MAX),
                    dict(DIM=HEAD_DIM, WIDTH=V_COLS, BLOCK_R=32, COLS=128, num_warps=4))


def compile_paged_decode(fp8: bool = True, tiles=None, batch: int = 256, heads: int = 32, kv_heads: int = 4,
                         head_dim: int = 128, block_size: int = 16) -> CompiledKernel:
    """Compile the text layer's paged decode attention (paged_decode) for sm_90, as decode_attention launches it
    at the 30B-A3B's shapes over an FP8 cache (bf16 q widened to float16) or a bf16 one, one split, on `tiles`
    (default: the product's)."""
    from workers.model import paged_decode as pd
    q = torch.empty(batch, heads, head_dim, dtype=torch.bfloat16)
    cache = torch.empty(4096, block_size, kv_heads, head_dim, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    tables, lens = torch.empty(batch, 64, dtype=torch.int32), torch.empty(batch, dtype=torch.int32)
    tiles = tiles or (pd.FP8_DECODE_TILES if fp8 else pd.DECODE_TILES)
    args = (q, cache, cache, q, q, q, tables, lens, 0.1, 1.0, q.stride(0), q.stride(1), q.stride(0), q.stride(1),
            *cache.stride()[:3], tables.stride(0))
    return _compile(pd._decode_kernel, args, pd.kernel_constants(q, cache, cache, tiles, splits=1))


def _compile(kernel, args: tuple, constants: dict) -> CompiledKernel:
    from triton.runtime.driver import driver

    previous = driver._active  # None until something asked for a driver (none can be made without a GPU)
    driver.set_active(_Sm90Target())
    try:
        compiled = kernel.warmup(*args, grid=(1,), **constants)
    finally:
        driver._active = previous
    return read_cubin(compiled.asm["cubin"])


def read_cubin(cubin: bytes) -> CompiledKernel:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    if not found:
        raise RuntimeError(f"cuobjdump -res-usage gave no register count: {usage[:400]}")
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    return CompiledKernel(
        registers=int(found.group(1)), stack_bytes=int(found.group(2)),
        spill_instructions=sum(op.startswith(("LDL", "STL")) for op in ops), sass_instructions=len(ops),
        hgmma=sum(op.startswith("HGMMA") for op in ops), qgmma=sum(op.startswith("QGMMA") for op in ops),
        bar_sync=sum(op.startswith("BAR.SYNC") for op in ops),
        sass=sass)


def main(argv: list[str] | None = None) -> dict:
    from lab.bench.vision_attention import gluon_fp8_name, gluon_name, parse_gluon_configs, parse_gluon_fp8_configs
    from workers.model.vision_attention_gluon import GluonConfig
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=None, help="tiles, M:N:W:S (rows, keys, warps, K/V stages) each (default: "
                   "the product's, vision_attention_gluon.DEFAULT_GLUON_CONFIG)")
    p.add_argument("--fp8-configs", default="", help="FP8 kernel's tiles, M:N:W:S[:R] (R: registers a thread at "
                   "most)")
    p.add_argument("--sass-dir", type=Path, help="write each kernel's SASS here")
    args = p.parse_args(argv)
    result = {}
    from workers.model.vision_attention_gluon import DEFAULT_GLUON_CONFIG
    configs = parse_gluon_configs(args.configs or "") if args.configs or args.fp8_configs else [DEFAULT_GLUON_CONFIG]
    for config in configs + parse_gluon_fp8_configs(args.fp8_configs):
        compiled = compile_attention(config)
        name = gluon_name(config) if isinstance(config, GluonConfig) else gluon_fp8_name(config)
        if args.sass_dir:
            args.sass_dir.mkdir(parents=True, exist_ok=True)
            (args.sass_dir / f"{name}.sass").write_text(compiled.sass)
        result[name] = {k: v for k, v in asdict(compiled).items() if k != "sass"}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
