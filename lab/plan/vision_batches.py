"""How the fixed catalogue's images reach the vision tower, on the CPU: the engine's own Scheduler and BlockManager
run the workload with no model (every sampled token the same, every request to its max_tokens), and the scheduler's
encoder budget decides each step's encodes: images its chunks reach go through the tower in the step (in_step);
with encode_ahead, what budget is left encodes the next step's images behind the step's sampling (ahead).
Image work is costed by rows alone (SchedulerLimits' default VisionCost), so the counts read as images.
Prints one JSON object per max_num_seqs: steps, preemptions, tower calls by kind, images per call.

Usage (scripts/sim_vision_batches.py is its command line): python -m scripts.sim_vision_batches [--samples 2000] [--max-num-seqs 256,384,512] [--kv-blocks 41983]
       [--budget 16384] [--no-encode-ahead]
The defaults are the H200 runs of benchmarks/README.md (seventh pass): 1,734-token prompts with 1,024 image rows
from row 4, 45 tokens out, run32's KV pool.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

from contract.types import SamplingParams
from workers.core.block_manager import BlockManager
from workers.core.scheduler import Scheduler, SchedulerLimits
from workers.core.sequence import Sequence

PROMPT, IMAGE_FIRST, IMAGE_ROWS, OUTPUT, BLOCK = 1734, 4, 1024, 45, 16


def simulate(samples: int, max_num_seqs: int, kv_blocks: int, budget: int, encode_ahead: bool = True) -> dict:
    limits = SchedulerLimits(max_num_seqs, budget, 32768, encode_ahead=encode_ahead)
    sched = Scheduler(limits, BlockManager(kv_blocks, BLOCK), frozenset({-1}))
    for i in range(samples):
        sched.add(Sequence(f"c{i}", [1000 + (i * 7 + j) % 90000 for j in range(PROMPT)], PROMPT,
                           SamplingParams(max_tokens=OUTPUT), arrival=i, image_spans=[(IMAGE_FIRST, IMAGE_ROWS, b"")]))
    calls: list[tuple[str, int]] = []
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        steps += 1
        calls += [(kind, len(encodes)) for kind, encodes in (("in_step", out.encode_now), ("ahead", out.encode_ahead))
                  if encodes]
        sched.update(out, {c.seq.request_id: 5 for c in out.chunks if c.samples})
    sizes = [n for _, n in calls]
    return {
        "max_num_seqs": max_num_seqs, "encode_ahead": encode_ahead, "steps": steps,
        "preemptions": sched.num_preemptions, "tower_calls": len(calls),
        "calls_by_kind": dict(collections.Counter(kind for kind, _ in calls)),
        "images": sum(sizes), "images_in_step": sum(n for kind, n in calls if kind == "in_step"),
        "images_per_call_mean": round(statistics.mean(sizes), 2) if sizes else 0.0,
        "images_per_call": {str(k): v for k, v in sorted(collections.Counter(sizes).items())},
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--max-num-seqs", default="256,384,512")
    p.add_argument("--kv-blocks", type=int, default=41983)
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--no-encode-ahead", action="store_true")
    args = p.parse_args(argv)
    results = [simulate(args.samples, int(n), args.kv_blocks, args.budget, not args.no_encode_ahead)
               for n in args.max_num_seqs.split(",")]
    for r in results:
        print(json.dumps(r), flush=True)
    return results


if __name__ == "__main__":
    main()
