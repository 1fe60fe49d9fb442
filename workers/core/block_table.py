"""BlockTable: a sequence's KV block ids, a list mirrored in an int32 array that a step's inputs copy whole.

A step's input preparation lays every scheduled sequence's block ids out in one [sequences, blocks] table. From
Python lists that costs a conversion per id: 0.55 ms a step at 256 sequences of 65 blocks on the CI machine's CPU,
most of the runner's preparation. From arrays it is one copy a row: 0.10 ms. The block manager changes a table
only by append (a new or shared block) and clear (freed); the array follows both.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class BlockTable(list):
    """Block ids in order (a list, as everything reads them); `array` is the same ids as an int32 array (a view:
    valid until the table next changes). append, extend and clear keep the two equal; the list's other mutators
    raise."""

    __slots__ = ("_array",)

    def __init__(self, ids: Iterable[int] = ()):
        super().__init__()
        self._array = np.empty(16, np.int32)
        self.extend(ids)

    @property
    def array(self) -> np.ndarray:
        return self._array[: len(self)]

    def append(self, block_id: int) -> None:
        n = len(self)
        if n == self._array.size:
            grown = np.empty(2 * n, np.int32)
            grown[:n] = self._array
            self._array = grown
        self._array[n] = block_id
        super().append(block_id)

    def extend(self, ids: Iterable[int]) -> None:
        for block_id in ids:
            self.append(block_id)

    def __iadd__(self, ids: Iterable[int]) -> BlockTable:
        self.extend(ids)
        return self

    def __reduce__(self):  # pickle and copy rebuild through __init__, which makes the array
        return BlockTable, (list(self),)

    def _unsupported(self, *args, **kwargs):
        raise TypeError("a block table changes only by append, extend and clear (its array mirrors the list)")

    __setitem__ = __delitem__ = __imul__ = insert = pop = remove = sort = reverse = _unsupported
