"""BlockManager: hands out paged KV-cache blocks to sequences, with reference counts.

Optional prefix caching shares full blocks whose chained hash (tokens + image keys) matches. No tensors here.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from workers.core.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: bytes, token_ids: Seq[int], extra: bytes = b"") -> bytes:
    """Chained hash of one full block: parent hash, its token ids and any extra key (image content)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(extra)
    return h.digest()


@dataclass
class _Block:
    ref_count: int = 0
    hash: bytes | None = None


class BlockManager:
    """A fixed pool of KV blocks. Freed blocks keep their hash (when caching) until they are reused,
    in least-recently-freed order."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks seq needs so that its table covers num_tokens tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Extends seq.block_table with fresh blocks to cover num_tokens tokens (caller checked can_allocate)."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            if block.hash is not None:  # reused for new content: forget what it cached
                del self._by_hash[block.hash]
                block.hash = None
            block.ref_count = 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drops seq's references; unreferenced blocks return to the pool, the tail's first so that
        a prefix's head stays cached longest."""
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table.clear()

    # ---- prefix caching -------------------------------------------------------------------------

    def match_prefix(self, hashes: list[bytes]) -> list[int]:
        """Block ids holding the longest cached run of the given chained block hashes."""
        if not self.enable_prefix_caching:
            return []
        hit = []
        for h in hashes:
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def share(self, seq: Sequence, block_ids: list[int]) -> None:
        """Appends cached blocks to seq's (empty) table, reviving idle ones from the free pool."""
        for block_id in block_ids:
            self._free.pop(block_id, None)
            self._blocks[block_id].ref_count += 1
            seq.block_table.append(block_id)

    def register(self, seq: Sequence, hashes: list[bytes]) -> None:
        """Records the hashes of seq's leading full, computed blocks so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        for block_id, h in zip(seq.block_table, hashes):
            block = self._blocks[block_id]
            if block.hash is None and h not in self._by_hash:
                block.hash = h
                self._by_hash[h] = block_id

    def cached_hashes(self) -> list[bytes]:
        return list(self._by_hash)
