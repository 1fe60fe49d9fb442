"""GPU timing for the benchmarks: microseconds per call, eager (events around a loop or around each call)
or replayed from one CUDA graph (no launch gaps, as the engine's decode graphs run)."""

from __future__ import annotations

import statistics

import torch


def time_us(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def median_us(fn, reps: int) -> float:
    """The median over reps of one call's events, after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _captured(fn, calls: int) -> torch.cuda.CUDAGraph:
    """`calls` calls of fn captured in one CUDA graph, after a warm-up call on a side stream."""
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_us(fn, calls: int = 10, replays: int = 5) -> float:
    """GPU microseconds per fn() call: `calls` calls captured in one CUDA graph (no launch gaps), replayed."""
    graph = _captured(fn, calls)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1e3 / (calls * replays), 1)


def graph_median_us(fn, calls: int = 10, reps: int = 10) -> float:
    """GPU microseconds per fn() call: the median over reps replays of one graph of `calls` calls."""
    graph = _captured(fn, calls)
    return median_us(graph.replay, reps) / calls
