"""Diagnostic: which FP8 GEMM paths this torch offers on this GPU, with the error where one fails, and their time
beside bf16 at the 30B-A3B shapes. Prints one JSON object."""
from __future__ import annotations
import json, sys, traceback
from pathlib import Path
import torch
import torch.nn.functional as F
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from workers.model import fp8, fp8_gemm  # noqa: E402
from workers.model.fp8 import BlockShape  # noqa: E402

def ev_us(fn, iters=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        for _ in range(iters): fn()
        b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1000 / iters)
    ts.sort(); return round(ts[len(ts)//2], 1)

def attempt(name, fn, out):
    try:
        r = fn(); out[name] = r
    except Exception as e:  # noqa: BLE001
        out[name] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}

res = {"torch": torch.__version__, "cuda": torch.version.cuda, "cublas": torch.backends.cuda.preferred_blas_library().name if hasattr(torch.backends.cuda, 'preferred_blas_library') else None}
dev = "cuda"; g = torch.Generator(device=dev).manual_seed(0)
for (n, k) in ((5120, 2048), (2048, 4096)):
    w = (torch.randn(n, k, device=dev, generator=g) * 0.02).bfloat16()
    wq, ws = fp8.quantize_weight_blocks(w, BlockShape(128, 128))
    wr = w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
    wrq = (w.float() / wr).to(torch.float8_e4m3fn)
    for m in (64, 1024, 8192):
        out = {}
        x = torch.randn(m, k, device=dev, generator=g).bfloat16()
        xq, xs = fp8_gemm.quantize_activations(x)
        xr = x.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
        xrq = (x.float() / xr).to(torch.float8_e4m3fn)
        ref = x.float() @ w.float().t()
        def err(y): return round(((y.float() - ref).norm() / ref.norm()).item(), 4)
        out["bf16_linear_us"] = ev_us(lambda: F.linear(x, w))
        out["triton_block_us"] = ev_us(lambda: fp8_gemm.w8a8_gemm(xq, xs, wq, ws, BlockShape(128, 128), torch.bfloat16))
        def rowwise(fast):
            y = torch._scaled_mm(xrq, wrq.t(), xr, wr.t(), out_dtype=torch.bfloat16, use_fast_accum=fast)
            return {"us": ev_us(lambda: torch._scaled_mm(xrq, wrq.t(), xr, wr.t(), out_dtype=torch.bfloat16, use_fast_accum=fast)), "rel_err": err(y)}
        attempt("rowwise_scaled_mm", lambda: rowwise(False), out)
        attempt("rowwise_scaled_mm_fastacc", lambda: rowwise(True), out)
        def block_new():
            fn = lambda: fp8_gemm.scaled_mm_blockwise(xq, xs, wq, ws, torch.bfloat16)
            return {"us": ev_us(fn), "rel_err": err(fn())}
        attempt("blockwise_F_scaled_mm", block_new, out)
        def block_old():
            sa, sb, _ = fp8_gemm._scaled_mm_scales(xs, ws, n, k)
            fn = lambda: torch._scaled_mm(xq, wq.t(), sa, sb, out_dtype=torch.bfloat16)
            return {"us": ev_us(fn), "rel_err": err(fn())}
        attempt("blockwise_old_scaled_mm", block_old, out)
        def block_1x128_b():
            # weight as 1x128 (per row, per 128 cols): expand the 128x128 scales to rows
            s1 = ws.repeat_interleave(128, 0)[:n].contiguous()
            fn = lambda: fp8_gemm.scaled_mm_blockwise(xq, xs, wq, s1, torch.bfloat16)
            return {"us": ev_us(fn), "rel_err": err(fn())}
        attempt("blockwise_1x128_both", block_1x128_b, out)
        res[f"dense_n{n}_k{k}_m{m}"] = out

# MoE grouped: 128 experts, gate_up 1536x2048, tokens*top8 rows sorted by expert
E, H, I = 128, 2048, 768
gu = (torch.randn(E, 2 * I, H, device=dev, generator=g) * 0.02).bfloat16()
gr = gu.float().abs().amax(2, keepdim=True) / 448.0
guq = (gu.float() / gr).to(torch.float8_e4m3fn)
for t in (256, 8192):
    out = {}
    rows = t * 8
    counts = torch.full((E,), rows // E, dtype=torch.int32, device=dev)
    offs = counts.cumsum(0).to(torch.int32)
    a = torch.randn(rows, H, device=dev, generator=g).bfloat16()
    ar = a.float().abs().amax(1, keepdim=True) / 448.0
    aq = (a.float() / ar).to(torch.float8_e4m3fn)
    attempt("bf16_grouped_mm", lambda: {"us": ev_us(lambda: torch._grouped_mm(a, gu.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16))}, out)
    attempt("fp8_scaled_grouped_mm_rowwise", lambda: {"us": ev_us(lambda: torch._scaled_grouped_mm(aq, guq.transpose(-2, -1), ar.squeeze(1), gr.squeeze(2), offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True))}, out)
    res[f"moe_gate_up_t{t}"] = out
print(json.dumps(res, indent=1))
