"""A system config (harness/system_config.py schema) of simulated workers, and one `python -m harness`
performance run of such a config with the figures of LoadGen's summary: what the simulation sweep, the planner's
output and the scale tests run."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from lab.plan.latency import BOUND_MS

REPO = Path(__file__).resolve().parents[2]


def simulated_system(name: str, hardware: str, *, workers: int, layout: str, policy: str, tp: int = 1,
                     prefill_fraction: float = 0.25, qps: dict[str, float] | None = None, duration_ms: int = 60000,
                     samples: int = 64, simulation: dict | None = None, engine: dict | None = None,
                     min_queries: int = 1) -> dict:
    """A system config (harness/system_config.py schema) of `workers` simulated instances of `hardware`."""
    qps = qps or {}
    if layout == "aggregated":
        pools = [{"role": "aggregated", "count": workers, "gpus_per_worker": tp, "tp": tp, "ep": tp}]
    else:
        prefill = max(1, round(workers * prefill_fraction))
        pools = [{"role": "prefill", "count": prefill, "gpus_per_worker": tp, "tp": tp, "ep": tp},
                 {"role": "decode", "count": workers - prefill, "gpus_per_worker": tp, "tp": tp, "ep": tp}]
    router: dict = {"policy": {"name": policy},
                    "limits": {"max_inflight_per_worker": 4096, "max_inflight_total": 262144, "max_queue": 262144}}
    if layout != "aggregated":
        router["disaggregation"] = {"enabled": True}
    scenario = {"min_duration_ms": duration_ms, "min_query_count": min_queries, "performance_sample_count": samples}
    return {
        "system": {"name": name, "submitter": "Q3VLHarness", "division": "open", "system_desc": "systems/vr-nvl72.json"},
        "model": {"checkpoint": f"simulated:{hardware}", "dtype": "bfloat16"},
        "datasets": {"product-catalogue": {"path": f"synthetic:{samples}"}, "catalogue-8k": {"path": f"synthetic:{samples}"}},
        "engine": {"block_size": 16, "max_num_seqs": 1024, "max_num_batched_tokens": 8192, "max_model_len": 32768,
                   **(engine or {})},
        "workers": {"pools": pools},
        "router": router,
        "simulation": simulation or {},
        "scenarios": {
            "offline": {**scenario, "target_qps": qps.get("offline", 10.0)},
            "server": {**scenario, "target_qps": qps.get("server", 1.0), "target_latency_ms": BOUND_MS["server"]},
            "interactive": {**scenario, "target_qps": qps.get("interactive", 1.0),
                            "target_latency_ms": BOUND_MS["interactive"]},
        },
        "measurements": {"input_data_types": "bf16", "retraining": "No", "starting_weights_filename": "simulated",
                         "weight_data_types": "simulated", "weight_transformations": "none"},
        "requests": {"max_tokens": 150, "timeout_s": 600},
        "ray": {"num_cpus": 2, "num_gpus": 0, "object_store_memory_mb": 100},
    }


def parse_summary(path: Path) -> dict:
    """The figures of LoadGen's mlperf_log_summary.txt that the sweep needs."""
    text = path.read_text()

    def number(label: str) -> float | None:
        m = re.search(rf"^{re.escape(label)}\s*:\s*([0-9.eE+-]+)", text, re.M)
        return float(m.group(1)) if m else None

    valid = re.search(r"Performance constraints satisfied\s*:\s*(\w+)", text)
    return {
        "valid": bool(valid and valid.group(1) == "Yes"),
        "completed_qps": number("Completed samples per second") or number("Scheduled samples per second"),
        "p99_ms": (number("99.00 percentile latency (ns)") or 0) / 1e6,
        "mean_ms": (number("Mean latency (ns)") or 0) / 1e6,
    }


def run_point(config: dict, scenario: str, out: Path, timeout_s: float, ray_address: str | None = None) -> dict:
    """`config` written under `out` and run once (`python -m harness --mode performance`, `scenario`): target
    QPS, wall time, return code and the summary's figures (or the tail of its stderr)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{config['system']['name']}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "--system", str(path), "--scenario", scenario, "--mode", "performance",
         "--output", str(out / "output"), "--cache-dir", str(out / "cache"), "--no-progress",
         *(["--ray-address", ray_address] if ray_address else [])],
        cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
    )
    summaries = sorted((out / "output").rglob("mlperf_log_summary.txt"), key=lambda p: p.stat().st_mtime)
    point = {"target_qps": config["scenarios"][scenario]["target_qps"], "wall_s": round(time.monotonic() - started, 1),
             "rc": proc.returncode}
    if summaries:
        point.update(parse_summary(summaries[-1]))
    else:
        point["error"] = proc.stderr[-2000:]
    return point
