"""CPU use of this process's descendants by kind and of the whole machine, sampled from /proc (Linux): what
each point of the simulation sweep reports."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


class CpuMonitor:
    """Samples, once a second, the CPU time of this process's descendants by kind (router, LoadGen/SUT, Ray
    workers, Ray itself) and of the whole machine; `usage(t0, t1)` gives % of one core over a wall window."""

    KINDS = (("router", "-m router"), ("loadgen_sut", "run-test"), ("sim_workers", "ModelWorker"),
             ("ray_other", "ray"))

    def __init__(self, period_s: float = 1.0):
        self._samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> CpuMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            self._samples.append((time.time(), self._snapshot()))

    def _snapshot(self) -> dict[str, float]:
        procs: dict[int, tuple[int, float, str]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
                cmd = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            procs[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / self._tick, cmd)
        mine = {os.getpid()}
        for _ in range(6):  # descendants, a few generations deep (Ray: raylet -> worker processes)
            mine |= {pid for pid, (ppid, _, _) in procs.items() if ppid in mine}
        totals = {kind: 0.0 for kind, _ in self.KINDS} | {"sweep": 0.0}
        for pid in mine & procs.keys():
            _, cpu, cmd = procs[pid]
            kind = next((k for k, needle in self.KINDS if needle in cmd), "sweep")
            totals[kind] += cpu
        cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        totals["machine_busy"] = (sum(map(int, cpu)) - int(cpu[3]) - int(cpu[4])) / self._tick
        return totals

    def usage(self, t0: float, t1: float) -> dict[str, float]:
        inside = [s for s in self._samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return {}
        (a_t, a), (b_t, b) = inside[0], inside[-1]
        return {kind: round(100 * (b[kind] - a[kind]) / (b_t - a_t), 1) for kind in b}
