"""A sharded router (router_shards: 2): workers split over two router processes, the SUT spreads queries over
both, and every query is answered. Simulated workers keep it cheap: LoadGen -> SUT -> 2 routers -> workers."""

import re

import pytest

from lab.plan.simulated_system import run_point, simulated_system


@pytest.mark.slow
def test_two_router_shards_each_front_half_the_workers_and_serve_queries(tmp_path):
    config = simulated_system("sim-sharded", "h200", workers=4, layout="aggregated", policy="least_loaded",
                              qps={"server": 4.0}, duration_ms=5000, samples=16,
                              simulation={"model": "qwen3-vl-30b-a3b", "workers_per_process": 4})
    config["router_shards"] = 2
    point = run_point(config, "server", tmp_path, timeout_s=170)
    assert point.get("rc") in (0, 1) and "completed_qps" in point, point  # 1: the audit rejects a 5 s run
    logs = sorted((tmp_path / "output").rglob("router-*/router.log"))
    assert [log.parent.name for log in logs] == ["router-0", "router-1"]
    for log in logs:
        text = log.read_text()
        assert len(re.findall(r"worker aggregated-\d+ registered", text)) == 2, text
        served = re.search(r"served requests ([^;]*);", text)  # e.g. "STOP=16 LENGTH=1" (by finish reason)
        assert served and sum(int(n) for n in re.findall(r"=(\d+)", served.group(1))) > 0, text
