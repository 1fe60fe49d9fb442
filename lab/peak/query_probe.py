"""One query through the product path (router -> Ray worker -> engine) with one catalogue-style image of a given
size, and where its time went: the client's end-to-end and first-token times, and the engine's own timeline of
the request (workers/core/step_trace.request_timeline: preparation, queue, tower, prefill, stalled, decode) from
the worker's step trace. The system's cluster is started as a LoadGen run starts it (registered, healthy and warm);
the query is sent `repeat` times one after another on the idle system, so the first (any per-shape set-up: cuDNN
plans, compiled kernels) and the later ones show side by side. LoadGen is not involved: one query has no scenario.
"""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path
from typing import Any

from contract.tokenizer import IMAGE_PAD_ID
from harness.assets import resolve_checkpoint
from harness.cluster import Cluster
from harness.interrupts import interruptible
from harness.pipeline import check_startable, say
from harness.system_config import (
    image_pixel_limits, parse_system_config, read_system_yaml, system_config_path, with_engine_settings,
)
from lab.peak.tail_anatomy import outside_engine_s
from workers.core.step_trace import read_requests, request_timeline


def catalogue_jpeg(width: int, height: int, quality: int = 90, seed: int = 0) -> bytes:
    """A JPEG of width x height with product-photo-like content (smooth shapes over noise, so that its size and
    decode cost are a photograph's, not a flat image's)."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 40, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(noise + np.uint8(180))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(width // 20, width // 3)), y0 + int(rng.integers(height // 20, height // 3))
        draw.ellipse((x0, y0, x1, y1), fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=quality)
    return out.getvalue()


def probe_prompt(config, scenario: str, image: bytes):
    """The scenario's real prompt around one catalogue sample holding `image`."""
    from contract.dataset import CatalogueSample
    from contract.prompt import PromptBuilder
    from contract.tokenizer import load_tokenizer

    sample = CatalogueSample(index=0, title="Probe product", description="One image of a given size.",
                             image_bytes=image, image_format="JPEG", categories=[], gt_brand="", gt_is_secondhand=False,
                             gt_category="")
    (prompt,) = PromptBuilder(load_tokenizer(), config.dataset(scenario).prompt_variant,
                              *image_pixel_limits(config)).build_batch([sample])
    if isinstance(prompt, ValueError):
        raise prompt
    return prompt


async def send(address: str, token: str | None, request_id: str, prompt, max_tokens: int) -> dict[str, Any]:
    """One request through the router: its tokens, first-token and end-to-end seconds at the client."""
    from contract.wire import pb
    from router.client import RouterClient

    client = RouterClient(address, token)
    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt.token_ids, images=prompt.images,
                                 sampling=pb.SamplingParams(use_model_defaults=True, max_tokens=max_tokens))
    started, first, tokens, finish = time.monotonic(), None, 0, None
    try:
        async for chunk in client.generate(request, timeout=600):
            if chunk.token_ids and first is None:
                first = time.monotonic() - started
            tokens += len(chunk.token_ids)
            if chunk.finish_reason:
                finish = pb.FinishReason.Name(chunk.finish_reason)
                if chunk.finish_reason == pb.ERROR:
                    raise RuntimeError(f"probe query {request_id} failed: {chunk.error}")
    finally:
        await client.close()
    return {"end_to_end_s": round(time.monotonic() - started, 4), "first_token_s": round(first, 4) if first else None,
            "tokens": tokens, "finish_reason": finish}


def probe(system: str, width: int, height: int, scenario: str, repeat: int, output: Path, cache_dir: Path,
          ray_address: str | None = None, quality: int = 90,
          engine_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Starts the system's cluster with a step trace, sends the probe query `repeat` times, and returns the
    figures of each (client times, and the engine's timeline of the same request). engine_overrides: settings over
    the system's `engine` section (a scenario's own still win), validated with the rest."""
    path = system_config_path(system)
    trace_dir = (output / "steps").resolve()
    raw = with_engine_settings(read_system_yaml(path), {**(engine_overrides or {}), "step_trace_dir": str(trace_dir)})
    config = parse_system_config(raw, str(path)).for_scenario(scenario)
    image = catalogue_jpeg(width, height, quality)
    prompt = probe_prompt(config, scenario, image)
    result: dict[str, Any] = {
        "system": config.system.name, "scenario": scenario, "image": f"{width}x{height}", "jpeg_bytes": len(image),
        "prompt_tokens": len(prompt.token_ids), "image_tokens": prompt.token_ids.count(IMAGE_PAD_ID),
        "engine_overrides": engine_overrides or {}, "queries": [],
    }
    check_startable(config, ray_address)
    checkpoint = resolve_checkpoint(config.model, cache_dir)
    with interruptible(), Cluster(config, checkpoint, output / "cluster", ray_address) as cluster:
        for n in range(repeat):
            say(f"probe query {n + 1} of {repeat}: one {width}x{height} image ({result['image_tokens']} image tokens)")
            figures = asyncio.run(send(cluster.router_address, cluster.router_token, f"probe{n}-s0", prompt,
                                       config.requests.max_tokens))
            result["queries"].append(figures)
    lines = {line["request"].split("#")[0]: line for line in read_requests(trace_dir)}
    for n, figures in enumerate(result["queries"]):
        line = lines.get(f"probe{n}-s0")
        timeline = request_timeline(line) if line else None
        figures["engine"] = timeline
        if timeline is not None:
            figures["outside_engine_s"] = round(outside_engine_s(figures["end_to_end_s"], timeline), 4)
    return result


def main(argv: list[str] | None = None) -> int:
    """The command line of scripts/probe_query.py: prints one JSON object."""
    import json
    import sys

    from harness.cli import DEFAULT_CACHE, DEFAULT_SYSTEM, OneLineParser
    from lab.peak.finder import engine_setting
    from harness.interrupts import Interrupted
    from harness.system_config import ConfigError

    parser = OneLineParser(prog="probe_query.py", description="One query through the product path with one image of "
                           "a given size, and where its time went; prints one JSON object.")
    parser.add_argument("--system", default=DEFAULT_SYSTEM, help="mlperf_configs/NAME.yaml or a YAML path")
    parser.add_argument("--image", default="4000x4000", metavar="WxH", help="the image's pixels (default 4000x4000)")
    parser.add_argument("--scenario", default="interactive", choices=("offline", "server", "interactive"),
                        help="whose prompt variant, engine settings and pixel limits (default interactive)")
    parser.add_argument("--repeat", type=int, default=3, help="queries, one after another (default 3)")
    parser.add_argument("--output", type=Path, default=Path("probe_output"), metavar="DIR",
                        help="the cluster's logs and the step trace (default ./probe_output)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, metavar="DIR")
    parser.add_argument("--ray-address", default=None, metavar="ADDR", help="join this Ray cluster")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE", type=engine_setting,
                        help="an engine setting over the system's (repeatable; VALUE read as YAML), e.g. --engine "
                             "vision_attention=triton")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the JSON object to PATH (as scripts/find_peak.py --json)")
    args = parser.parse_args(argv)
    try:
        width, height = (int(v) for v in args.image.lower().split("x"))
    except ValueError:
        parser.error(f"--image {args.image!r}: expected WIDTHxHEIGHT, e.g. 4000x4000")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    try:
        result = probe(args.system, width, height, args.scenario, args.repeat, args.output, args.cache_dir,
                       args.ray_address, engine_overrides=dict(args.engine))
    except ConfigError as exc:
        parser.error(str(exc))
    except Interrupted as exc:
        print(f"probe_query.py: interrupted by {exc}; everything started was stopped", file=sys.stderr)
        return 130
    print(json.dumps(result), flush=True)  # first: a --json path that cannot be written loses nothing
    if args.json is not None:
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        except OSError as exc:
            print(f"probe_query.py: --json {args.json}: {exc} (the report is on stdout above)", file=sys.stderr)
            return 1
    return 0
