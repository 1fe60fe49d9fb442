"""SimulationConfig: the `simulation` section of a system config (what simulated workers pretend to be).

Light on purpose (pydantic only): the harness validates it without importing the engine stack.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from workers.sim.step_model import Precision


class SimulationConfig(BaseModel):
    """The `simulation` section of a system config: what the simulated workers pretend to be."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "qwen3-vl-235b-a22b"
    weights: Precision = "bf16"
    kv_dtype: Literal["bf16", "fp8"] = "bf16"
    tp_efficiency: float = Field(0.85, gt=0, le=1)
    output_tokens: int = Field(45, ge=1, description="tokens each request generates before EOS (capped by max_tokens)")
    time_scale: float = Field(1.0, gt=0, description="wall seconds per simulated second (> 1 slows the cluster down)")
    workers_per_process: int = Field(8, ge=1, description="simulated workers hosted by one Ray actor process")
    model_kv_transfer: bool = Field(True, description="sleep the NVLink time of a pulled KV cache")
    stream_interval: int = Field(1, ge=1, description=(
        "after a request's first token, its tokens are handed out every `stream_interval` tokens and at its end "
        "(1: every token, like the real engine); end-to-end latency is unchanged, messages per request shrink"))
    trace_dir: str | None = Field(None, description=(
        "write a line per finished request (wall seconds in and out, step overrun) to <trace_dir>/<pid>-<engine>.tsv"))
