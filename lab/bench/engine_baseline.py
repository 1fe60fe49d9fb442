"""The transformers baseline of the engine bench: the same fixed catalogue through transformers' own
Qwen3-VL class and processor on the same random weights, batched generate."""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path


from lab.bench.engine_probes import Sync
from lab.bench.engine_setup import Workload

log = logging.getLogger("bench_engine")


def bench_baseline(args, w: Workload, checkpoint: Path) -> dict:
    import torch
    import transformers
    from PIL import Image
    from transformers import GenerationConfig
    from transformers.initialization import no_init_weights

    from workers.tiny_checkpoint import PREPROCESSOR_CONFIG
    from workers.weights import init_random_weights

    sync = Sync(args.device)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    hf_config = transformers.AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    with no_init_weights(), torch.device(args.device):
        model = transformers.Qwen3VLMoeForConditionalGeneration._from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    init_random_weights(model, seed=0)
    model.eval()
    result: dict = {"transformers": transformers.__version__, "experts_implementation":
                    getattr(model.config.text_config, "_experts_implementation", None)}
    proc_kwargs = {k: v for k, v in PREPROCESSOR_CONFIG.items() if k not in ("image_processor_type", "processor_class")}
    try:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl_fast import Qwen2VLImageProcessorFast as proc_cls
        processor = proc_cls(**proc_kwargs)
    except ImportError:  # no torchvision (the CPU smoke mode)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as proc_cls
        processor = proc_cls(**proc_kwargs)
    result["image_processor"] = proc_cls.__name__
    from lab.bench.catalogue_workload import fixed_catalogue
    from contract.tokenizer import IMAGE_PAD_ID

    prompts = [(r.prompt.token_ids, r.prompt.images[0])
               for r in fixed_catalogue(w.baseline_batch, w.image_size, w.text_tokens, w.output_tokens)]
    gen = dict(max_new_tokens=w.output_tokens, min_new_tokens=w.output_tokens, do_sample=False, pad_token_id=0)

    def generate(items) -> None:
        images = [Image.open(io.BytesIO(data)).convert("RGB") for _, data in items]
        processed = processor(images=images, return_tensors="pt")
        input_ids = torch.tensor([ids for ids, _ in items], device=args.device)
        with torch.inference_mode():
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids),
                pixel_values=processed["pixel_values"].to(args.device, dtype),
                image_grid_thw=processed["image_grid_thw"].to(args.device),
                mm_token_type_ids=(input_ids == IMAGE_PAD_ID).int(), **gen,
            )
        assert out.shape[1] == input_ids.shape[1] + w.output_tokens

    generate(prompts[:2])  # warm-up
    sync()
    t0 = time.perf_counter()
    generate(prompts)
    sync()
    wall = time.perf_counter() - t0
    log.info("baseline generate: %.1f s for %d samples", wall, len(prompts))
    result["generate"] = {"batch": len(prompts), "wall_s": round(wall, 3), "samples_per_s": round(len(prompts) / wall, 3),
                          "note": "images through the transformers image processor, greedy, fixed output length"}
    try:
        # the same prompts with every <|image_pad|> replaced by a text token: same length, no image
        text_ids = [[1000 if t == IMAGE_PAD_ID else t for t in ids] for ids, _ in prompts]
        cb_config = GenerationConfig(max_new_tokens=w.output_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            outs = model.generate_batch(inputs=text_ids, generation_config=cb_config)
        sync()
        wall = time.perf_counter() - t0
        generated = sum(len(getattr(o, "generated_tokens", None) or []) for o in outs.values())
        if generated != len(text_ids) * w.output_tokens:  # no rate from a run that did not generate the tokens
            raise RuntimeError(f"generate_batch returned {generated} of {len(text_ids) * w.output_tokens} tokens "
                               f"({len(outs)} outputs)")
        result["generate_batch"] = {"requests": len(text_ids), "wall_s": round(wall, 3),
                                    "samples_per_s": round(len(text_ids) / wall, 3), "outputs": len(outs),
                                    "generated_tokens": generated, "expected_tokens": len(text_ids) * w.output_tokens,
                                    "note": "continuous batching API, text-only token ids of the same prompt length"}
    except Exception as exc:  # noqa: BLE001 - the baseline API differs across transformers versions
        result["generate_batch"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    if args.device.startswith("cuda"):
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return result
