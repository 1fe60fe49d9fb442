"""A short run of 8 simulated workers through the real harness: LoadGen -> SUT -> router -> simulated workers."""

import pytest
import yaml

from harness.system_config import load_system_config
from lab.plan.simulated_system import run_point, simulated_system


def test_simulated_system_config_validates(tmp_path):
    config = simulated_system("sim-x", "vera-rubin", workers=72, layout="disaggregated", policy="round_robin", tp=4,
                              simulation={"weights": "fp4", "kv_dtype": "fp8"})
    path = tmp_path / "sim-x.yaml"
    path.write_text(yaml.safe_dump(config))
    loaded = load_system_config(path)
    assert loaded.model.simulated_hardware == "vera-rubin"
    assert [(p.role, p.count, p.tp) for p in loaded.workers.pools] == [("prefill", 18, 4), ("decode", 54, 4)]


def test_a_bad_simulation_key_is_named(tmp_path):
    config = simulated_system("sim-y", "h200", workers=2, layout="aggregated", policy="round_robin",
                              simulation={"time_scal": 2})
    path = tmp_path / "sim-y.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match="simulation.time_scal"):
        load_system_config(path)


@pytest.mark.slow
def test_eight_simulated_workers_serve_a_server_run(tmp_path):
    config = simulated_system("sim8", "h200", workers=8, layout="aggregated", policy="least_loaded",
                              qps={"server": 8.0}, duration_ms=5000, samples=16,
                              simulation={"model": "qwen3-vl-30b-a3b", "workers_per_process": 8})
    point = run_point(config, "server", tmp_path, timeout_s=170)
    assert point.get("valid"), point
    assert 6.0 < point["completed_qps"] < 10.0
    # H200 timing of a 30B-A3B request (~1.7k prompt tokens with a 1,024-patch image, 45 tokens): well under 2 s
    assert 0.2e3 < point["p99_ms"] < 2e3
