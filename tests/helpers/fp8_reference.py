"""An FP8 checkpoint dequantized into the float layout transformers loads: the reference side of the FP8 tests.

transformers cannot load Qwen's per-expert FP8 MoE layout (huggingface/transformers#44230), so the MoE reference is
transformers on this dequantized copy. The dequantization is written independently of workers/model/fp8.py: each
element times the scale of the block its (row, column) falls in, by index arithmetic.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def dequantize_by_index(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w[i, j] = q[i, j] * scale[i // bn, j // bk], in float32."""
    rows, cols = weight.shape
    row_block = torch.arange(rows) // block[0]
    col_block = torch.arange(cols) // block[1]
    return weight.float() * scale.float()[row_block][:, col_block]


def read_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a one-file checkpoint (the tiny ones), by name."""
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def write_checkpoint(src_dir: Path, out_dir: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """out_dir: `config` as config.json, src_dir's generation and preprocessor configs, `tensors` in one file."""
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for side in ("generation_config.json", "preprocessor_config.json"):
        shutil.copy(src_dir / side, out_dir / side)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def dequantized_checkpoint(fp8_dir: Path, out_dir: Path) -> Path:
    """Writes out_dir: fp8_dir's weights (block or FP8-dynamic layout) dequantized to float32, per-expert tensors fused back into
    mlp.experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I], and config.json without quantization_config."""
    config = json.loads((fp8_dir / "config.json").read_text())
    q = config.pop("quantization_config")
    # the block layout names its block; the FP8-dynamic one (compressed-tensors) has one scale per row: [N, 1]
    block = tuple(q["weight_block_size"]) if q["quant_method"] == "fp8" else (1, 1 << 30)
    suffix = "weight_scale_inv" if q["quant_method"] == "fp8" else "weight_scale"
    raw = read_tensors(fp8_dir)
    floats: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        if name.endswith(suffix):
            continue
        scale = raw.get(name.removesuffix("weight") + suffix)
        floats[name] = dequantize_by_index(tensor, scale, block) if scale is not None else tensor
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in [n for n in floats if ".mlp.experts." in n]:
        prefix, rest = name.split(".mlp.experts.")
        e, proj, _ = rest.split(".")
        experts.setdefault(prefix, {}).setdefault(int(e), {})[proj] = floats.pop(name)
    for prefix, by_expert in experts.items():
        order = sorted(by_expert)
        floats[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in order])
        floats[f"{prefix}.mlp.experts.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in order])
    return write_checkpoint(fp8_dir, out_dir, config, floats)


def quantized_weight_names(fp8_dir: Path) -> set[str]:
    """The float-layout names (as dequantized_checkpoint writes them) of every weight fp8_dir stores in e4m3."""
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as f:
        fp8_names = {name for name in f.keys() if f.get_slice(name).get_dtype() == "F8_E4M3"}
    names = set()
    for name in fp8_names:
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            proj = rest.split(".")[1]
            names.add(f"{prefix}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
        else:
            names.add(name)
    return names


@contextlib.contextmanager
def fp8_activation_rounding(model: torch.nn.Module, weight_names: set[str], group: int, expert_w8a16_tokens: int = 0):
    """The FP8 checkpoint's arithmetic on transformers' own forward over its dequantized weights: while active, every
    F.linear whose weight is one of `weight_names` (or a slice of one: an expert's) first rounds its input to e4m3
    per token and group of `group` columns (the W8A8 scheme's dynamic activations; scale amax / 448 with the 1e-10
    floor, nearest-even, written here from the format's definition rather than taken from workers/). MoE experts run
    transformers' eager per-expert loop meanwhile; a MoE call of at most `expert_w8a16_tokens` tokens leaves the
    experts' activations unrounded (the engine's CUDA GEMV path for decode-sized batches is W8A16)."""
    import torch.nn.functional as F

    params = dict(model.named_parameters())
    storages, expert_storages = set(), set()
    for name in weight_names:
        if name not in params:
            raise KeyError(f"{name}: not a parameter of the transformers model")
        (expert_storages if ".mlp.experts." in name else storages).add(params[name].untyped_storage().data_ptr())
    original = F.linear
    moe_call = {"tokens": 0}

    def note_tokens(_module, args):
        moe_call["tokens"] = args[0].reshape(-1, args[0].shape[-1]).shape[0]

    hooks = [m.register_forward_pre_hook(note_tokens) for m in model.modules()
             if type(m).__name__.endswith("TextExperts")]

    def rounded(x: torch.Tensor) -> torch.Tensor:
        shape, k = x.shape, x.shape[-1]
        flat = x.reshape(-1, k).float()
        groups = -(-k // group)
        padded = flat.new_zeros(flat.shape[0], groups * group)
        padded[:, :k] = flat
        amax = padded.view(-1, groups, group).abs().amax(dim=-1).clamp(min=1e-10)
        scale = (amax / torch.full_like(amax, 448.0)).repeat_interleave(group, dim=1)[:, :k]
        q = (flat / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
        return (q * scale).to(x.dtype).view(shape)

    def linear(x, weight, bias=None):
        storage = weight.untyped_storage().data_ptr()
        if storage in storages or (storage in expert_storages and moe_call["tokens"] > expert_w8a16_tokens):
            x = rounded(x)
        return original(x, weight, bias)

    # transformers' MoE experts run through torch._grouped_mm unless told otherwise (use_experts_implementation); the
    # eager loop calls F.linear per expert, where the rounding applies
    configs = {id(m.config): m.config for m in model.modules()
               if hasattr(getattr(m, "config", None), "_experts_implementation")}
    before = {key: config._experts_implementation for key, config in configs.items()}
    for config in configs.values():
        config._experts_implementation = "eager"
    F.linear = linear
    try:
        yield
    finally:
        F.linear = original
        for hook in hooks:
            hook.remove()
        for key, config in configs.items():
            config._experts_implementation = before[key]
