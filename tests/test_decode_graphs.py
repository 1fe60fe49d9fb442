"""What a decode-only step's CUDA graph replay is given (workers/executor/decode_graphs.py), checked on the CPU with
the replay stood in for: the graph of the smallest captured size that holds the batch, real rows as the batch has
them, and padded rows that write only the scratch slot and all carry one token at one position (so that they route
to one set of experts however many there are, whatever an earlier, larger batch left in their rows)."""

from __future__ import annotations

import torch

from workers.executor.decode_graphs import DecodeGraphs, StepBatch, graph_batch_sizes

BLOCK, SCRATCH_BLOCK, MAX_BATCH = 4, 9, 32


class RecordingGraph:
    """Stands in for a captured graph: what its static inputs held at each replay."""

    def __init__(self, graphs: DecodeGraphs):
        self.graphs, self.seen = graphs, []

    def replay(self) -> None:
        g = self.graphs
        self.seen.append({name: getattr(g, name).clone() for name in
                          ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables")})


def graphs_on_cpu() -> DecodeGraphs:
    g = DecodeGraphs.__new__(DecodeGraphs)  # the buffers __init__ makes, without a model or a capture
    g.block_size, g.max_batch, g.scratch_slot = BLOCK, MAX_BATCH, SCRATCH_BLOCK * BLOCK
    g.input_ids = torch.zeros(MAX_BATCH, dtype=torch.long)
    g.positions = torch.zeros(3, MAX_BATCH, dtype=torch.long)
    g.slot_mapping = torch.full((MAX_BATCH,), g.scratch_slot, dtype=torch.long)
    g.block_tables = torch.full((MAX_BATCH, 8), SCRATCH_BLOCK, dtype=torch.int32)
    g.context_lens = torch.ones(MAX_BATCH, dtype=torch.int32)
    g.staging = DecodeGraphs.staging_for(MAX_BATCH, 8, torch.device("cpu"))
    g.sizes = graph_batch_sizes(MAX_BATCH)
    g.graphs = {size: (RecordingGraph(g), torch.arange(size * 3, dtype=torch.float32).view(size, 3))
                for size in g.sizes}
    return g


def decode_batch(tokens: list[int], first_position: int) -> StepBatch:
    n = len(tokens)
    positions = torch.arange(first_position, first_position + n).expand(3, n).clone()
    return StepBatch(input_ids=torch.tensor(tokens), positions=positions,
                     slot_mapping=torch.arange(100, 100 + n), block_tables=torch.arange(n, dtype=torch.int32)[:, None],
                     context_lens=[first_position + 1 + i for i in range(n)], query_starts=list(range(n + 1)),
                     num_decodes=n)


def test_small_decode_batches_have_graphs_of_their_own_and_larger_ones_share_multiples_of_16():
    assert graph_batch_sizes(512)[:10] == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32] and graph_batch_sizes(512)[-1] == 512
    assert graph_batch_sizes(6) == [1, 2, 3, 4, 5, 6]


def test_a_decode_step_replays_the_smallest_graph_that_holds_it_with_its_rows_in_place():
    g = graphs_on_cpu()
    logits = g.run(decode_batch(list(range(11, 20)), first_position=40))
    (seen,) = g.graphs[16][0].seen
    assert logits.shape == (9, 3) and not g.graphs[8][0].seen  # 9 sequences: the graph of 16, its first 9 rows
    assert seen["input_ids"][:9].tolist() == list(range(11, 20))
    assert seen["positions"][:, :9].tolist() == [list(range(40, 49))] * 3
    assert seen["slot_mapping"][:9].tolist() == list(range(100, 109))
    assert seen["context_lens"][:9].tolist() == list(range(41, 50))


def test_padded_rows_write_only_the_scratch_slot_and_all_carry_one_token_after_a_larger_batch():
    g = graphs_on_cpu()
    g.run(decode_batch(list(range(201, 217)), first_position=70))  # 16 sequences fill all of the graph's rows
    g.run(decode_batch(list(range(11, 20)), first_position=40))  # then 9: rows 9-15 are padding
    seen = g.graphs[16][0].seen[-1]
    assert seen["slot_mapping"][9:16].tolist() == [g.scratch_slot] * 7
    assert seen["context_lens"][9:16].tolist() == [1] * 7
    assert seen["block_tables"][9:16, 0].tolist() == [SCRATCH_BLOCK] * 7
    assert len(set(seen["input_ids"][9:16].tolist())) == 1  # not the 16-batch's tokens 210-216: one set of experts
    assert len({tuple(column) for column in seen["positions"][:, 9:16].T.tolist()}) == 1
