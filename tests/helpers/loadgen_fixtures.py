"""Real LoadGen logs for the audit tests: runs mlperf_loadgen in a subprocess with a trivial threaded SUT,
and rewrites chosen detail-log values so a tiny run can stand in for an official-length one."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

MODEL = "qwen3-vl-235b-a22b"
RESPONSE = '{"category": "A > B > C", "brand": "acme", "is_secondhand": false}'
SLOW_ANSWER_S = 1.5  # how late a slow query's answer comes (LoadGenRunSpec.slow_queries)
SLOW_BOUND_MS = 500  # a target latency the slow queries miss and the others meet


@dataclass(frozen=True)
class LoadGenRunSpec:
    """One LoadGen test with settings small enough to finish in well under a second."""

    scenario: Literal["Offline", "Server"]
    mode: Literal["PerformanceOnly", "AccuracyOnly"]
    total_samples: int = 20
    min_duration_ms: int = 50
    min_query_count: int = 20
    target_qps: float = 400.0
    server_target_latency_ms: int | None = None
    load_config_twice: bool = False
    trace: bool = False  # also write mlperf_log_trace.json (per-sample events)
    # The first this many issued queries are answered SLOW_ANSWER_S late: over a target latency of SLOW_BOUND_MS, which
    # the others, answered at once, stay far below even on a loaded machine (a 20 ms bound was not: 13 of 100 over).
    slow_queries: int = 0


def run_loadgen(spec: LoadGenRunSpec, out_dir: Path) -> Path:
    """Runs the test in a fresh process (LoadGen reads mlperf.conf once per process).

    out_dir receives LoadGen's mlperf_log_* files and the user.conf the run used; returns out_dir.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, __file__, json.dumps(asdict(spec)), str(out_dir)],
        check=True,
        cwd=out_dir,
        capture_output=True,
        timeout=60,
    )
    return out_dir


def rewrite_detail_values(path: Path, values: dict[str, Any]) -> None:
    """Sets the value of every `:::MLLOG` entry whose key is in `values`; fails if a key is not logged."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    seen: set[str] = set()
    for i, line in enumerate(lines):
        if not line.startswith(":::MLLOG "):
            continue
        entry = json.loads(line[len(":::MLLOG "):])
        if entry["key"] in values:
            entry["value"] = values[entry["key"]]
            seen.add(entry["key"])
            lines[i] = ":::MLLOG " + json.dumps(entry) + "\n"
    missing = set(values) - seen
    if missing:
        raise KeyError(f"{path}: keys not in the log: {sorted(missing)}")
    path.write_text("".join(lines), encoding="utf-8")


def append_detail_entry(path: Path, key: str, value: Any, *, is_error: bool = False) -> None:
    """Appends an entry shaped like LoadGen's own (used to add an error to a clean log)."""
    entry = {"key": key, "value": value, "time_ms": 0.0, "namespace": "mlperf::logging",
             "event_type": "POINT_IN_TIME", "metadata": {"is_error": is_error, "is_warning": False}}
    with path.open("a", encoding="utf-8") as f:
        f.write(":::MLLOG " + json.dumps(entry) + "\n")


def _run_in_this_process(spec: LoadGenRunSpec, out_dir: Path) -> None:
    import array
    import threading
    import time

    import mlperf_loadgen as lg

    payload = array.array("B", RESPONSE.encode())
    address, _ = payload.buffer_info()

    issued = iter(range(10**9))

    def issue_queries(samples):
        late = next(issued) < spec.slow_queries

        def answer():
            if late:
                time.sleep(SLOW_ANSWER_S)
            lg.QuerySamplesComplete(
                [lg.QuerySampleResponse(s.id, address, len(payload), 17) for s in samples])

        threading.Thread(target=answer, daemon=True).start()

    scenario = spec.scenario
    conf = out_dir / "user.conf"
    lines = [
        f"{MODEL}.{scenario}.target_qps = {spec.target_qps}",
        f"{MODEL}.{scenario}.min_duration = {spec.min_duration_ms}",
        f"{MODEL}.{scenario}.min_query_count = {spec.min_query_count}",
        f"{MODEL}.{scenario}.performance_sample_count_override = {spec.total_samples}",
    ]
    if spec.server_target_latency_ms is not None:
        lines.append(f"{MODEL}.Server.target_latency = {spec.server_target_latency_ms}")
    conf.write_text("\n".join(lines) + "\n")

    settings = lg.TestSettings()
    settings.scenario = getattr(lg.TestScenario, scenario)
    settings.mode = getattr(lg.TestMode, spec.mode)
    for _ in range(2 if spec.load_config_twice else 1):
        if settings.FromConfig(str(conf), MODEL, scenario) != 0:
            raise SystemExit(f"FromConfig failed for {conf}")
    log_settings = lg.LogSettings()
    log_settings.log_output.outdir = str(out_dir)
    log_settings.enable_trace = spec.trace

    sut = lg.ConstructSUT(issue_queries, lambda: None)
    qsl = lg.ConstructQSL(spec.total_samples, spec.total_samples, lambda _: None, lambda _: None)
    lg.StartTestWithLogSettings(sut, qsl, settings, log_settings)
    lg.DestroyQSL(qsl)
    lg.DestroySUT(sut)


if __name__ == "__main__":
    _run_in_this_process(LoadGenRunSpec(**json.loads(sys.argv[1])), Path(sys.argv[2]))


# -- a submission tree built from real runs, doctored to official-length values ---------------------------

SUBMITTER = "Q3VLHarness"
SYSTEM = "cpu-tiny"
SYSTEM_JSON = Path(__file__).resolve().parents[2] / "mlperf_configs" / "systems" / "cpu-tiny.json"
MEASUREMENTS = {"input_data_types": "fp32", "retraining": "No", "starting_weights_filename": "tiny random",
                "weight_data_types": "fp32", "weight_transformations": "none"}
ACCURACY_SAMPLES = 80  # enough for an accuracy log above 10 KiB, so the builder truncates it

# What a tiny run cannot reach (duration, sample counts, validity) set to what a full official run logs.
OFFICIAL_PERF_VALUES = {
    "Offline": {"effective_min_duration_ms": 600000, "effective_performance_sample_count": 48289,
                "effective_samples_per_query": 53117, "result_validity": "VALID"},
    "Server": {"effective_min_duration_ms": 600000, "effective_performance_sample_count": 48289,
               "result_validity": "VALID", "early_stopping_met": True},
}
OFFICIAL_PERF_VALUES["Interactive"] = OFFICIAL_PERF_VALUES["Server"]
OFFICIAL_ACCURACY_COUNT = {"Offline": 48289, "Server": 48289, "Interactive": 8000}


def loadgen_spec(scenario: str, mode: str, **overrides: Any) -> LoadGenRunSpec:
    """The LoadGen test for a submission scenario dir (Interactive = Server with a 1.5 s target)."""
    lg_scenario = "Offline" if scenario == "Offline" else "Server"
    latency = 1500 if scenario == "Interactive" else None
    samples = ACCURACY_SAMPLES if mode == "AccuracyOnly" else 20
    return LoadGenRunSpec(lg_scenario, mode, total_samples=samples, server_target_latency_ms=latency, **overrides)


def official_runs(root: Path, scenarios=("Offline", "Server", "Interactive")) -> dict[tuple[str, str], Path]:
    """Real LoadGen output dirs per (scenario, "performance"|"accuracy"), doctored to official values."""
    runs = {}
    for scenario in scenarios:
        perf = run_loadgen(loadgen_spec(scenario, "PerformanceOnly"), root / scenario / "performance")
        rewrite_detail_values(perf / "mlperf_log_detail.txt", OFFICIAL_PERF_VALUES[scenario])
        acc = run_loadgen(loadgen_spec(scenario, "AccuracyOnly"), root / scenario / "accuracy")
        count = OFFICIAL_ACCURACY_COUNT[scenario]
        rewrite_detail_values(acc / "mlperf_log_detail.txt",
                              {"effective_accuracy_sample_count": count, "qsl_reported_total_count": count})
        runs[(scenario, "performance")], runs[(scenario, "accuracy")] = perf, acc
    return runs


def accuracy_result(f1: float):
    # Imported here: this file is also the LoadGen subprocess's script, which should stay light.
    from audit.accuracy import AccuracyResult

    return AccuracyResult(category_f1=f1, hierarchical_precision=f1, hierarchical_recall=f1, brand_score=0.9,
                          is_secondhand_f1=0.9, num_responses=ACCURACY_SAMPLES, num_unparsable=0,
                          random_category_f1=0.2, random_brand_score=0.0, random_is_secondhand_f1=0.5)


def add_scenario(builder, scenario: str, runs: dict[tuple[str, str], Path], f1: float = 0.79) -> None:
    """Everything one scenario dir needs, through the builder's public methods."""
    builder.add_performance_run(scenario, runs[(scenario, "performance")])
    builder.add_accuracy_run(scenario, runs[(scenario, "accuracy")], accuracy_result(f1))
    builder.add_measurements(scenario, MEASUREMENTS)
    builder.add_user_conf(scenario, runs[(scenario, "performance")] / "user.conf")
    builder.add_readme(scenario, ["./run_submission.sh", "--scenario", scenario.lower()], "performance")


def make_source_root(root: Path) -> Path:
    """A small stand-in for the repository for add_source (one package, one config), with a checkpoint
    config.json under checkpoint/ for add_calibration."""
    (root / "harness").mkdir(parents=True, exist_ok=True)
    (root / "harness" / "__init__.py").write_text('"""harness"""\n')
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (root / "checkpoint").mkdir(exist_ok=True)
    (root / "checkpoint" / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    return root
