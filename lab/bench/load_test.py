"""Closed-loop load through a router for its benchmarks (scripts/bench_router.py, the router ceiling of
scripts/sim_sweep.py): the helper processes they start and `concurrency` clients sending back to back."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from contract.stats import percentile

REPO = Path(__file__).resolve().parents[2]


class Procs:
    """Helper processes of a load test (`python ARGS...` from the repository root, one thread for BLAS), each
    answering on stdout once it serves; stop() terminates them all."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], lines: int = 1, log: Path | None = None) -> list[str]:
        """Starts `python *args`; its first `lines` lines of stdout (addresses, "ready"). log: where its stderr
        goes (default: discarded)."""
        stderr = log.open("w") if log is not None else subprocess.DEVNULL
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=stderr,
                                text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
        if log is not None:
            stderr.close()  # the child has its own copy
        self.procs.append(proc)
        return [proc.stdout.readline().strip() for _ in range(lines)]

    def start_binary(self, args: list[str]) -> int:
        """Starts a program that is not Python; returns its pid."""
        self.procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return self.procs[-1].pid

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def closed_loop(send: Callable[[], Awaitable[None]], concurrency: int, seconds: float,
                      cpu_of: int | None = None) -> dict:
    """`concurrency` clients sending back to back for `seconds`: requests/s and latency percentiles; with cpu_of (a
    pid), also the CPU milliseconds that process spent per completed request meanwhile."""
    latencies: list[float] = []
    errors = 0
    end = time.monotonic() + seconds

    async def client() -> None:
        nonlocal errors
        while time.monotonic() < end:
            t = time.monotonic()
            try:
                await send()
            except Exception:  # noqa: BLE001 - counted, the run goes on
                errors += 1
                continue
            latencies.append(time.monotonic() - t)

    start, cpu_start = time.monotonic(), cpu_seconds(cpu_of) if cpu_of is not None else 0.0
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.monotonic() - start
    pct = lambda q: round(1000 * percentile(latencies, q), 3) if latencies else None
    result = {"requests_per_s": round(len(latencies) / elapsed, 1), "p50_ms": pct(0.5), "p99_ms": pct(0.99),
              "completed": len(latencies), "errors": errors}
    if cpu_of is not None and latencies:
        result["cpu_ms_per_request"] = round(1000 * (cpu_seconds(cpu_of) - cpu_start) / len(latencies), 3)
    return result


async def interleaved(sends: dict[str, Callable[[], Awaitable[None]]], seconds: float) -> dict[str, dict]:
    """One request at a time, the senders taking turns for `seconds`: each one's latency percentiles. Taking turns,
    every sender meets the same load of a shared machine, so their differences are not its drift between points."""
    latencies: dict[str, list[float]] = {name: [] for name in sends}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for name, send in sends.items():
            t = time.monotonic()
            await send()
            latencies[name].append(time.monotonic() - t)
    ms = lambda values, q: round(1000 * percentile(values, q), 3)
    return {name: {"p50_ms": ms(values, 0.5), "p99_ms": ms(values, 0.99), "completed": len(values)}
            for name, values in latencies.items()}


async def drain(stream) -> None:
    """Reads a response stream to its end."""
    async for _ in stream:
        pass
