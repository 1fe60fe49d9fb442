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

    import mlperf_loadgen as lg

    payload = array.array("B", RESPONSE.encode())
    address, _ = payload.buffer_info()

    def issue_queries(samples):
        def answer():
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
    log_settings.enable_trace = False

    sut = lg.ConstructSUT(issue_queries, lambda: None)
    qsl = lg.ConstructQSL(spec.total_samples, spec.total_samples, lambda _: None, lambda _: None)
    lg.StartTestWithLogSettings(sut, qsl, settings, log_settings)
    lg.DestroyQSL(qsl)
    lg.DestroySUT(sut)


if __name__ == "__main__":
    _run_in_this_process(LoadGenRunSpec(**json.loads(sys.argv[1])), Path(sys.argv[2]))
