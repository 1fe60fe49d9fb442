"""The peak finder: Offline samples/s, then the highest target QPS that LoadGen calls VALID for Server and for
Interactive, found by bisection through the product path (LoadGen -> router -> Ray workers -> engine).

Every point is one LoadGen performance test in its own process (as run_submission runs it) with its own
user.conf; its verdict and latencies are read from LoadGen's logs only. Scenarios whose engine settings are
equal share one running cluster, so workers start once per distinct engine configuration, not once per point.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from audit.loadgen_logs import parse_detail_log, parse_summary_log
from contract.stats import early_stopping_min_queries
from harness.assets import resolve_checkpoint, resolve_dataset
from harness.cluster import Cluster
from harness.interrupts import interruptible
from harness.loadgen_run import TRACE_FILE
from harness.output_lock import OutputLock
from harness.pipeline import RUNS_DIR, check_startable, run_test_process, say
from harness.plot import read_sample_latencies
from harness.scenarios import LoadGenMode, Scenario, log_dir_for
from harness.system_config import (
    DATASET_FOR_SCENARIO,
    ScenarioName,
    SystemConfig,
    engine_config,
    parse_system_config,
    read_system_yaml,
    system_config_path,
    with_engine_settings,
)
from harness.user_conf import write_user_conf
from lab.peak.tail_anatomy import engine_requests, sample_shapes, tail_anatomy, timeline_anatomy

REPO = Path(__file__).resolve().parents[2]
# What a point costs beyond its schedule, for the time budget: the test process's start and sample loading, and
# the drain after the last query. A guess on the safe side (cpu-tiny: about 10 s).
POINT_OVERHEAD_S = 20.0
GPU_RELEASE_TIMEOUT_S = 120.0


class PeakSearch(BaseModel):
    """How the search runs. Each point issues max(min_query_count, target_qps x min_duration) queries, rounded up
    to a multiple of the performance sample count (q3vl's equal-issue mode, mlperf.conf). LoadGen's VALID needs
    its early-stopping estimate too: at p99 with no query over the bound, at least 459 queries
    (ceil(log 0.01 / log 0.99); loadgen/early_stopping.cc), so fewer queries per point are INVALID by design.
    https://github.com/mlcommons/inference/blob/master/loadgen/results.cc (what makes a result VALID)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scenarios: tuple[ScenarioName, ...] = Field(
        ("offline", "server", "interactive"), min_length=1, description="what to measure, in this order"
    )
    min_duration_ms: NonNegativeInt = Field(30_000, description="LoadGen min_duration of every point")
    min_query_count: PositiveInt = Field(500, description="LoadGen min_query_count of every point (Offline: samples)")
    offline_query_count: PositiveInt | None = Field(
        None, description="Offline's samples instead of min_query_count (issue 19's Offline figure is 1,500: a "
        "longer run spends less of its time in the last large images' tail)")
    performance_sample_count: PositiveInt | None = Field(
        None, description="at most this many loaded samples per point (None: the system's); fewer make a point "
        "of equal issue shorter")
    steps: PositiveInt = Field(4, description="points tried per latency scenario")
    server_start_fraction: float = Field(0.8, gt=0, le=1, description="first Server point, x the Offline rate")
    interactive_start_fraction: float = Field(
        0.25, gt=0, le=1, description="first Interactive point, x the Offline rate")
    resolution_qps: PositiveFloat = Field(0.05, description="target QPS are rounded to this; a repeat ends a search")
    offline_samples_per_s: PositiveFloat | None = Field(
        None, description="the Offline rate when Offline is not measured in this search (bounds the brackets)")
    time_budget_s: PositiveFloat | None = Field(
        None, description="no point starts that would not end within this many seconds of the search's start")
    tail_anatomy: bool = Field(
        True, description="after the search, what each latency point's slowest 1% of queries were (harness."
        "tail_anatomy: their image and prompt sizes, the large images in flight), from LoadGen's trace")

    @model_validator(mode="after")
    def _offline_rate_known(self) -> PeakSearch:
        if len(set(self.scenarios)) != len(self.scenarios):
            raise ValueError(f"scenarios: each at most once, got {list(self.scenarios)}")
        measured = "offline" in self.scenarios
        if measured == (self.offline_samples_per_s is not None):
            raise ValueError("offline_samples_per_s: give it exactly when offline is not among the scenarios")
        if measured and self.scenarios[0] != "offline":
            raise ValueError("scenarios: offline comes first (its rate bounds the latency scenarios' brackets)")
        return self


@dataclasses.dataclass(frozen=True)
class PointResult:
    """One LoadGen test as its logs record it."""

    scenario: str
    target_qps: float
    verdict: str  # result_validity of the detail log (what the submission checker reads)
    summary_result: str  # "Result is" of mlperf_log_summary.txt
    samples_per_s: float  # Offline: result_samples_per_second; Server: result_completed_samples_per_sec
    p50_s: float
    p90_s: float
    p99_s: float
    queries: int
    samples: int  # qsl_reported_total_count: the dataset's size as LoadGen saw it
    performance_sample_count: int
    checks: dict[str, bool]  # LoadGen's conditions of VALID, by detail-log key
    early_stopping: str  # early_stopping_result, e.g. how many more queries a verdict would need
    log_dir: str
    # Server / Interactive: queries over the target latency (result_overlatency_query_count), and how many queries
    # LoadGen's early stopping needs with that many over (contract.stats): a point of fewer cannot be VALID.
    over_bound_queries: int | None = None
    queries_early_stopping_needs: int | None = None

    @property
    def valid(self) -> bool:
        return self.verdict == "VALID"


_CHECKS = ("result_perf_constraints_met", "result_min_duration_met", "result_min_queries_met", "early_stopping_met")


def read_point(log_dir: Path, scenario: str, target_qps: float) -> PointResult:
    """The point's verdict, rate and latency percentiles from LoadGen's own logs in log_dir."""
    detail = parse_detail_log(log_dir / "mlperf_log_detail.txt")
    summary = parse_summary_log(log_dir / "mlperf_log_summary.txt")
    rate = "result_samples_per_second" if scenario == "offline" else "result_completed_samples_per_sec"
    over = detail.get("result_overlatency_query_count") if scenario != "offline" else None
    return PointResult(
        scenario=scenario,
        target_qps=target_qps,
        verdict=detail["result_validity"],
        summary_result=summary.get("Result is", "?"),
        samples_per_s=float(detail[rate]),
        p50_s=detail["result_50.00_percentile_latency_ns"] / 1e9,
        p90_s=detail["result_90.00_percentile_latency_ns"] / 1e9,
        p99_s=detail["result_99.00_percentile_latency_ns"] / 1e9,
        queries=int(detail["result_query_count"]),
        samples=int(detail["qsl_reported_total_count"]),
        performance_sample_count=int(detail["effective_performance_sample_count"]),
        checks={key: bool(detail[key]) for key in _CHECKS if key in detail},
        early_stopping=" ".join(str(detail.get("early_stopping_result", "")).split()),
        log_dir=str(log_dir),
        over_bound_queries=None if over is None else int(over),
        queries_early_stopping_needs=None if over is None else early_stopping_min_queries(int(over)),
    )


def bisect_max_valid(run_point: Callable[[float], bool], high: float, first: float, steps: int,
                     resolution: float, fits: Callable[[float], bool] = lambda qps: True) -> float | None:
    """The highest target QPS in (0, high] that run_point calls valid, within `steps` points: first at `first`,
    then the middle of the bracket (highest valid, lowest invalid). None when no point tried was valid. Stops
    early when the next point repeats one tried (the bracket is below `resolution`) or does not `fit`."""
    low, best = 0.0, None
    tried: set[float] = set()
    qps = first
    for _ in range(steps):
        qps = max(resolution, round(math.floor(qps / resolution + 1e-9) * resolution, 6))  # never above `high`
        if qps in tried or qps > high or not fits(qps):
            break
        tried.add(qps)
        if run_point(qps):
            low = best = qps
        else:
            high = qps
        qps = (low + high) / 2
    return best


def point_queries(qps: float, min_duration_ms: int, min_query_count: int, performance_sample_count: int) -> int:
    """Queries LoadGen issues in one Server test: enough for the duration and the count, in whole passes over
    the loaded samples (equal issue)."""
    needed = max(min_query_count, math.ceil(qps * min_duration_ms / 1000))
    return math.ceil(needed / performance_sample_count) * performance_sample_count


@dataclasses.dataclass
class PeakReport:
    """The search's JSON, rewritten atomically after every point (an interrupted search keeps what it found)."""

    path: Path
    data: dict[str, Any]

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(self.data, f, indent=2)
            f.write("\n")
        os.replace(tmp, self.path)


def default_report_path(system: str) -> Path:
    name = Path(system).stem
    return REPO / "benchmarks" / f"{datetime.date.today().isoformat()}-peak-{name}.json"


def git_commit() -> str:
    """HEAD of the checkout this runs from, "unknown" outside git (a copied working tree)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def device_name(config: SystemConfig) -> str:
    """torch.cuda.get_device_name on a CUDA engine, asked in a child process so that this one never holds a CUDA
    context (memory the workers size their KV cache from); "cpu" on a CPU engine."""
    if config.model.simulated_hardware is not None:
        return f"simulated {config.model.simulated_hardware}"
    if not engine_config(config, Path("checkpoint")).is_cuda:
        return "cpu"
    probe = "import torch; print(torch.cuda.get_device_name(0))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"cannot name the CUDA device: {out.stderr.strip()[-500:]}")
    return out.stdout.strip()


def _gpu_processes() -> list[str] | None:
    """PIDs of the processes holding memory on this host's GPUs (nvidia-smi), None when it cannot tell."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.split() if out.returncode == 0 else None


def wait_for_released_gpus(timeout_s: float = GPU_RELEASE_TIMEOUT_S, poll_s: float = 1.0,
                           processes: Callable[[], list[str] | None] = _gpu_processes) -> bool:
    """Waits until no process holds GPU memory: a stopped cluster's worker processes exit after Ray lets them go,
    and the next workers size their KV cache from the memory they find free. Whether the GPUs came free (a
    warning, and on regardless, when they did not or nvidia-smi cannot tell)."""
    deadline = time.monotonic() + timeout_s
    while True:
        holding = processes()
        if holding == []:
            return True
        if holding is None or time.monotonic() > deadline:
            say(f"warning: GPU memory may still be held ({'no nvidia-smi' if holding is None else holding}); "
                f"the next workers' KV cache may come out smaller")
            return False
        time.sleep(poll_s)


def engine_setting(text: str) -> tuple[str, Any]:
    """KEY=VALUE of the command line as (key, value), the value read as YAML (false, 16384, a string)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, yaml.safe_load(value)


class PeakFinder:
    """Runs a PeakSearch on a system and writes its report; `run()` returns the report's data."""

    def __init__(self, system: str, search: PeakSearch, output: Path, cache_dir: Path, report_path: Path,
                 ray_address: str | None = None, show_progress: bool = False, commit: str | None = None,
                 step_trace_dir: Path | None = None, engine_overrides: dict[str, Any] | None = None) -> None:
        """engine_overrides: settings over the system's `engine` section (a scenario's own engine settings still win),
        validated with the rest, e.g. {"mixed_step_graphs": False} for the search without those graphs."""
        self._system_path = system_config_path(system)
        engine = dict(engine_overrides or {})
        self.step_trace_dir = Path(step_trace_dir).resolve() if step_trace_dir is not None else None
        if self.step_trace_dir is not None:  # every worker's engine writes its step trace there (engine.step_trace_dir)
            engine["step_trace_dir"] = str(self.step_trace_dir)
        self._raw = with_engine_settings(read_system_yaml(self._system_path), engine)
        self.config = parse_system_config(self._raw, str(self._system_path))
        for name in search.scenarios:
            self.config.scenario(name)  # ConfigError now when a scenario is not configured
        self.search = search
        self.output = output.resolve()
        self.cache_dir = cache_dir
        self.ray_address = ray_address
        self.show_progress = show_progress
        self._commit = commit
        self._started = 0.0
        self.report = PeakReport(report_path, {})

    def run(self) -> dict[str, Any]:
        """The search, holding OUTPUT's lock as run_submission does (harness.output_lock): a second search or run
        into the same --output is refused at once (OutputInUse, exit 2) and touches nothing there."""
        check_startable(self.config, self.ray_address)
        with OutputLock(self.output):
            return self._search()

    def _search(self) -> dict[str, Any]:
        self._started = time.monotonic()
        self.report.data = self._skeleton()
        say(f"peak search on {self.config.system.name} ({self.report.data['device']}): "
            f"{', '.join(self.search.scenarios)}; report in {self.report.path}")
        checkpoint = resolve_checkpoint(self.config.model, self.cache_dir)
        for name in self.search.scenarios:
            resolve_dataset(self.config.dataset(name), DATASET_FOR_SCENARIO[name], self.cache_dir)
        self.report.write()
        with interruptible(), self._clusters(checkpoint) as cluster_for:
            offline = self.search.offline_samples_per_s
            for name in self.search.scenarios:
                cluster = cluster_for(name)
                if name == "offline":
                    point = self._run_point(cluster, name, self.config.scenario("offline").target_qps)
                    offline = point.samples_per_s
                    self.report.data["offline_samples_per_s"] = offline
                    self.report.write()
                    continue
                fraction = getattr(self.search, f"{name}_start_fraction")
                best = bisect_max_valid(
                    lambda qps, name=name, cluster=cluster: self._run_point(cluster, name, qps).valid,
                    high=offline, first=fraction * offline, steps=self.search.steps,
                    resolution=self.search.resolution_qps, fits=lambda qps, name=name: self._fits(name, qps),
                )
                self.report.data[f"{name}_max_valid_qps"] = best
                self.report.write()
        if self.search.tail_anatomy:
            self._add_tail_anatomy()
        self.report.data["wall_s"] = round(time.monotonic() - self._started, 1)
        self.report.write()
        return self.report.data

    def _add_tail_anatomy(self) -> None:
        """Each latency point's tail, from its trace log and the scenario's prompts (built once per scenario)."""
        shapes: dict[str, dict] = {}
        for point in self.report.data["points"]:
            trace = Path(point["log_dir"]) / TRACE_FILE
            if point["scenario"] == "offline" or not trace.is_file():
                continue
            name = point["scenario"]
            if name not in shapes:
                say(f"reading the {name} prompts' sizes for the tail anatomy")
                shapes[name] = sample_shapes(self.config, name, self.cache_dir)
            samples = read_sample_latencies(trace)
            bound_ms = self.config.scenario(name).target_latency_ms
            bound_s = None if bound_ms is None else bound_ms / 1000
            point["tail"] = tail_anatomy(samples, shapes[name], bound_s=bound_s)
            if self.step_trace_dir is not None and "window_unix_s" in point:  # where the tail's time went
                point["tail"]["timeline"] = timeline_anatomy(
                    samples, engine_requests(self.step_trace_dir, tuple(point["window_unix_s"])), bound_s=bound_s)
            self.report.write()

    def _skeleton(self) -> dict[str, Any]:
        config = self.config
        return {
            "system": config.system.name,
            "device": device_name(config.for_scenario(self.search.scenarios[0])),
            "commit": self._commit or git_commit(),
            "workload": {
                "max_tokens": config.requests.max_tokens,
                "min_duration_ms": self.search.min_duration_ms,
                "min_query_count": self.search.min_query_count,
                "scenarios": {name: self._workload(name) for name in self.search.scenarios},
            },
            "search": self.search.model_dump(mode="json"),
            "offline_samples_per_s": self.search.offline_samples_per_s,
            "offline_measured": "offline" in self.search.scenarios,
            "server_max_valid_qps": None,
            "interactive_max_valid_qps": None,
            "points": [],
            "cluster_starts": [],
            "stopped_by_time_budget": False,
        }

    def _workload(self, name: ScenarioName) -> dict[str, Any]:
        dataset = self.config.dataset(name)
        synthetic = dataset.synthetic_count is not None
        return {
            "dataset": DATASET_FOR_SCENARIO[name],
            "catalogue": dataset.path,
            "catalogue_profile": dataset.synthetic_profile if synthetic else "real",
            "samples": None,  # the dataset's size as LoadGen reports it, after the scenario's first point
            "performance_sample_count": self._performance_sample_count(name),
            "engine": self.config.for_scenario(name).engine,
            "target_latency_ms": self.config.scenario(name).target_latency_ms,
        }

    def _min_query_count(self, name: ScenarioName) -> int:
        if name == "offline" and self.search.offline_query_count is not None:
            return self.search.offline_query_count
        return self.search.min_query_count

    def _performance_sample_count(self, name: ScenarioName) -> int:
        configured = self.config.scenario(name).performance_sample_count
        cap = self.search.performance_sample_count
        return configured if cap is None else min(configured, cap)

    def _fits(self, name: ScenarioName, qps: float) -> bool:
        budget = self.search.time_budget_s
        if budget is None:
            return True
        queries = point_queries(qps, self.search.min_duration_ms, self._min_query_count(name),
                                self._performance_sample_count(name))
        needed_s = queries / qps + POINT_OVERHEAD_S
        if time.monotonic() - self._started + needed_s <= budget:
            return True
        say(f"stopping the {name} search: {qps:g} QPS needs about {needed_s:.0f} s, past the time budget")
        self.report.data["stopped_by_time_budget"] = True
        return False

    @contextmanager
    def _clusters(self, checkpoint: Path) -> Iterator[Callable[[ScenarioName], str]]:
        """cluster_for(scenario) -> the running cluster while the scenario's engine settings equal those it was
        started with; otherwise that one is stopped and one with the new settings started."""
        running: list[tuple[dict[str, Any], Cluster]] = []

        def cluster_for(name: ScenarioName) -> Cluster:
            config = self.config.for_scenario(name)
            if running and running[0][0] == config.engine:
                return running[0][1]
            stop()
            say(f"starting the router and {config.workers.num_workers} worker(s) for {name} "
                f"(engine {json.dumps(config.engine, sort_keys=True)})")
            started = time.monotonic()
            cluster = Cluster(config, checkpoint, self.output / f"cluster-{name}", self.ray_address)
            cluster.__enter__()
            running.append((config.engine, cluster))
            say(f"workers registered, healthy and warm after {time.monotonic() - started:.0f} s")
            self.report.data["cluster_starts"].append(
                {"for": name, "ready_s": round(time.monotonic() - started, 1)})
            return cluster

        def stop() -> None:
            while running:
                engine, cluster = running.pop()
                cluster.stop()
                if str(engine.get("device", "cpu")).startswith("cuda"):
                    wait_for_released_gpus()

        try:
            yield cluster_for
        finally:
            stop()

    def _run_point(self, cluster: Cluster, name: ScenarioName, qps: float) -> PointResult:
        scenario = Scenario(name)
        index = len(self.report.data["points"])
        point_dir = (self.output / RUNS_DIR / self.config.system.name / scenario.result_dir_name
                     / f"point-{index:02d}-{qps:g}qps")
        system_yaml, config = self._point_system(point_dir, name, qps)
        write_user_conf(config, scenario, point_dir / "user.conf")
        say(f"{scenario.result_dir_name} at target {qps:g} QPS (point {index})")
        started = time.time()
        run_test_process(str(system_yaml), scenario, LoadGenMode.PERFORMANCE, cluster.router_address, point_dir,
                         self.cache_dir, self.show_progress, cluster.embedded_router_address)
        window = [round(started, 3), round(time.time(), 3)]  # the engines' request lines of this point lie inside
        point = read_point(log_dir_for(point_dir, LoadGenMode.PERFORMANCE), name, qps)
        over = ("" if point.over_bound_queries is None else f"; {point.over_bound_queries} of {point.queries} queries "
                f"over the bound, early stopping needs {point.queries_early_stopping_needs}")
        say(f"{scenario.result_dir_name} {qps:g} QPS: {point.verdict}, {point.samples_per_s:.3f} samples/s, "
            f"p50 {point.p50_s:.2f} s, p90 {point.p90_s:.2f} s, p99 {point.p99_s:.2f} s{over}")
        self.report.data["points"].append({**dataclasses.asdict(point), "window_unix_s": window})
        self.report.data["workload"]["scenarios"][name]["samples"] = point.samples
        self.report.write()
        return point

    def _point_system(self, point_dir: Path, name: ScenarioName, qps: float) -> tuple[Path, SystemConfig]:
        """The system file with this point's LoadGen settings (validated), which the test's process loads."""
        data = json.loads(json.dumps(self._raw))  # a deep copy of plain YAML data
        data["scenarios"][name].update(
            target_qps=qps, min_duration_ms=self.search.min_duration_ms, min_query_count=self._min_query_count(name),
            performance_sample_count=self._performance_sample_count(name),
        )
        config = parse_system_config(data, f"{self._system_path} ({name} at {qps:g} QPS)")
        path = point_dir / "system.yaml"
        point_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path, config
