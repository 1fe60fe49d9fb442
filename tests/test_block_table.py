"""A sequence's block table (workers/core/block_table.BlockTable): a list of block ids whose int32 array mirror, which
a step's input preparation copies, stays equal to it through the block manager's appends and clears, through
growth past its first capacity, and through pickling and copying; the list's other mutators refuse."""

from __future__ import annotations

import copy
import pickle

import pytest

from contract.types import SamplingParams
from workers.core.block_table import BlockTable
from workers.core.sequence import Sequence


def test_the_array_follows_appends_past_its_first_capacity_and_a_clear():
    table = BlockTable([7, 3])
    for block_id in range(100, 140):
        table.append(block_id)
    assert table.array.tolist() == table == [7, 3, *range(100, 140)]
    table.clear()
    assert table.array.tolist() == table == []
    table += [5, 6]
    assert table.array.tolist() == table == [5, 6]


@pytest.mark.parametrize("mutate", [
    lambda t: t.__setitem__(0, 9), lambda t: t.__delitem__(0), lambda t: t.insert(0, 9), lambda t: t.pop(),
    lambda t: t.remove(1), lambda t: t.sort(), lambda t: t.reverse(), lambda t: t.__imul__(2),
], ids=["setitem", "delitem", "insert", "pop", "remove", "sort", "reverse", "imul"])
def test_mutators_that_would_leave_the_array_behind_refuse(mutate):
    table = BlockTable([1, 2])
    with pytest.raises(TypeError, match="changes only by append, extend and clear"):
        mutate(table)
    assert table.array.tolist() == table == [1, 2]


def test_a_pickled_or_copied_table_keeps_its_ids_in_both_forms():
    table = BlockTable(range(20))
    for other in (pickle.loads(pickle.dumps(table)), copy.deepcopy(table), copy.copy(table)):
        assert isinstance(other, BlockTable) and other.array.tolist() == other == list(range(20))


def test_a_sequence_made_with_a_plain_list_gets_a_block_table():
    seq = Sequence("r", [1, 2, 3], 3, SamplingParams(), arrival=0, block_table=[4, 5])
    assert isinstance(seq.block_table, BlockTable) and seq.block_table.array.tolist() == [4, 5]
    assert isinstance(Sequence("s", [1], 1, SamplingParams(), arrival=1).block_table, BlockTable)
