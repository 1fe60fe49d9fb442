"""How the fixed catalogue's images reach the vision tower, on the CPU: the engine's own Scheduler and BlockManager
run the workload with no model (every sampled token the same, every request to its max_tokens), and the runner's
rules decide each step's encodes: images of the step's chunks not yet encoded go through the tower in the step
(in_step); with encode_ahead, the images of Scheduler.next_prompts that model_runner.images_pending picks go
through it behind the step's sampling (ahead).
Prints one JSON object per max_num_seqs: steps, preemptions, tower calls by kind, images per call.

Usage: python -m scripts.sim_vision_batches [--samples 2000] [--max-num-seqs 256,384,512] [--kv-blocks 41983]
       [--budget 16384] [--no-encode-ahead]
The defaults are the H200 runs of benchmarks/README.md (seventh pass): 1,734-token prompts with 1,024 image rows
from row 4, 45 tokens out, run32's KV pool.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from dataclasses import dataclass

from workers.block_manager import BlockManager
from workers.model_runner import images_pending
from workers.scheduler import Scheduler, SchedulerLimits
from workers.sequence import Sequence
from workers.types import SamplingParams

PROMPT, IMAGE_FIRST, IMAGE_ROWS, OUTPUT, BLOCK = 1734, 4, 1024, 45, 16


@dataclass
class ImageRows:
    image_rows: range


def simulate(samples: int, max_num_seqs: int, kv_blocks: int, budget: int, encode_ahead: bool = True) -> dict:
    sched = Scheduler(SchedulerLimits(max_num_seqs, budget, 32768), BlockManager(kv_blocks, BLOCK), frozenset({-1}))
    for i in range(samples):
        seq = Sequence(f"c{i}", [1000 + (i * 7 + j) % 90000 for j in range(PROMPT)], PROMPT,
                       SamplingParams(max_tokens=OUTPUT), arrival=0)
        seq.mm = ImageRows(range(IMAGE_FIRST, IMAGE_FIRST + IMAGE_ROWS))
        sched.add(seq)
    encoded: set[str] = set()  # encoded, some image rows not yet in the KV cache
    calls: list[tuple[str, int]] = []
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        steps += 1
        need = [c.seq.request_id for c in out.chunks if c.seq.request_id not in encoded
                and c.start <= c.seq.mm.image_rows[-1] and c.start + c.num_tokens > c.seq.mm.image_rows[0]]
        if need:
            calls.append(("in_step", len(need)))
            encoded.update(need)
        computed = {c.seq.request_id: c.start + c.num_tokens for c in out.chunks}
        encoded -= {rid for rid, end in computed.items() if rid in encoded and end > IMAGE_FIRST + IMAGE_ROWS - 1}
        if encode_ahead:
            ahead = [s.request_id for s in sched.next_prompts(out)
                     if images_pending(s, computed.get(s.request_id), encoded)]
            if ahead:
                calls.append(("ahead", len(ahead)))
                encoded.update(ahead)
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
    """The command line of scripts/sim_vision_batches.py: one JSON line per --max-num-seqs value."""
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

