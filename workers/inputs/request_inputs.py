"""A request's token ids and images made into a Sequence for the model on a device (ModelInputs, the real engine's
RequestInputs, workers/engine_api.py): validation against the model's vocabulary and the engine's limits, image
decoding and MRoPE positions (workers/inputs/mm_inputs.py), an imported KV cache checked against the model and the
prompt (one sent without its images is laid out from the KV's image layout instead), a JSON schema compiled to a
grammar. A request that cannot be served raises PromptError naming what is wrong. It also makes the warm-up's
throw-away prompts (LLMEngine.warm_up)."""

from __future__ import annotations

import importlib
import io

import torch

from contract.tokenizer import VISION_END_ID
from contract.types import PromptInput, SamplingParams
from contract.vision_geometry import image_geometry
from workers.config import EngineConfig
from workers.kv_cache import KvExport
from workers.inputs.mm_inputs import PromptError, layout_imported_prompt, prepare_prompt
from workers.core.sequence import Sequence
from workers.request_options import RequestOptions
from workers.model_config import ModelConfig

WARM_UP_TEXT_TOKENS = 64  # filler text after each warm-up request's image
WARM_UP_OUTPUT_TOKENS = 3  # a warm-up request's: a prefill step, a mixed step and decode steps


class ModelInputs:
    """Makes Sequences for one checkpoint's model; thread-safe (it holds no state of its own)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, eos_token_ids: frozenset[int]):
        self.config = config
        self.model_config = model_config
        self.eos_token_ids = eos_token_ids
        self.decode_device = None
        if config.image_decode == "nvjpeg":
            importlib.import_module("torchvision.io")  # fails at start, not at the first image, without torchvision
            self.decode_device = torch.device(config.device)

    def make_sequence(self, request_id: str, prompt: PromptInput, sampling: SamplingParams,
                      options: RequestOptions) -> Sequence:
        cfg, mc = self.config, self.model_config
        resume, kv_import = list(options.resume_token_ids), options.kv_import
        context = len(prompt.token_ids) + len(resume) + (kv_import is not None)
        if len(prompt.token_ids) > cfg.max_model_len or context > cfg.max_model_len:
            raise PromptError(f"context of {context} tokens exceeds max_model_len {cfg.max_model_len}")
        bad = next((t for t in resume if not 0 <= t < mc.text.vocab_size), None)
        if bad is not None:
            raise PromptError(f"resume token id {bad} is outside the vocabulary")
        without_images = kv_import is not None and not prompt.images and bool(kv_import.image_layout)
        if without_images:  # a decode worker's: the KV holds the prompt, its layout stands for the images
            prepared = layout_imported_prompt(list(prompt.token_ids), kv_import.image_layout,
                                              vocab_size=mc.text.vocab_size, image_token_id=mc.image_token_id)
        else:
            prepared = prepare_prompt(
                prompt,
                vocab_size=mc.text.vocab_size,
                image_token_id=mc.image_token_id,
                spatial_merge_size=mc.spatial_merge_size,
                min_pixels=cfg.min_pixels,
                max_pixels=cfg.max_pixels,
                max_image_pixels=cfg.max_image_pixels,
                decode_device=self.decode_device,
            )
        token_ids = list(prompt.token_ids) + resume
        if kv_import is not None:
            self._check_import(kv_import, len(token_ids), prepared.mrope_position_delta)
            token_ids.append(kv_import.first_token_id)
        grammar = None
        if sampling.json_schema is not None:
            from workers.grammar import GrammarState  # guided decoding only: others never load llguidance

            try:
                grammar = GrammarState(sampling.json_schema, self.eos_token_ids, token_ids[len(prompt.token_ids):])
            except ValueError as exc:
                raise PromptError(str(exc)) from None
        return Sequence(
            request_id=request_id,
            token_ids=token_ids,
            num_prompt_tokens=len(prompt.token_ids),
            sampling=sampling,
            arrival=-1,
            prefill_only=options.prefill_only,
            mm=prepared.mm,
            mrope_position_delta=prepared.mrope_position_delta,
            kv_import=kv_import,
            image_spans=prepared.image_spans,
            grammar=grammar,
            image_layout=prepared.image_layout,
            recomputable=not without_images,
        )

    def warm_up_prompts(self) -> list[PromptInput]:
        """One throw-away prompt per config.warm_up_image_sizes: a blank image of that size, as a JPEG, and some
        filler text; text alone when no such prompt fits max_model_len."""
        from PIL import Image

        mc, text = self.model_config, [1000 + i for i in range(WARM_UP_TEXT_TOKENS)]
        prompts = []
        for width, height in self.config.warm_up_image_sizes:
            buf = io.BytesIO()
            # JPEG, as the catalogue's images are: with image_decode "nvjpeg" the warm-up also starts nvJPEG (its
            # first decode took 0.69 s of a lone query's 0.71 s preparation, run81)
            Image.new("RGB", (width, height), (128, 128, 128)).save(buf, format="JPEG", quality=90)
            visual = image_geometry(buf.getvalue(), self.config.min_pixels, self.config.max_pixels).num_tokens
            ids = [mc.vision_start_token_id] + [mc.image_token_id] * visual + [VISION_END_ID] + text
            if len(ids) + WARM_UP_OUTPUT_TOKENS <= self.config.max_model_len:  # else no request of it would fit
                prompts.append(PromptInput(ids, [buf.getvalue()]))
        return prompts or [PromptInput(text)]

    def _check_import(self, kv: KvExport, num_tokens: int, delta: int) -> None:
        text = self.model_config.text
        if kv.num_tokens != num_tokens:
            raise PromptError(f"imported KV covers {kv.num_tokens} tokens, the prompt (+ resume tokens) has {num_tokens}")
        shape = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
        if shape != (text.num_hidden_layers, text.num_key_value_heads, text.head_dim):
            raise PromptError(
                f"imported KV has (layers, kv heads, head dim) {shape}, this model "
                f"{(text.num_hidden_layers, text.num_key_value_heads, text.head_dim)}"
            )
        if kv.mrope_position_delta != delta:
            raise PromptError(f"imported KV has MRoPE delta {kv.mrope_position_delta}, the prompt gives {delta}")
        if not 0 <= kv.first_token_id < text.vocab_size:
            raise PromptError(f"imported first token id {kv.first_token_id} is outside the vocabulary")
