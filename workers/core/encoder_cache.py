"""EncoderCache: the scheduler's account of which images' vision-tower outputs the model runner holds.

The scheduler decides every encode (vLLM v1's design: the encoder budget and the encoder cache belong to the
scheduler, the runner only carries the lists out), so it must know what is held and how many rows it takes. The
entries are keyed by (request id, image index within the prompt) and sized in the image's prompt rows (its
<|image_pad|> tokens, after the spatial merge). No tensors here: the runner holds the embeddings under the same keys.
https://github.com/vllm-project/vllm/blob/main/vllm/v1/core/encoder_cache_manager.py (the same split in vLLM)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ImageKey = tuple[str, int]  # (request id, index of the image in its prompt)


@dataclass(frozen=True)
class ImageSpan:
    """One image of a prompt: its <|image_pad|> rows are [start, start + num_tokens)."""

    index: int
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of its rows lie in the prompt rows [start, end)."""
        return self.start < end and self.end > start


@dataclass(frozen=True)
class VisionCost:
    """The vision tower's work per image as the scheduler budgets it, in image rows: a block's linear layers cost
    in proportion to the image's rows, its attention (within the image) to their square, and the two are equal at
    `attention_rows`. depth: the tower's blocks, the steps a large image's pass can be split into at most."""

    depth: int = 1
    attention_rows: int | None = None  # None: the cost is the rows alone

    @classmethod
    def of_tower(cls, depth: int, hidden_size: int, intermediate_size: int, spatial_merge_size: int) -> VisionCost:
        """Per patch and block, the linear layers take 2 x (4 h^2 + 2 h i) FLOPs (qkv, proj, fc1, fc2) and attention
        4 x N x h over an image of N patches: equal at N = 2h + i patches, (2h + i) / merge^2 rows."""
        return cls(depth, max(1, (2 * hidden_size + intermediate_size) // spatial_merge_size**2))

    def cost(self, rows: int) -> int:
        if self.attention_rows is None:
            return rows
        return math.ceil(rows * (1 + rows / self.attention_rows))

    def block_cost(self, rows: int) -> float:
        return self.cost(rows) / self.depth


class EncoderCache:
    """Images encoded and not yet wholly in the KV cache, with the rows they take out of `capacity_tokens`.

    An entry is started once a step has read any of its rows: until then it may be evicted (its sequence has not
    started on it) to make room for an image a step needs now. An entry added not ready is a pass spread over
    several steps (a large image): it counts against the capacity from its first part, and is ready after its last."""

    def __init__(self, capacity_tokens: int):
        if capacity_tokens < 1:
            raise ValueError(f"encoder cache capacity must be at least 1 token, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self._entries: dict[ImageKey, int] = {}
        self._started: set[ImageKey] = set()
        self._in_progress: set[ImageKey] = set()
        self.used_tokens = 0

    def __contains__(self, key: ImageKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[ImageKey]:
        return list(self._entries)

    def size(self, key: ImageKey) -> int:
        """Rows the entry takes."""
        return self._entries[key]

    def fits(self, num_tokens: int) -> bool:
        """Room for an image of num_tokens rows; an empty cache takes any image (one larger than the capacity
        would otherwise never be served)."""
        return not self._entries or self.used_tokens + num_tokens <= self.capacity_tokens

    def add(self, key: ImageKey, num_tokens: int, ready: bool = True) -> None:
        if key in self._entries:
            raise ValueError(f"image {key} is already in the encoder cache")
        self._entries[key] = num_tokens
        self.used_tokens += num_tokens
        if not ready:
            self._in_progress.add(key)

    def is_ready(self, key: ImageKey) -> bool:
        return key in self._entries and key not in self._in_progress

    def mark_ready(self, key: ImageKey) -> None:
        self._in_progress.discard(key)

    def mark_started(self, key: ImageKey) -> None:
        self._started.add(key)

    def evictable(self) -> list[ImageKey]:
        """Entries no step has read yet, newest first (encoded ahead for a sequence that has not reached them)."""
        return [k for k in reversed(self._entries) if k not in self._started and k not in self._in_progress]

    def free(self, key: ImageKey) -> bool:
        tokens = self._entries.pop(key, None)
        if tokens is None:
            return False
        self._started.discard(key)
        self._in_progress.discard(key)
        self.used_tokens -= tokens
        return True

    def free_request(self, request_id: str) -> list[ImageKey]:
        """Drops every entry of a request; returns their keys."""
        keys = [k for k in self._entries if k[0] == request_id]
        for key in keys:
            self.free(key)
        return keys
