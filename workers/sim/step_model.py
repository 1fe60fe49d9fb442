"""Step-time model of the engine: how long one scheduled batch takes, calibrated on scripts/bench_engine.py runs
(H200, Qwen3-VL-30B-A3B shapes, bf16) and scaled to other models, precisions, TP widths and hardware profiles.

Components (each measured on the H200, then scaled):
  * vision: ms per pre-merge patch + a quadratic term (attention within one image), charged when an image's
    prompt starts prefilling, plus cuDNN's attention plan the first time an engine sees an image size;
  * tokens: one curve over a step's tokens (decodes + prompt tokens) through the measured decode steps (batch 1,
    64, 256 at context 1024, attention taken out) and the 8,192-token text-prefill step; up to batch 256 it
    follows the share of experts the tokens touch (weight reads), past it each token adds compute;
  * an excess per visual prompt token (DeepStack injection and the mixed-chunk attention of multimodal prompts,
    fitted on the catalogue run's GPU time split);
  * decode attention proportional to the context tokens read.
Precision: FP8 weights and the FP8 KV cache move the bf16 calibration by what the H200 measured for them in one
call beside bf16 (MeasuredFP8: about 0.7x a decode step's weight reads and 0.86x the prefill step, not the 0.5x of
FP8's peak figures; 0.96x the decode attention at half the bytes). FP4 starts from the measured FP8.
Scaling: compute-bound parts (vision, tokens past batch 256) by FLOP/s at the precision and model FLOPs per token;
memory-bound parts (the curve up to 256 tokens, attention) by HBM bandwidth and bytes per step; TP divides both with
an efficiency factor (communication is not measured).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from workers.core.step_work import StepWork

REPO = Path(__file__).resolve().parents[2]
HARDWARE_DIR = REPO / "mlperf_configs" / "hardware"
DEFAULT_BENCH = REPO / "benchmarks" / "2026-11-30-run21-30b-a3b.json"  # session 4 code, one H200
# The vision-tower bench (scripts/bench_vision.py --new-shapes) of the engine code each calibration bench measured:
# warm times over 14 image shapes and cuDNN's first-call cost per new image size. Benches not listed (session 1-3)
# fit vision on their own two figures alone.
VISION_SHAPES = {DEFAULT_BENCH.name: REPO / "benchmarks" / "2026-11-30-run18-vision-new-shapes.json"}
CALIBRATION_HARDWARE = "h200"
# The step model fitted on the product path's own steps (scripts/plan_layout.py --fit-steps on run60's Server trace:
# LoadGen -> router -> Ray worker -> engine on one H200, engine code with the mixed-step CUDA graphs): how much more
# (text) or less (vision) a real step costs than the micro-benchmarks of DEFAULT_BENCH say, and a host cost a step.
PRODUCT_PATH_FIT = REPO / "benchmarks" / "2026-12-01-run60-step-fit.json"
# FP8 against bf16, each pair measured on the H200 in one call (issue 20): the engine's decode and prefill steps with
# FP8-dynamic weights (per-channel scales, per-token activations) and the FP8 KV cache beside bf16 (run66, its first
# bench_engine call), and the paged decode attention over an FP8 cache beside a bf16 one at the kernel's committed
# tiles (run63). Theory says FP8 halves both; measured, it does not (MeasuredFP8).
FP8_STEPS_BENCH = REPO / "benchmarks" / "2026-12-02-run66-parts-committed-table.json"
FP8_ATTENTION_BENCH = REPO / "benchmarks" / "2026-12-01-run63-attention-fp8-tiles.json"
# The tiles FP8_DECODE_TILES had at run63. Since run149-153 it reads V in pairs with three stages: on an H100 111 us
# against the bf16 cache's 182 (0.61, where run63's H200 gave 0.96); not yet measured on the H200 that calibrates.
FP8_ATTENTION_KERNEL = "fp8_f16_n128_w4_s2_us"

Precision = Literal["bf16", "fp8", "fp4"]
GIB = 1 << 30
# Bytes per weight relative to bf16 (nvfp4: 4-bit values + one fp8 scale per 16 values).
WEIGHT_BYTES = {"bf16": 1.0, "fp8": 0.5, "fp4": 0.28}
KV_BYTES = {"bf16": 2, "fp8": 1}
ACTIVATION_RESERVE_GIB = 4.8  # activations, CUDA graphs, vision buffers (fits run21's H200 KV pool, 43,808 blocks)
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
    sms: int | None = Field(None, ge=1, description="streaming multiprocessors, which green contexts partition "
                            "(engine.vision_green_sms); None: not given")
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
    experts: int = 128        # routed experts per MoE layer, `active` of them per token (both Qwen3-VL MoE sizes)
    active: int = 8

    def expert_share(self, tokens: float) -> float:
        """Expected share of a layer's experts that `tokens` tokens route to (uniform routing)."""
        return 1.0 - (1.0 - self.active / self.experts) ** tokens

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        return self.kv_layers * self.kv_heads * self.head_dim * 2 * KV_BYTES[kv_dtype]


# Shapes from https://huggingface.co/Qwen/Qwen3-VL-30B-A3B-Instruct/blob/main/config.json and
# https://huggingface.co/Qwen/Qwen3-VL-235B-A22B-Instruct/blob/main/config.json: 3.04 B and 21.57 B active parameters a
# token (attention, router, 8 of 128 experts, lm_head; 2 FLOP and 2 bf16 bytes each): 6.08 / 43.1 GFLOP a token and
# 6.08 / 43 GB read at batch 1; weights 62.2 GB (measured on the project's H200) and 470 GB (235 B parameters x 2 B).
MODELS = {
    "qwen3-vl-30b-a3b": ModelShape("qwen3-vl-30b-a3b", 1.0, 1.0, 62.2e9 / GIB, kv_layers=48),
    "qwen3-vl-235b-a22b": ModelShape("qwen3-vl-235b-a22b", 43.1 / 6.08, 43.0 / 6.08, 470e9 / GIB, kv_layers=94),
}


def vision_shape_points(path: Path) -> list[tuple[int, int, float]]:
    """(images, patches per image, warm ms of the tower call) of a bench_vision.py --new-shapes run, cuDNN attention
    (the engine's backend): each call is `images` equal frames of h x w patches."""
    shapes = json.loads(Path(path).read_text())["new_shapes"]
    return [(n, h * w, ms) for (n, h, w), ms in zip(shapes["shapes"], shapes["cudnn"]["second_ms"])]


def vision_plan_ms(path: Path) -> float:
    """cuDNN's cost of an image size's first tower call: the mean first-call excess (first - second call) over the
    shapes of a bench_vision.py --new-shapes run whose frame size (h x w patches) was new; a later shape of a seen
    size paid nothing in run18 (1 then 4 images of 64 x 64). Run18: 126 ms, but widely spread over its 13 new
    sizes: median 51 ms, 10 to 858 ms (one 858 ms and one 202 ms; without the 858 ms one the mean is 65 ms)."""
    shapes = json.loads(Path(path).read_text())["new_shapes"]
    seen, excess = set(), []
    for (_, h, w), first, second in zip(shapes["shapes"], shapes["cudnn"]["first_ms"], shapes["cudnn"]["second_ms"]):
        if h * w not in seen:
            seen.add(h * w)
            excess.append(first - second)
    return sum(excess) / len(excess)


def fit_vision(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(a, b) of ms = a * images * patches + b * images * patches^2 over (images, patches, ms) points, least squares
    on the relative error (calls from 8 ms to 3.5 s weigh alike); two points are solved exactly."""
    rows = [(n * p / ms, n * p * p / ms) for n, p, ms in points]  # each row / its ms: residuals relative, target 1
    sxx, sxz, szz = (sum(x * x for x, _ in rows), sum(x * z for x, z in rows), sum(z * z for _, z in rows))
    sx, sz = sum(x for x, _ in rows), sum(z for _, z in rows)
    det = sxx * szz - sxz * sxz
    if det == 0:
        raise ValueError(f"vision fit: the points {points} do not fix both terms (one image size)")
    return (sx * szz - sz * sxz) / det, (sz * sxx - sx * sxz) / det


@dataclass(frozen=True)
class Calibration:
    """Measured H200 times of our engine (30B-A3B, bf16), from one bench_engine.py JSON.

    A step's cost before decode attention and vision is a curve over its tokens T (one per sequence plus its
    prompt tokens) through the measured decode steps (T = batch, their attention taken out) and the text-prefill
    step (T = max_num_batched_tokens + its chunks). Up to the largest decode batch a step is bound by weight reads
    (between points the cost follows the share of experts T tokens touch); past it each token adds compute."""

    source: str
    vision_ms_per_patch: float
    vision_ms_per_patch_sq: float
    visual_token_extra_ms: float
    step_tokens: tuple[int, ...]
    step_base_ms: tuple[float, ...]
    decode_ref_context: int
    attention_ms_per_context_token: float
    vision_plan_ms: float = 0.0  # an image size's first tower call (cuDNN builds its attention plan); 0: not measured
    weights: Precision = "bf16"  # the precision the token curve was measured at (at_precision)
    kv_dtype: Literal["bf16", "fp8"] = "bf16"  # the KV cache's, for the decode attention

    @property
    def memory_bound_tokens(self) -> int:
        """The largest measured decode batch: steps up to it are charged as weight reads."""
        return self.step_tokens[-2]

    @property
    def prefill_ms_per_token(self) -> float:
        """Compute per token past the largest decode batch (the curve's last segment)."""
        return (self.step_base_ms[-1] - self.step_base_ms[-2]) / (self.step_tokens[-1] - self.step_tokens[-2])

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
        attention = ATTENTION_MS_AT_REF / (256 * 1024)
        batches = sorted(int(b) for b in ours["decode"])
        bases = [ours["decode"][str(b)]["step_ms_median"] - attention * b * ref_ctx for b in batches]
        budget = work["max_num_batched_tokens"]
        tokens = (*batches, budget + budget // work["prefill_len"])  # the prefill step: its tokens + one per chunk
        bases = (*bases, ours["prefill_step_ms_median"])            # (its prefill attention is inside)
        cat = ours["catalogue"]
        grid = work["image_size"] // 16
        cat_patches = grid * grid
        shapes = VISION_SHAPES.get(Path(path).name)
        plan_ms = vision_plan_ms(shapes) if shapes else 0.0
        # Vision, one call of n images of p patches each: a*n*p + b*n*p^2. The bench's micro-benchmark (warm) and its
        # catalogue's images; the catalogue paid one plan (its image size was new after the micro-benchmark's).
        n1, p1 = work["vision_images"], ours["vision_patches_per_image"]
        points = [(n1, p1, ours["vision_ms_per_image"] * n1),
                  (cat["samples"], cat_patches,
                   cat["gpu_time_split"]["vision_s"] * 1e3 - (plan_ms if cat_patches != p1 else 0.0))]
        if shapes:
            points += vision_shape_points(shapes)
        a, b = fit_vision(points)
        # Excess per visual token: the catalogue's prefill GPU time (steps with a prompt chunk, less vision) beyond
        # its prompt tokens at the text-prefill step's rate.
        prompt_tokens = cat["prompt_tokens"]  # one number before session 3; since then {"mean", "median", ...}
        prompt_tokens = prompt_tokens["mean"] if isinstance(prompt_tokens, dict) else prompt_tokens
        text_ms = cat["samples"] * prompt_tokens / budget * ours["prefill_step_ms_median"]
        extra = max(cat["gpu_time_split"]["prefill_s"] * 1e3 - text_ms, 0.0) / (cat["samples"] * cat_patches // 4)
        return cls(
            source=str(Path(path).name), vision_ms_per_patch=a, vision_ms_per_patch_sq=max(b, 0.0),
            visual_token_extra_ms=0.0 if visual_fit is False else extra, step_tokens=tokens, step_base_ms=bases,
            decode_ref_context=ref_ctx, attention_ms_per_context_token=attention, vision_plan_ms=plan_ms,
        )

    def at_precision(self, weights: Precision, kv_dtype: str, measured: MeasuredFP8 | None = None) -> Calibration:
        """This (bf16) calibration moved to FP8 weights and/or an FP8 KV cache as the calibration hardware measured
        them (`measured`, default MeasuredFP8.load()): each point of the token curve and the visual excess by the
        measured FP8 step's ratio, the decode attention by the measured kernel's. FP4 weights start from the measured
        FP8 too (the H200 has no FP4 tensor cores to measure them on): StepModel scales from there by what FP4
        changes, the bytes read and the hardware's FP4 peak, so the kernels' measured FP8 efficiency carries over."""
        if self.weights != "bf16" or self.kv_dtype != "bf16":
            raise ValueError(f"at_precision starts from a bf16 calibration, not {self.weights}/{self.kv_dtype}")
        if weights == "bf16" and kv_dtype == "bf16":
            return self
        measured = measured or MeasuredFP8.load()
        changes: dict = {"source": f"{self.source} x {measured.source}"}
        if weights in ("fp8", "fp4"):
            ratios = measured.step_ratios(self.step_tokens)
            changes.update(weights="fp8", step_base_ms=tuple(ms * r for ms, r in zip(self.step_base_ms, ratios)),
                           visual_token_extra_ms=self.visual_token_extra_ms * ratios[-1])
        if kv_dtype == "fp8":
            changes.update(kv_dtype="fp8",
                           attention_ms_per_context_token=self.attention_ms_per_context_token * measured.attention_ratio)
        return dataclasses.replace(self, **changes)

    def base_ms(self, tokens: float, expert_share: Callable[[float], float]) -> float:
        """The curve at `tokens`: piecewise linear in the share of experts touched where that share still grows
        by 5% or more between two points, else in tokens; flat below the first point, linear past the last."""
        xs, ys = self.step_tokens, self.step_base_ms
        if tokens <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_left(xs, tokens), len(xs) - 1)
        x0, x1 = xs[i - 1], xs[i]
        s0, s1 = expert_share(x0), expert_share(x1)
        f = (expert_share(tokens) - s0) / (s1 - s0) if s1 - s0 >= 0.05 else (tokens - x0) / (x1 - x0)
        return ys[i - 1] + (ys[i] - ys[i - 1]) * f


@dataclass(frozen=True)
class MeasuredFP8:
    """What FP8 changes on the calibration hardware, measured against bf16 in one call each: a step's cost outside
    decode attention, FP8-dynamic weights over bf16, at each decode batch and at the text-prefill step
    (`step_ratio_at`: token count -> ratio), and the paged decode attention over an FP8 KV cache over a bf16 one at
    batch 256 (the model's attention reference point)."""

    step_ratio_at: tuple[tuple[int, float], ...]
    attention_ratio: float
    source: str

    @classmethod
    def load(cls, steps: Path = FP8_STEPS_BENCH, attention: Path = FP8_ATTENTION_BENCH) -> MeasuredFP8:
        cache = json.loads(Path(attention).read_text())["fp8_cache"]["decode_batch256_ctx1024"]
        attention_ratio = cache[FP8_ATTENTION_KERNEL] / cache["bf16_cache_us"]
        data = json.loads(Path(steps).read_text())
        bf16, fp8, work = data["ours"], data["ours_fp8_channel"], data["workload"]
        if bf16.get("kv_cache_dtype", "auto") != "auto" or fp8.get("kv_cache_dtype") != "fp8":
            raise ValueError(f"{Path(steps).name}: wants bf16 with its bf16 KV cache beside FP8 with an FP8 one")
        # the decode steps' attention (the model's, at the bench's context) is not the weights' doing
        per_sequence_ms = ATTENTION_MS_AT_REF / (256 * 1024) * work["decode_context"]
        points = [(int(b), (fp8["decode"][b]["step_ms_median"] - per_sequence_ms * int(b) * attention_ratio)
                   / (bf16["decode"][b]["step_ms_median"] - per_sequence_ms * int(b)))
                  for b in sorted(bf16["decode"], key=int)]
        budget = work["max_num_batched_tokens"]
        points.append((budget + budget // work["prefill_len"],
                       fp8["prefill_step_ms_median"] / bf16["prefill_step_ms_median"]))
        return cls(tuple(points), attention_ratio, f"{Path(steps).name} + {Path(attention).name}")

    def step_ratios(self, step_tokens: Sequence[int]) -> list[float]:
        """The ratio at each of a calibration's curve points: its decode batches and its prefill step by position
        (the prefill step's size is the calibrating bench's)."""
        by_tokens = dict(self.step_ratio_at[:-1])
        missing = [t for t in step_tokens[:-1] if t not in by_tokens]
        if missing:
            raise ValueError(f"{self.source}: no FP8 decode step measured at batch {missing}")
        return [by_tokens[t] for t in step_tokens[:-1]] + [self.step_ratio_at[-1][1]]


@dataclass(frozen=True)
class StepCorrection:
    """A fit of the step model on measured steps (lab/plan/step_fit.py): measured ms ~ text_scale x the model's
    text part (token curve, attention, visual excess) + vision_scale x its vision part + step_overhead_ms per step
    that does anything (the host's scheduling, launches and sync, which the micro-benchmarks' CUDA graphs hide)."""

    text_scale: float = 1.0
    vision_scale: float = 1.0
    step_overhead_ms: float = 0.0
    source: str = "none"

    @classmethod
    def load(cls, path: Path) -> StepCorrection:
        data = json.loads(Path(path).read_text())["correction"]
        return cls(float(data["text_scale"]), float(data["vision_scale"]), float(data["step_overhead_ms"]),
                   source=Path(path).name)


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
    correction: StepCorrection = StepCorrection()
    vision_split: bool = False  # EngineConfig.vision_tensor_parallel: the tp ranks share the tower (else one runs it)

    @classmethod
    def build(cls, hardware: str, model: str = "qwen3-vl-30b-a3b", weights: Precision = "bf16",
              kv_dtype: str = "bf16", tp: int = 1, bench: Path = DEFAULT_BENCH) -> StepModel:
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r} (known: {', '.join(MODELS)})")
        calibration = Calibration.from_bench(bench).at_precision(weights, kv_dtype)
        return cls(calibration, load_hardware(hardware), MODELS[model], weights, kv_dtype, tp,
                   calibration_hardware=load_hardware(CALIBRATION_HARDWARE))

    @property
    def _ref(self) -> HardwareProfile:
        return self.calibration_hardware or self.hardware

    @property
    def _parallel(self) -> float:
        return 1.0 if self.tp == 1 else self.tp * self.tp_efficiency

    @property
    def compute_scale(self) -> float:
        """Multiplier on measured compute-bound times (prefill): from the calibration's precision on the calibration
        hardware to this model's on this hardware, by peak tensor FLOP/s."""
        return (self.model.flops_ratio * self._ref.tflops(self.calibration.weights) / self.hardware.tflops(self.weights)
                / self._parallel)

    @property
    def vision_scale(self) -> float:
        """The vision tower runs in bf16 and is the same tower for every Qwen3-VL size; on one rank of the instance
        unless vision_split, where the tp ranks share it as they share the text tower."""
        return self._ref.tflops("bf16") / self.hardware.tflops("bf16") / (self._parallel if self.vision_split else 1.0)

    @property
    def memory_scale(self) -> float:
        """Multiplier on measured memory-bound times (decode weight reads), by bytes read and bandwidth."""
        weight_bytes = WEIGHT_BYTES[self.weights] / WEIGHT_BYTES[self.calibration.weights]
        return self.model.bytes_ratio * weight_bytes * self._ref.hbm_tb_s / self.hardware.hbm_tb_s / self._parallel

    @property
    def attention_scale(self) -> float:
        ref_kv = MODELS["qwen3-vl-30b-a3b"].kv_bytes_per_token(self.calibration.kv_dtype)
        return (self.model.kv_bytes_per_token(self.kv_dtype) / ref_kv * self._ref.hbm_tb_s / self.hardware.hbm_tb_s
                / self._parallel)

    def vision_ms(self, patches: int) -> float:
        c = self.calibration
        return (c.vision_ms_per_patch * patches + c.vision_ms_per_patch_sq * patches * patches) * self.vision_scale

    def step_ms(self, work: StepWork) -> float:
        """Duration of one step, in milliseconds (self.correction applied)."""
        if work.num_seqs == 0 and not work.vision_patches:
            return 0.0
        text, vision = self.step_parts_ms(work)
        c = self.correction
        return text * c.text_scale + vision * c.vision_scale + c.step_overhead_ms

    def step_parts_ms(self, work: StepWork) -> tuple[float, float]:
        """The uncorrected model's (text, vision) milliseconds of one step: the token curve, decode attention and
        visual excess; the tower's passes and plans."""
        c, share = self.calibration, self.model.expert_share
        ms = 0.0
        if work.num_seqs:  # weight reads up to the largest decode batch, compute per token past it
            tokens, knee = work.num_seqs + work.prefill_tokens, c.memory_bound_tokens
            ms += c.base_ms(min(tokens, knee), share) * self.memory_scale
            if tokens > knee:
                ms += (c.base_ms(tokens, share) - c.base_ms(knee, share)) * self.compute_scale
        ms += c.attention_ms_per_context_token * work.decode_context_tokens * self.attention_scale
        ms += c.visual_token_extra_ms * work.visual_prefill_tokens * self.compute_scale
        shares = work.vision_shares or [1.0] * len(work.vision_patches)
        vision = sum(self.vision_ms(p) * share for p, share in zip(work.vision_patches, shares))
        vision += c.vision_plan_ms * work.vision_plans  # plan building, assumed host-bound: not scaled with the hardware
        return ms, vision

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
            "calibration_precision": f"{self.calibration.weights}/{self.calibration.kv_dtype}",
            "compute_scale": round(self.compute_scale, 4), "memory_scale": round(self.memory_scale, 4),
            "kv_capacity_tokens": self.kv_capacity_tokens(),
        }
