"""The memory behind LoadGen's QSL: loaded samples kept as original image bytes plus ready prompt token ids.

A sample whose prompt cannot be built is kept as an error text, so the SUT can answer it without a model call.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from contract.dataset import CatalogueSample
from contract.tokenizer import IMAGE_PAD_ID
from contract.types import PromptInput

logger = logging.getLogger(__name__)

PromptBuilderFn = Callable[[CatalogueSample], PromptInput]
BATCH = 256  # samples tokenized per call when the builder has build_batch


@dataclass(frozen=True)
class PreparedSample:
    """Exactly one of prompt / error is set."""

    index: int
    prompt: PromptInput | None
    error: str | None = None


def _footprint(prompt: PromptInput) -> int:
    """Bytes held: images, the id list, and one int object per id outside CPython's small-int cache
    (image pads are one shared object)."""
    boxed = sum(1 for t in prompt.token_ids if t > 256 and t != IMAGE_PAD_ID)
    return sum(len(b) for b in prompt.images) + sys.getsizeof(prompt.token_ids) + 32 * boxed


class SampleStore:
    """load(indices) reads and prepares samples; get(index) is a dict lookup (cheap on the issue path).

    prompt_builder turns one sample into a PromptInput; if it also has
    `build_batch(samples) -> list[PromptInput | Exception]` (contract.prompt.PromptBuilder does), samples
    are tokenized in batches.
    """

    def __init__(self, catalogue: Sequence[CatalogueSample], prompt_builder: PromptBuilderFn):
        self._catalogue = catalogue
        self._builder = prompt_builder
        self._loaded: dict[int, PreparedSample] = {}
        self._bytes: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._loaded)

    def __contains__(self, index: int) -> bool:
        return index in self._loaded

    @property
    def memory_bytes(self) -> int:
        return sum(self._bytes.values())

    def load(self, indices: Iterable[int]) -> None:
        """Prepares every sample in `indices` not yet loaded; never raises for a bad sample."""
        todo = list(dict.fromkeys(i for i in indices if i not in self._loaded))
        for start in range(0, len(todo), BATCH):
            chunk = todo[start:start + BATCH]
            for index, result in zip(chunk, self._build(self._read(chunk))):
                self._keep(index, result)
        errors = sum(1 for i in todo if self._loaded[i].error is not None)
        logger.info("loaded %d samples (%d unusable), %.1f MiB held", len(todo), errors, self.memory_bytes / 2**20)

    def unload(self, indices: Iterable[int]) -> None:
        for index in indices:
            self._loaded.pop(index, None)
            self._bytes.pop(index, None)

    def get(self, index: int) -> PreparedSample:
        try:
            return self._loaded[index]
        except KeyError:
            raise KeyError(f"sample {index} was not loaded (load_samples_to_ram not called for it)") from None

    def _read(self, indices: list[int]) -> list[CatalogueSample]:
        many = getattr(self._catalogue, "samples", None)
        return many(indices) if many is not None else [self._catalogue[i] for i in indices]

    def _build(self, samples: list[CatalogueSample]) -> list[PromptInput | Exception]:
        batch = getattr(self._builder, "build_batch", None)
        if batch is not None:
            return batch(samples)
        results: list[PromptInput | Exception] = []
        for sample in samples:
            try:
                results.append(self._builder(sample))
            except Exception as exc:  # any failure becomes this sample's error response
                results.append(exc)
        return results

    def _keep(self, index: int, result: PromptInput | Exception) -> None:
        if isinstance(result, Exception):
            text = str(result)
            if not text.startswith(f"sample {index}:"):
                text = f"sample {index}: {text}"
            logger.warning("cannot prepare %s", text)
            self._loaded[index] = PreparedSample(index, None, text)
            self._bytes[index] = len(text)
        else:
            self._loaded[index] = PreparedSample(index, result)
            self._bytes[index] = _footprint(result)
