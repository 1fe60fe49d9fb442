"""Kernels as ptxas builds them for sm_90, checked on any machine (lab/kernels/sm90_compile.py, with the Triton that
scripts/bootstrap.sh puts in .kernel-interpreter): the Gluon vision attention kernels' default tiles take the tensor
cores' wgmma path (bf16) or FP8 wgmma and fit the registers that let two of their 256-thread programs share a
multiprocessor (run94's choice); the text layer's fused norm and quantisation reads and writes whole 16-byte pieces;
the FP8 quantisation divides a value without div_rn's range check, the MoE's silu kernel has no idle lanes, and the
decode attention over an FP8 cache reaches its P @ V operand through 16-bit transposing loads, and the grouped
experts' pair layout builds without spilling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / ".kernel-interpreter"
REGISTERS_PER_SM = 65536


def run_with_triton(code: str) -> dict:
    """code run in a process with the Triton packages (not the interpreter); the JSON object it prints last."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(ROOT)])
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build(config_code: str, extra_code: str) -> dict:
    """compile_attention(c), c made by config_code: the build's figures and extra_code's dict (over the compiled
    kernel k and c)."""
    return run_with_triton(
        f"import json; from dataclasses import asdict; from lab.kernels.sm90_compile import compile_attention; "
        f"{config_code}; k = compile_attention(c); "
        f"print(json.dumps({{n: v for n, v in asdict(k).items() if n != 'sass'}} | {extra_code}))")


@pytest.mark.skipif(not (SITE / ".installed").is_file(), reason="no Triton packages: run scripts/bootstrap.sh")
def test_the_default_gluon_tiles_build_for_sm90_with_two_programs_an_sm_and_no_spills():
    built = build("from workers.model.vision_attention_gluon import DEFAULT_GLUON_CONFIG as c",
                  "{'threads': 32 * c.num_warps}")
    assert built["hgmma"] > 0  # wgmma, not the mma.sync path
    assert built["spill_instructions"] == 0 and built["stack_bytes"] == 0
    assert 2 * built["threads"] * built["registers"] <= REGISTERS_PER_SM, built


@pytest.mark.skipif(not (SITE / ".installed").is_file(), reason="no Triton packages: run scripts/bootstrap.sh")
def test_the_fp8_gluon_kernel_builds_for_sm90_on_fp8_tensor_cores_with_two_programs_an_sm():
    built = build("from workers.model.vision_attention_gluon_fp8 import DEFAULT_GLUON_FP8_CONFIG as c",
                  "{'threads': 32 * c.num_warps}")
    assert built["qgmma"] > 0 and built["hgmma"] == 0  # every MMA on e4m3 operands
    assert 2 * built["threads"] * built["registers"] <= REGISTERS_PER_SM, built
    assert built["stack_bytes"] <= 8, built  # the register cap's one spilled value at most


@pytest.mark.skipif(not (SITE / ".installed").is_file(), reason="no Triton packages: run scripts/bootstrap.sh")
@pytest.mark.parametrize("rows_too", [False, True])
def test_the_fused_norm_and_quantisation_reads_and_writes_its_rows_in_128_bit_accesses_on_sm90(rows_too):
    """Its column count unspecialised, Triton could not prove the row mask whole in 16-byte pieces and read every
    bf16 element alone (48 LDG.E.U16 a thread at 2,048 columns, run146's 123 us a call at 8,192 rows)."""
    built = run_with_triton(
        f"import re, json; from lab.kernels.sm90_compile import compile_add_norm_quant; "
        f"k = compile_add_norm_quant(rows_too={rows_too}); ops = re.findall(r'\\b(LDG|STG)(\\.[A-Z0-9._]*)', k.sass); "
        "print(json.dumps({'wide': sum(w.endswith('.128') for _, w in ops), "
        "'narrow': [o + w for o, w in ops if not w.endswith('.128') and w != '.E']}))")
    assert built["narrow"] == [] and built["wide"] >= 6, built  # x, the residual and the weight: two 16 B each a thread


@pytest.mark.skipif(not (SITE / ".installed").is_file(), reason="no Triton packages: run scripts/bootstrap.sh")
def test_the_fp8_quantisation_divides_a_value_without_div_rns_check_and_silu_runs_no_idle_lanes_on_sm90():
    """fp8_gemm.divide_by_row: a row's reciprocal and an FMA correction, so FCHK (div_rn's range check, one a value:
    17 in each build before) is left only in a row's own divisions. grouped_fp8_moe.row_pieces: 768 columns as
    512 + 256, 12 values a thread (one exponential each), where one masked piece of 1,024 ran 16."""
    built = run_with_triton(
        "import re, json; from lab.kernels.sm90_compile import compile_add_norm_quant, compile_silu_mul_quant; "
        "silu, norm = compile_silu_mul_quant(768), compile_add_norm_quant(); "
        "n = lambda sass, op: len(re.findall(r'\\b' + op + r'\\b', sass)); "
        "print(json.dumps({'silu_fchk': n(silu.sass, 'FCHK'), 'norm_fchk': n(norm.sass, 'FCHK'), "
        "'silu_ex2': n(silu.sass, 'MUFU.EX2')}))")
    assert built["silu_fchk"] <= 4 and built["norm_fchk"] <= 4, built
    assert built["silu_ex2"] == 12, built


@pytest.mark.skipif(not (SITE / ".installed").is_file(), reason="no Triton packages: run scripts/bootstrap.sh")
def test_the_decode_attention_over_an_fp8_cache_widens_v_before_its_operand_layout_on_sm90():
    """paged_decode's V_PAIRS: read as int16 pairs and widened in the load's layout, the V tile reaches the P @ V
    operand through ldmatrix.trans (LDSM.16.MT88.4). Widened after the layout change it was gathered a byte a load
    (128 LDS.U8 a thread a tile) and took 208 registers: two 128-thread programs an SM where three now fit."""
    built = run_with_triton(
        "import re, json; from lab.kernels.sm90_compile import compile_paged_decode; k = compile_paged_decode(); "
        "n = lambda op: len(re.findall(r'\\b' + re.escape(op) + r'\\b', k.sass)); "
        "print(json.dumps({'byte_loads': n('LDS.U8'), 'transposing_loads': n('LDSM.16.MT88.4'), "
        "'registers': k.registers, 'spills': k.spill_instructions}))")
    assert built["byte_loads"] == 0 and built["transposing_loads"] > 0, built
    assert 3 * 128 * built["registers"] <= REGISTERS_PER_SM and built["spills"] == 0, built


@pytest.mark.skipif(not (SITE / ".installed").is_file(), reason="no Triton packages: run scripts/bootstrap.sh")
def test_the_pair_layout_scatter_builds_for_sm90_without_spills_at_an_8k_step():
    """moe_routing._pair_layout_kernel at the 30B-A3B's 128 experts and top-8 (65,536 pairs a step of 8,192 tokens,
    128 programs of 512): each 64-pair piece's one-hot ranks over 128 experts stay in registers."""
    built = run_with_triton(
        "import json; from lab.kernels.sm90_compile import compile_pair_layout; k = compile_pair_layout(8192); "
        "print(json.dumps({'spills': k.spill_instructions, 'stack': k.stack_bytes}))")
    assert built["spills"] == 0 and built["stack"] == 0, built


@pytest.mark.skipif(not (SITE / ".installed").is_file(), reason="no Triton packages: run scripts/bootstrap.sh")
def test_the_towers_values_with_ones_read_and_write_whole_16_byte_pieces_on_sm90():
    """vision_attention._values_with_ones_kernel: V's 72 bf16 columns (144 bytes of a qkv row) in and 80 fp16 columns
    out, each in 16-byte pieces (head_dim and width are compile-time constants for that), without spills."""
    built = run_with_triton(
        "import re, json; from lab.kernels.sm90_compile import compile_values_with_ones; k = compile_values_with_ones(); "
        "ops = re.findall(r'\\b(LDG|STG)(\\.[A-Z0-9._]*)', k.sass); "
        "print(json.dumps({'wide': sum(w.endswith('.128') for _, w in ops), "
        "'narrow': [o + w for o, w in ops if not w.endswith('.128') and w != '.E'], 'spills': k.spill_instructions}))")
    assert built["narrow"] == [] and built["wide"] >= 2 and built["spills"] == 0, built
