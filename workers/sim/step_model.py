"""Step-time model of the engine: how long one scheduled batch takes, calibrated on scripts/bench_engine.py runs
(H200, Qwen3-VL-30B-A3B shapes, bf16) and scaled to other models, precisions, TP widths and hardware profiles.

Components (each measured on the H200, then scaled):
  * vision: ms per pre-merge patch (+ a quadratic term: attention within one image), charged when an image's
    prompt starts prefilling;
  * prefill: ms per prompt token in a step, plus an excess per visual token (DeepStack injection and the
    mixed-chunk attention of multimodal prompts, fitted on the catalogue run's GPU time split);
  * decode: a per-step cost interpolated over the measured batch sizes (1, 64, 256 at context 1024), plus
    attention proportional to the context tokens read.
Scaling: compute-bound parts (vision, prefill) by FLOP/s and model FLOPs per token; memory-bound parts (decode)
by HBM bandwidth and bytes per step; TP divides both with an efficiency factor (communication is not measured).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

REPO = Path(__file__).resolve().parents[2]
HARDWARE_DIR = REPO / "mlperf_configs" / "hardware"
DEFAULT_BENCH = REPO / "benchmarks" / "2026-11-30-run2-30b-a3b.json"
CALIBRATION_HARDWARE = "h200"

Precision = Literal["bf16", "fp8", "fp4"]
GIB = 1 << 30
# Bytes per weight relative to bf16 (nvfp4: 4-bit values + one fp8 scale per 16 values).
WEIGHT_BYTES = {"bf16": 1.0, "fp8": 0.5, "fp4": 0.28}
KV_BYTES = {"bf16": 2, "fp8": 1}
ACTIVATION_RESERVE_GIB = 4.0  # activations, CUDA graphs, vision buffers (fits the measured H200 KV pool)
ATTENTION_MS_AT_REF = 8.0     # decode attention at batch 256 x context 1024 (benchmarks/README.md "Reading")


class HardwareProfile(BaseModel):
    """One accelerator, as mlperf_configs/hardware/<name>.yaml gives it (figures with their sources)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    measured: bool
    hbm_gb: float = Field(gt=0, description="GiB of device memory")
    hbm_tb_s: float = Field(gt=0)
    dense_tflops: dict[str, float]
    nvlink_gb_s: float = Field(gt=0)
    gpus_per_node: int = Field(ge=1)
    sources: list[str] = Field(min_length=1)

    def tflops(self, precision: Precision) -> float:
        """Dense tensor FLOP/s at `precision`; a precision the part lacks runs at the best one below it."""
        for p in ("fp4", "fp8", "bf16")[("fp4", "fp8", "bf16").index(precision):]:
            if p in self.dense_tflops:
                return self.dense_tflops[p]
        raise ValueError(f"hardware {self.name}: no dense_tflops for {precision} or wider")


def load_hardware(name: str) -> HardwareProfile:
    path = HARDWARE_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml")))
        raise ValueError(f"unknown hardware profile {name!r} (known: {known})")
    return HardwareProfile.model_validate(yaml.safe_load(path.read_text()))


@dataclass(frozen=True)
class ModelShape:
    """What the step model needs of a model, relative to the calibration model (Qwen3-VL-30B-A3B)."""

    name: str
    flops_ratio: float        # prefill FLOPs per token
    bytes_ratio: float        # weight bytes read per decode step
    weights_gib_bf16: float
    kv_layers: int
    kv_heads: int = 4
    head_dim: int = 128

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        return self.kv_layers * self.kv_heads * self.head_dim * 2 * KV_BYTES[kv_dtype]


# reference/engine.md §5.2: 30B-A3B 6.08 GFLOP/token, 6.08 GB read at B=1, 62.2 GB weights;
# 235B-A22B 43.1 GFLOP/token, 43 GB read at B=1, 470 GB weights.
MODELS = {
    "qwen3-vl-30b-a3b": ModelShape("qwen3-vl-30b-a3b", 1.0, 1.0, 62.2e9 / GIB, kv_layers=48),
    "qwen3-vl-235b-a22b": ModelShape("qwen3-vl-235b-a22b", 43.1 / 6.08, 43.0 / 6.08, 470e9 / GIB, kv_layers=94),
}


@dataclass(frozen=True)
class Calibration:
    """Measured H200 times of our engine (30B-A3B, bf16), from one bench_engine.py JSON."""

    source: str
    vision_ms_per_patch: float
    vision_ms_per_patch_sq: float
    prefill_ms_per_token: float
    visual_token_extra_ms: float
    decode_batches: tuple[int, ...]
    decode_step_ms: tuple[float, ...]  # at context DECODE_REF_CONTEXT per sequence
    decode_ref_context: int
    attention_ms_per_context_token: float

    @classmethod
    def from_bench(cls, path: Path = DEFAULT_BENCH, visual_fit: Path | None | Literal[False] = None) -> Calibration:
        """Micro-benchmark figures of `path`; the visual-token excess is fitted on `visual_fit`'s catalogue run
        (default: the same file; False: no excess, i.e. micro-benchmarks alone)."""
        if visual_fit is not None and visual_fit is not False and Path(visual_fit) != Path(path):
            fitted = cls.from_bench(visual_fit)
            return dataclasses.replace(cls.from_bench(path, False), visual_token_extra_ms=fitted.visual_token_extra_ms,
                                       source=f"{Path(path).name} (visual excess from {fitted.source})")
        data = json.loads(Path(path).read_text())
        ours, work = data["ours"], data["workload"]
        ref_ctx = work["decode_context"]
        batches = tuple(sorted(int(b) for b in ours["decode"]))
        steps = tuple(ours["decode"][str(b)]["step_ms_median"] for b in batches)
        attention = ATTENTION_MS_AT_REF / (256 * 1024)
        # Vision: the 1,024-patch micro-benchmark and the catalogue's 4,096-patch images fix a*p + b*p^2.
        cat = ours["catalogue"]
        grid = work["image_size"] // 16
        cat_patches = grid * grid
        p1, t1 = ours["vision_patches_per_image"], ours["vision_ms_per_image"]
        t2 = cat["gpu_time_split"]["vision_s"] * 1e3 / cat["samples"]
        b = (t2 - t1 * cat_patches / p1) / (cat_patches**2 - cat_patches * p1)
        a = (t1 - b * p1 * p1) / p1
        # Prefill: text-only 8,192-token steps of 4 prompts, less the per-step cost of a 4-sequence batch.
        seqs = work["max_num_batched_tokens"] // work["prefill_len"]
        base = _interp(batches, steps, seqs) - attention * seqs * ref_ctx  # as step_ms charges a pure prefill step
        per_token = (ours["prefill_step_ms_median"] - base) / work["max_num_batched_tokens"]
        # Excess per visual token: catalogue prefill GPU time beyond what the text rate predicts.
        prompt = cat["prompt_tokens"]
        visual = cat_patches // 4
        tokens = cat["samples"] * prompt
        n_steps = tokens / work["max_num_batched_tokens"]
        text_ms = tokens * per_token + n_steps * base
        extra = max(cat["gpu_time_split"]["prefill_s"] * 1e3 - text_ms, 0.0) / (cat["samples"] * visual)
        if visual_fit is False:
            extra = 0.0
        return cls(
            source=str(Path(path).name), vision_ms_per_patch=a, vision_ms_per_patch_sq=max(b, 0.0),
            prefill_ms_per_token=per_token, visual_token_extra_ms=extra, decode_batches=batches,
            decode_step_ms=steps, decode_ref_context=ref_ctx, attention_ms_per_context_token=attention,
        )


def _interp(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear in x; linear extrapolation past the last two points, flat below the first."""
    if x <= xs[0]:
        return ys[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class StepWork:
    """What one engine step computes."""

    num_seqs: int = 0                  # sequences in the step (prefill chunks + decodes)
    prefill_tokens: int = 0            # prompt tokens computed this step
    visual_prefill_tokens: int = 0     # of which image tokens
    decode_context_tokens: int = 0     # context read by the step's decoding sequences
    vision_patches: list[int] = field(default_factory=list)  # pre-merge patches of images encoded this step


@dataclass(frozen=True)
class StepModel:
    """Step times of one engine instance (tp GPUs of `hardware`) serving `model` with `weights` precision."""

    calibration: Calibration
    hardware: HardwareProfile
    model: ModelShape
    weights: Precision = "bf16"
    kv_dtype: Literal["bf16", "fp8"] = "bf16"
    tp: int = 1
    tp_efficiency: float = 0.85  # assumed: all-reduce / all-to-all cost of TP+EP is not measured here
    calibration_hardware: HardwareProfile | None = None

    @classmethod
    def build(cls, hardware: str, model: str = "qwen3-vl-30b-a3b", weights: Precision = "bf16",
              kv_dtype: str = "bf16", tp: int = 1, bench: Path = DEFAULT_BENCH) -> StepModel:
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r} (known: {', '.join(MODELS)})")
        return cls(Calibration.from_bench(bench), load_hardware(hardware), MODELS[model], weights, kv_dtype, tp,
                   calibration_hardware=load_hardware(CALIBRATION_HARDWARE))

    @property
    def _ref(self) -> HardwareProfile:
        return self.calibration_hardware or self.hardware

    @property
    def _parallel(self) -> float:
        return 1.0 if self.tp == 1 else self.tp * self.tp_efficiency

    @property
    def compute_scale(self) -> float:
        """Multiplier on measured compute-bound times (prefill)."""
        return self.model.flops_ratio * self._ref.tflops("bf16") / self.hardware.tflops(self.weights) / self._parallel

    @property
    def vision_scale(self) -> float:
        """The vision tower runs in bf16 and is the same tower for every Qwen3-VL size."""
        return self._ref.tflops("bf16") / self.hardware.tflops("bf16") / self._parallel

    @property
    def memory_scale(self) -> float:
        """Multiplier on measured memory-bound times (decode weight reads)."""
        return (self.model.bytes_ratio * WEIGHT_BYTES[self.weights] * self._ref.hbm_tb_s / self.hardware.hbm_tb_s
                / self._parallel)

    @property
    def attention_scale(self) -> float:
        ref_kv = MODELS["qwen3-vl-30b-a3b"].kv_bytes_per_token("bf16")
        return (self.model.kv_bytes_per_token(self.kv_dtype) / ref_kv * self._ref.hbm_tb_s / self.hardware.hbm_tb_s
                / self._parallel)

    def vision_ms(self, patches: int) -> float:
        c = self.calibration
        return (c.vision_ms_per_patch * patches + c.vision_ms_per_patch_sq * patches * patches) * self.vision_scale

    def step_ms(self, work: StepWork) -> float:
        """Duration of one step, in milliseconds."""
        if work.num_seqs == 0 and not work.vision_patches:
            return 0.0
        c = self.calibration
        ms = 0.0
        if work.num_seqs:
            base = _interp(c.decode_batches, c.decode_step_ms, work.num_seqs)
            base -= c.attention_ms_per_context_token * work.num_seqs * c.decode_ref_context
            ms += max(base, 0.0) * self.memory_scale
            ms += c.attention_ms_per_context_token * work.decode_context_tokens * self.attention_scale
        ms += (c.prefill_ms_per_token * work.prefill_tokens
               + c.visual_token_extra_ms * work.visual_prefill_tokens) * self.compute_scale
        ms += sum(self.vision_ms(p) for p in work.vision_patches)
        return ms

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        """KV tokens that fit beside the weights on tp GPUs."""
        free = (self.hardware.hbm_gb * gpu_memory_utilization - ACTIVATION_RESERVE_GIB) * self.tp
        free -= self.model.weights_gib_bf16 * WEIGHT_BYTES[self.weights]
        if free <= 0:
            return 0
        return int(free * GIB // self.model.kv_bytes_per_token(self.kv_dtype))

    def describe(self) -> dict:
        return {
            "hardware": self.hardware.name, "model": self.model.name, "weights": self.weights,
            "kv_dtype": self.kv_dtype, "tp": self.tp, "calibration": self.calibration.source,
            "compute_scale": round(self.compute_scale, 4), "memory_scale": round(self.memory_scale, 4),
            "kv_capacity_tokens": self.kv_capacity_tokens(),
        }
