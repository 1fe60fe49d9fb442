"""Fault soak: real cpu-tiny Server runs (`python -m harness`: LoadGen -> router -> Ray workers) with worker
SIGKILLs, worker SIGSTOPs (hangs) and router SIGKILLs injected mid-run; prints one JSON object of figures.

Every run is an accuracy run, so each sample is issued exactly once: LoadGen's accuracy log must then hold
every sample once, with no failed sample and no LoadGen error. Example: python scripts/fault_soak.py --minutes 4
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from audit.loadgen_logs import parse_detail_log
from harness.embedded_routing import LOG_FILE as EMBEDDED_LOG
from harness.system_config import CONFIG_DIR
from lab.soak.process_tree import descendants

REPO = Path(__file__).resolve().parents[2]

FAULTS = ("kill_worker", "stop_worker", "kill_router")
WORKER_TITLE = "ray::ModelWorker"
# Quick failure detection for short runs: a hung worker is down after 3 s without heartbeats.
SOAK_ROUTER = {"policy": {"name": "least_loaded"}, "health": {"heartbeat_interval_s": 0.5, "down_after_s": 3.0},
               "migration": {"max_retries": 4}}


# -- processes of one run (read from /proc: no extra dependency) ---------------------------------------------

def worker_pids(root: int) -> list[int]:
    return sorted(pid for pid, cmd in descendants(root).items() if cmd.startswith(WORKER_TITLE))


def router_pids(root: int) -> list[int]:
    return sorted(pid for pid, cmd in descendants(root).items() if " -m router " in f" {cmd} ")


def loadgen_pids(root: int) -> list[int]:
    return sorted(pid for pid, cmd in descendants(root).items() if "-m harness run-test" in cmd)


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)


# -- one run ---------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def soak_system(out: Path, samples: int, qps: float, dataset: str | None = None, router_mode: str = "process",
                **requests) -> Path:
    """cpu-tiny with `samples` samples at `qps`, quick failure detection, the router's HTTP front end (for
    /metrics) on a fixed loopback port, `dataset` (a catalogue directory) if given, and LoadGen's queries routed
    as `router_mode` says (system YAML router.mode)."""
    data = yaml.safe_load((CONFIG_DIR / "cpu-tiny.yaml").read_text())
    data["datasets"]["product-catalogue"]["path"] = dataset or f"synthetic:{samples}"
    data["scenarios"]["server"].update(target_qps=qps, min_duration_ms=1000, min_query_count=samples,
                                       performance_sample_count=samples)
    offline = data["scenarios"]["offline"]  # the same dataset: no more performance samples than it has
    offline["performance_sample_count"] = min(offline["performance_sample_count"], samples)
    data["router"] = SOAK_ROUTER | {"http_listen": f"127.0.0.1:{free_port()}", "mode": router_mode}
    data["requests"].update(requests)
    path = out / "soak-system.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


@dataclass
class RunReport:
    faults: list[str] = field(default_factory=list)
    returncode: int | None = None
    issued: int = 0  # samples in the catalogue (an accuracy run issues each once)
    answered: int = 0
    lost: int = 0  # issued, but no response, or an error response
    answered_twice: int = 0
    failed_samples: list[dict] = field(default_factory=list)
    loadgen_errors: int = 0
    migrations: int = 0
    router_restarts: int = 0
    resent: int = 0
    seconds: float = 0.0
    stderr_tail: str = ""


class HarnessRun:
    """`python -m harness --scenario server --mode accuracy` in a subprocess, with faults injected into it."""

    def __init__(self, system: Path, output: Path, cache: Path, scenario: str = "server", mode: str = "accuracy",
                 progress: bool = False):
        self.output = output
        router = yaml.safe_load(system.read_text())["router"]
        self.metrics_url = f"http://{router['http_listen']}/metrics"
        self.embedded = router.get("mode") == "embedded"  # LoadGen's queries routed in its own process
        self.scenario_dir = output / "runs" / "cpu-tiny" / scenario.capitalize()
        self.command = [sys.executable, "-m", "harness", "--scenario", scenario, "--mode", mode, "--system",
                        str(system), "--output", str(output), "--cache-dir", str(cache)]
        if not progress:
            self.command.append("--no-progress")
        self.process: subprocess.Popen | None = None
        self.faults: list[str] = []
        self.started = 0.0
        self.stdout = self.stderr = ""

    def start(self) -> HarnessRun:
        self.started = time.monotonic()
        self.process = subprocess.Popen(self.command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
        return self

    @property
    def pid(self) -> int:
        return self.process.pid

    def router_log(self) -> str:
        """The run's router log (with router.mode embedded, the router process's and then the LoadGen test's): in
        its staging dir while it runs (or after it failed), in place once complete."""
        return "".join(self.run_file(name) for name in ("router.log", EMBEDDED_LOG))

    def run_file(self, name: str) -> str:
        """One of the run's files in its scenario dir (router.log, ...), "" while there is none."""
        staged = sorted(self.scenario_dir.parent.glob(f".{self.scenario_dir.name}.partial-*/{name}"))
        path = staged[-1] if staged else self.scenario_dir / name
        return path.read_text(errors="replace") if path.exists() else ""

    def count_in_router_log(self, pattern: str) -> int:
        return len(re.findall(pattern, self.router_log()))

    def wait_for_loadgen(self, timeout_s: float = 300.0) -> None:
        wait_for(lambda: loadgen_pids(self.pid) or self.process.poll() is not None, timeout_s, "LoadGen test start")

    def inflight(self) -> int:
        """Requests the router holds now (its /metrics), 0 while it is unreachable. With router.mode embedded the
        router process holds none of LoadGen's: then the requests its workers last reported running."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as reply:
                text = reply.read().decode()
        except OSError:
            return 0
        if self.embedded:
            running = re.findall(r"^q3vl_router_worker_running_requests\{[^}]*\} (\S+)$", text, re.MULTILINE)
            return int(sum(float(value) for value in running))
        match = re.search(r"^q3vl_router_inflight_requests (\S+)$", text, re.MULTILINE)
        return int(float(match.group(1))) if match else 0

    def wait_for_inflight(self, count: int, timeout_s: float = 120.0) -> bool:
        """Waits until the router holds `count` requests (both workers busy under least_loaded); False if
        the run ended first."""
        wait_for(lambda: self.inflight() >= count or self.process.poll() is not None, timeout_s,
                 f"{count} requests in flight")
        return self.process.poll() is None

    def inject(self, fault: str, stop_s: float = 5.0, recover_timeout_s: float = 120.0) -> None:
        """One fault; returns once the system is whole again (worker re-registered, router back)."""
        registered = self.count_in_router_log(r"registered at")
        if fault == "kill_worker":
            victim = worker_pids(self.pid)[0]
            os.kill(victim, signal.SIGKILL)
            self._recover(lambda: self.count_in_router_log(r"registered at") > registered, recover_timeout_s,
                          "the killed worker restarted and registered again")
        elif fault == "stop_worker":
            victim = worker_pids(self.pid)[0]
            down = self.count_in_router_log(r"down: (no heartbeat|engine stalled)")
            back = self.count_in_router_log(r"back up")
            os.kill(victim, signal.SIGSTOP)
            try:
                self._recover(lambda: self.count_in_router_log(r"down: (no heartbeat|engine stalled)") > down,
                              recover_timeout_s, "the router marked the hung worker down")
                time.sleep(stop_s)
            finally:
                os.kill(victim, signal.SIGCONT)
            self._recover(lambda: self.count_in_router_log(r"back up") > back
                          or self.count_in_router_log(r"registered at") > registered,
                          recover_timeout_s, "the hung worker came back")
        elif fault == "kill_router":
            listening = self.count_in_router_log(r"router listening on")
            os.kill(router_pids(self.pid)[0], signal.SIGKILL)
            self._recover(lambda: self.count_in_router_log(r"router listening on") > listening
                          and self.count_in_router_log(r"registered at") >= registered + len(worker_pids(self.pid)),
                          recover_timeout_s, "the router restarted and every worker registered again")
        else:
            raise ValueError(f"unknown fault {fault!r}; expected one of {FAULTS}")
        self.faults.append(fault)

    def _recover(self, predicate, timeout_s: float, what: str) -> None:
        """Waits for `predicate`, or for the run to end (it may finish on the surviving workers first)."""
        wait_for(lambda: predicate() or self.process.poll() is not None, timeout_s, what)

    def kill(self) -> None:
        """SIGKILLs whatever of the run still runs (a test that failed must not leave its run going)."""
        if self.process is None or self.process.poll() is not None:
            return
        for pid in [*descendants(self.pid), self.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.communicate()

    def finish(self, timeout_s: float = 600.0) -> RunReport:
        try:
            self.stdout, self.stderr = self.process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGINT)
            self.stdout, self.stderr = self.process.communicate(timeout=60)
        return self.report(self.stderr)

    def report(self, stderr: str) -> RunReport:
        report = RunReport(faults=list(self.faults), returncode=self.process.returncode,
                           seconds=round(time.monotonic() - self.started, 1), stderr_tail=stderr[-3000:])
        log_dir = self.scenario_dir / "accuracy"
        detail = parse_detail_log(log_dir / "mlperf_log_detail.txt")
        catalogue = int(detail["qsl_reported_total_count"])
        entries = json.loads((log_dir / "mlperf_log_accuracy.json").read_text())
        failed = json.loads((log_dir / "failed_samples.json").read_text())
        counts = collections.Counter(e["qsl_idx"] for e in entries)
        failed_indices = {f["sample_index"] for f in failed}
        report.issued = catalogue
        report.answered = sum(1 for i in counts if i not in failed_indices)
        report.lost = catalogue - report.answered
        report.answered_twice = sum(1 for n in counts.values() if n > 1)
        report.failed_samples = failed
        report.loadgen_errors = len(detail.errors)
        report.migrations = self.count_in_router_log(r"migrating \(")
        report.router_restarts = stderr.count("restarting it on")
        report.resent = stderr.count("sending it again")
        return report


def run_once(faults: Sequence[str], work: Path, cache: Path, samples: int, qps: float, gap_s: float) -> RunReport:
    """One accuracy run with `faults` injected in order, the first once LoadGen has issued a few queries."""
    run = HarnessRun(soak_system(work, samples, qps), work / "out", cache).start()
    try:
        run.wait_for_loadgen()
        for fault in faults:
            if not run.wait_for_inflight(2):
                break
            run.inject(fault)
            time.sleep(gap_s)
        return run.finish()
    except BaseException:
        if run.process.poll() is None:
            run.process.send_signal(signal.SIGINT)
            run.process.communicate(timeout=60)
        raise


def main(argv: Sequence[str] | None = None) -> int:
    """The command line of scripts/fault_soak.py: soak runs until --minutes are spent; 0 when nothing was lost."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=4.0, help="start no new run after this long")
    parser.add_argument("--samples", type=int, default=24, help="samples per run (each issued once)")
    parser.add_argument("--qps", type=float, default=2.0, help="LoadGen Server target QPS")
    parser.add_argument("--gap", type=float, default=3.0, help="seconds between faults")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "fault-soak")
    args = parser.parse_args(argv)
    plans = [["kill_worker", "kill_worker", "stop_worker"], ["kill_router", "kill_worker"]]
    reports: list[RunReport] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fault-soak-") as tmp:
        while time.monotonic() - started < args.minutes * 60 or not reports:
            plan = plans[len(reports) % len(plans)]
            reports.append(run_once(plan, Path(tmp) / f"run{len(reports)}", args.cache_dir, args.samples,
                                    args.qps, args.gap))
    faults = collections.Counter(f for r in reports for f in r.faults)
    figures = {
        "runs": len(reports),
        "faults_injected": sum(faults.values()),
        "faults": dict(faults),
        "queries_issued": sum(r.issued for r in reports),
        "answered": sum(r.answered for r in reports),
        "lost": sum(r.lost for r in reports),
        "answered_twice": sum(r.answered_twice for r in reports),
        "migrations": sum(r.migrations for r in reports),
        "router_restarts": sum(r.router_restarts for r in reports),
        "queries_resent_by_sut": sum(r.resent for r in reports),
        "loadgen_errors": sum(r.loadgen_errors for r in reports),
        "seconds": round(time.monotonic() - started, 1),
        "runs_detail": [{k: v for k, v in asdict(r).items() if k != "stderr_tail"} for r in reports],
    }
    print(json.dumps(figures))
    return 0 if figures["lost"] == 0 and figures["answered_twice"] == 0 else 1

