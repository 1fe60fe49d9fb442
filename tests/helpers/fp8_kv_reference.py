"""An FP8 (e4m3fn) rounding reference that shares no code with the engine: the nearest of the 254 finite e4m3
values by brute force, ties to the one with an even mantissa, saturating at +-448; and inputs that probe it."""

from __future__ import annotations

import torch

_BYTES = torch.arange(256, dtype=torch.int32)
_FINITE = _BYTES[(_BYTES & 0x7F) != 0x7F]  # 0x7f / 0xff are NaN in e4m3fn; there is no infinity
_VALUES = _FINITE.to(torch.uint8).view(torch.float8_e4m3fn).double()


def e4m3_bytes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """uint8 e4m3fn encodings of float32 x / scale (IEEE float32 division, then rounded as described)."""
    y = (x.float() / torch.tensor(scale, dtype=torch.float32)).double().clamp(-448.0, 448.0).reshape(-1, 1)
    dist = (y - _VALUES.reshape(1, -1)).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best  # one value, or two at a tie (+0 and -0 are both candidates for small |y|)
    even = (_FINITE & 1) == 0
    pick = torch.where(candidates.sum(1, keepdim=True) > 1, candidates & even.reshape(1, -1), candidates)
    out = _FINITE[pick.to(torch.int8).argmax(dim=1)].clone()
    # a value that rounds to zero keeps the sign of y, as IEEE rounding does (-0 is 0x80)
    zero = (out & 0x7F) == 0
    out[zero] = torch.where(torch.signbit(y.reshape(-1)[zero]), 0x80, 0x00).to(out.dtype)
    return out.to(torch.uint8).reshape(x.shape)


def probe_values(seed: int = 0) -> torch.Tensor:
    """float32 values that exercise every rounding case: every finite e4m3 value, every midpoint between
    neighbours (ties), values just either side of those midpoints, beyond +-448, subnormals, signed zeros."""
    gen = torch.Generator().manual_seed(seed)
    values = _VALUES.float().unique()
    mids = (values[1:] + values[:-1]) / 2
    eps = mids.abs() * 2**-20 + 2**-30
    return torch.cat([
        values, mids, mids + eps, mids - eps,
        torch.tensor([449.0, 464.0, 479.9, 1000.0, -1e6, 0.0, -0.0, 2.0**-10, -(2.0**-10), 2.0**-11]),
        torch.randn(4096, generator=gen) * 40, torch.randn(1024, generator=gen) * 0.01,
    ])
