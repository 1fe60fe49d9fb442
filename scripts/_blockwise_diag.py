import torch, json
from workers.model import fp8, fp8_gemm
from workers.model.fp8 import BlockShape
out = {}
for n, k in ((256, 512), (256, 2048), (5120, 2048), (2048, 4096)):
    for block in (BlockShape(128, 128),):
        w, s = fp8.quantize_weight_blocks(torch.randn(n, k, device="cuda"), block)
        for m in (1, 2, 4, 8, 16, 24, 32, 64, 100, 256):
            x = torch.randn(m, k, device="cuda").bfloat16()
            xq, xs = fp8_gemm.quantize_activations(x)
            try:
                fp8_gemm.scaled_mm_blockwise(xq, xs, w, s, torch.bfloat16); torch.cuda.synchronize(); r = "ok"
            except Exception as e:
                r = type(e).__name__
            out[f"n{n}k{k}m{m}"] = r
print(json.dumps(out))
