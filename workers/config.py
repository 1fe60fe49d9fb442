"""EngineConfig: every setting of one engine (checkpoint, device, KV pool, batching limits, image limits), and
KvLinkConfig: one end of a prefill->decode KV link (read by the harness without importing torch.distributed).

EngineConfig is validated on construction; a bad value fails with a pydantic error naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contract.vision_geometry import MAX_PIXELS, MIN_PIXELS

CPU_DEFAULT_KV_BLOCKS = 1024
PIL_DEFAULT_MAX_IMAGE_PIXELS = 89_478_485


class EngineConfig(BaseModel):
    """Settings of one LLMEngine. Unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: Path = Field(description="Directory holding config.json, generation_config.json and *.safetensors.")
    load_format: Literal["safetensors", "random"] = Field(
        "safetensors", description="'random' builds the model from config.json alone with random weights "
        "(performance runs of real shapes without a checkpoint on disk)."
    )
    device: str = Field("cpu", description="'cpu', 'cuda' or 'cuda:N'.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Activation and weight dtype; 'auto' is bfloat16 on CUDA, float32 on CPU."
    )
    fp8_compute: Literal["auto", "fp8", "dequantize"] = Field(
        "auto", description="An FP8 checkpoint's linears: 'auto' computes in FP8 (W8A8) on CUDA and dequantizes the "
        "weights at load on the CPU (what transformers computes there); 'fp8' also on the CPU (the kernels' torch "
        "references, for tests); 'dequantize' everywhere (bf16 math on FP8 checkpoints)."
    )
    vision_precision: Literal["bf16", "fp8"] = Field(
        "bf16", description="The vision tower's block linears (qkv, proj, fc1, fc2): 'bf16' as the checkpoint holds "
        "them (every release leaves the tower unquantised), or 'fp8': quantised to e4m3 per output channel at load and "
        "run W8A8 with per-token activations (the FP8-dynamic scheme; torch's row-wise FP8 GEMM on CUDA). Attention, "
        "the patch embedding and the mergers stay in the activation dtype."
    )
    vision_attention: Literal["auto", "sdpa", "triton", "triton_fp8", "gluon", "gluon_fp8", "flash_attn4"] = Field(
        "auto", description="The vision tower's attention (workers/model/vision_attention.py): 'sdpa' (torch's, cuDNN "
        "on the H200, one call per run of equal-size frames), 'triton' (our kernel: one launch over every frame of a "
        "tower call, bf16), 'triton_fp8' (the same kernel on e4m3 Q/K/V with per-head scales, float32 softmax), "
        "'gluon' (workers/model/vision_attention_gluon.py: the MMAs beneath the softmax, Hopper only, 'triton' on "
        "other GPUs), 'gluon_fp8' (workers/model/vision_attention_gluon_fp8.py: the same on e4m3 Q/K/P/V with "
        "per-head scales, Hopper only, 'triton_fp8' on other GPUs; bf16's error on the tower, and no faster), "
        "'flash_attn4' (FlashAttention-4's CuTe DSL kernels, workers/model/vision_attention_fa4.py, for a tower call "
        "whose largest image has 16,384 patches or more, else 'sdpa': needs the optional flash-attn-4 package, which "
        "the engine's warm-up checks), or 'auto': 'gluon' for a tower call whose largest image has 12,000 patches "
        "or more, or, on Hopper, whose images come in several sizes with 8,192 patches in all and one of 3,600 "
        "or more (SDPA takes a call a size), else 'sdpa' (vision_attention.auto_takes_ours; measured on an H100, "
        "run156). The CPU runs SDPA whichever is named."
    )
    image_decode: Literal["pil", "nvjpeg"] = Field(
        "pil", description="How requests' images become the tower's pixels: 'pil' decodes (libjpeg for JPEG) and "
        "resizes on the host, as transformers' processor does, pixel for pixel; 'nvjpeg' (CUDA only, needs "
        "torchvision) decodes RGB and grayscale JPEGs with nvJPEG and resizes them on the GPU, PIL's bicubic within one "
        "level (workers/inputs/device_image.py), every other image as 'pil' does. nvJPEG's pixels differ from "
        "libjpeg's by a few levels (benchmarks/README.md, scripts/bench_image_path.py)."
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto", description="KV cache element type: 'auto' is the activation dtype; 'fp8' stores float8_e4m3fn with "
        "a per-layer k_scale/v_scale (the checkpoint's self_attn k_scale/v_scale tensors where present, else 1.0), "
        "which holds about twice the tokens in the same memory."
    )
    step_trace_dir: str | None = Field(
        None, description="Write one JSON line per engine step (what it computed and its wall time) and one per "
        "finished request (when it was submitted, prepared, admitted, first scheduled, got its first token, finished) "
        "to DIR/steps-<pid>.jsonl: the product path's own timings, which lab/plan/step_fit.py fits the step model "
        "on (scripts/plan_layout.py --fit-steps). None: no trace."
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache block.")
    num_kv_blocks: int | None = Field(
        None, ge=1, description="KV blocks in the pool; None sizes it from free memory on CUDA "
        f"(gpu_memory_utilization) and uses {CPU_DEFAULT_KV_BLOCKS} on CPU."
    )
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="Fraction of GPU memory the engine may use.")
    max_num_seqs: int = Field(256, ge=1, description="Most sequences in one step.")
    max_num_batched_tokens: int = Field(8192, ge=1, description="Token budget of one step (prefill chunks + decodes).")
    max_model_len: int = Field(32768, ge=2, description="Longest context (prompt + generated tokens).")
    max_image_pixels: int = Field(
        PIL_DEFAULT_MAX_IMAGE_PIXELS, ge=1, description="Decoded images above this pixel count are rejected (decompression bombs)."
    )
    min_pixels: int = Field(MIN_PIXELS, ge=1, description="smart_resize lower bound on pixels per image.")
    max_pixels: int = Field(MAX_PIXELS, ge=1, description="smart_resize upper bound on pixels per image.")
    enable_prefix_caching: bool = Field(
        False, description="Reuse KV blocks of identical prompt prefixes (forbidden by MLPerf; off by default)."
    )
    enforce_eager: bool = Field(
        False, description="Never replay CUDA graphs (by default decode-only steps on CUDA replay graphs captured "
        "at bucketed batch sizes up to max_num_seqs)."
    )
    mixed_step_graphs: bool = Field(
        True, description="On CUDA (unless enforce_eager), steps that carry prompt chunks replay piecewise CUDA graphs: "
        "everything between two layers' attention captured at bucketed token counts up to max_num_batched_tokens, "
        "attention eager between them (workers/executor/step_graphs.py). Off: such steps run eagerly, launch by launch."
    )
    max_num_prefill_tokens: int | None = Field(
        None, ge=1, description="Prompt tokens per step, decodes aside (None: the whole max_num_batched_tokens). A "
        "smaller cap keeps the steps that carry decodes short, at some cost in throughput."
    )
    max_num_encoder_tokens: int | None = Field(
        None, ge=1, description="The vision tower's work per step, in the step and ahead, in image rows with "
        "attention's quadratic term (workers/core/encoder_cache.VisionCost; None: max_num_batched_tokens, times "
        "tensor_parallel_size where vision_tensor_parallel splits the tower over the ranks). A chunk stops "
        "before an image the budget cannot take; an image costing more than the whole budget is encoded over several "
        "steps, a few tower blocks at a time, while other prompts go on."
    )
    encoder_pass_share: float = Field(
        0.5, ge=0.0, le=1.0, description="Of a step's encoder budget, the share that images encoded over several "
        "steps may take beyond the oldest one's one block a step; the rest is kept for whole images."
    )
    encoder_cache_tokens: int | None = Field(
        None, ge=1, description="Image rows of encoded images held between steps (None: twice the encoder budget and "
        "the largest image's rows, max_pixels / 32^2, so that a pass over the largest image leaves room for others)."
    )
    encode_ahead: bool = Field(
        True, description="Spend a step's unused encoder budget on the images of the prompts the next step will "
        "probably reach, encoded behind this step's sampling (off: each image is encoded in the step that first "
        "needs it)."
    )
    overlap_decode_steps: bool = Field(
        False, description="While a step runs on the device, apply it, schedule the next one and launch it behind it "
        "(its sequences' new input tokens read on the device from the running step's samples) before reading the "
        "first one's tokens back, so the host's scheduling and input building overlap the device's work: vLLM's "
        "async scheduling, for every step (prompt chunks, images, decodes; not while a grammar-constrained request "
        "samples). A sequence that samples a stop token has its next step's row dropped, and a request added between "
        "steps is admitted one step later. Single-GPU engines only (not multi-rank)."
    )
    warm_up: bool = Field(
        True, description="On CUDA, before the first request: one text step at each step size whose fused-MoE tile "
        "configs differ, then the real step loop on throw-away requests, one per warm_up_image_sizes. Triton compiles "
        "a kernel per tile config and cuDNN builds an attention plan per image size on first use (up to 0.9 s each, "
        "benchmarks run18); without a warm-up a fresh engine's first 2,000 catalogue samples run ~7% slower (run35)."
    )
    warm_up_image_sizes: tuple[tuple[int, int], ...] = Field(
        ((1000, 1000), (800, 800), (1024, 1024)), description="(width, height) in pixels of the warm-up requests' blank "
        "images (smart-resized like requests' images): the real catalogue's two commonest sizes and the 1,024 x 1,024 "
        "of the fixed benchmark catalogue (commonest sizes from the plots in "
        "github.com/mlcommons/inference/blob/master/multimodal/qwen3-vl/notebooks/shopify-global-catalogue.ipynb)."
    )
    preprocess_threads: int = Field(
        4, ge=1, description="Threads that decode, resize and patch requests' images beside the engine's own thread. "
        "More take CPU from that thread: on a 16-core H200 host, 16 threads stretched the vision tower's steps from "
        "3.19 to 4.03 s per 256 catalogue images, and 4 prepare ~175 images/s, far ahead of the engine (benchmarks run20)."
    )
    seed: int = Field(0, description="Seed of the generator used by sampled requests that carry no seed of their own.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks (GPUs, or CPU processes) of this one model instance; device 'cuda:N' puts rank r "
        "on cuda:N+r. Attention heads and KV heads are split over them (workers/parallel.py)."
    )
    expert_parallel: bool = Field(
        False, description="With tensor_parallel_size > 1: split MoE experts whole over the ranks (each rank computes "
        "its E/n experts for every token) instead of splitting every expert's intermediate dimension."
    )
    vision_tensor_parallel: bool = Field(
        False, description="With tensor_parallel_size > 1: split the vision tower's attention heads and MLP over the "
        "ranks (each rank runs 1/n of every tower pass, two all-reduces a block; workers/model/vision.py), so a large "
        "image's pass should take about 1/n of the time. False: rank 0 runs the whole tower while the other ranks "
        "wait. Off by default until it has run on GPUs (token-exact on CPU with gloo ranks; its NCCL path and speed-up "
        "unmeasured: benchmarks/README.md, twenty-eighth pass)."
    )

    vision_green_sms: int = Field(
        0, ge=0, description="On CUDA, run a tower pass too large for a step's encoder budget whole on the stream of a "
        "green context of this many SMs, beside the text tower's steps (workers/executor/tower_stream.py): the other "
        "requests' steps go on, slowed, while it runs; its request's image rows wait until the executor reports the "
        "pass done. 0: such a pass is spread over the steps a few blocks at a time, each step carrying its share. "
        "Whole images stay on the step's stream. On one H100 a pass with 64 SMs beside 32 decoding requests took "
        "0.85x of the two one after the other (bench_engine.py --beside-tower); the simulated engine charges the "
        "pass total/N its time and each step beside it (total/(total - N))^0.6 (workers/sim/engine.py). Through the "
        "product path it did not pay (Server at 11.35 QPS on one H100: p99 11.83 s with 64 SMs against 11.13 s "
        "without, run142-143), so off by default. One rank only; the CPU, without streams, ignores it."
    )

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) exceeds max_pixels ({self.max_pixels})")
        if self.vision_green_sms and self.tensor_parallel_size > 1:
            raise ValueError(f"vision_green_sms ({self.vision_green_sms}) runs a one-rank engine's tower beside its "
                             f"steps; this engine has tensor_parallel_size {self.tensor_parallel_size}")
        if self.image_decode == "nvjpeg" and not self.is_cuda:
            raise ValueError(f"image_decode 'nvjpeg' decodes on a CUDA device; this engine's device is {self.device!r}")
        return self

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.is_cuda else "float32"


@dataclass(frozen=True)
class KvLinkConfig:
    """Both ends use the same host/port; the prefill side is rank 0 (it hosts the rendezvous store)."""

    host: str
    port: int
    role: str  # "prefill" (sender) | "decode" (receiver)
    device: str = "cuda:0"
    timeout_s: float = 600.0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
