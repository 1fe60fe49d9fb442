"""The harness on a two-node Ray cluster (two raylets on this machine, each with its own resource label): the
prefill pool is placed on one node, the decode pool on the other, and a run joins it via --ray-address.

ray.cluster_utils.Cluster starts the same head and worker-node processes as `ray start --head` /
`ray start --address`, but tracks them, so the teardown stops only this test's processes (`ray stop` would
stop every Ray on the machine). Both nodes take 127.0.0.1 as their address (`--node-ip-address 127.0.0.1`), so
that they, and the run that joins them at 127.0.0.1, listen on loopback only; their session files go to a temp dir
of the test's (`--temp-dir`), not /tmp/ray. So does the cluster's address file: ray.cluster_utils.Cluster writes its
head's address to Ray's machine-wide default (/tmp/ray/ray_current_cluster, "for convenience in unit testing": a
bare ray.init() then joins it), whatever temp dir its nodes were given. On a fresh machine, where /tmp/ray does not
exist, that write failed (FileNotFoundError) and the test failed when run alone; elsewhere it pointed every later
ray.init() on the machine at this test's cluster."""

import os
from pathlib import Path

import pytest

from harness.ray_network import make_temp_dir, remove_temp_dir
from harness.ray_workers import start_timed_out
from lab.plan.simulated_system import run_point, simulated_system
from lab.soak.process_tree import descendants
from tests.helpers.net_fixtures import listening_sockets

LOOPBACK = "127.0.0.1"


def address_file_in(temp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's write_ray_address (a private function; cluster_utils calls it through the module) writes into temp_dir."""
    import ray._private.utils as ray_utils

    write = ray_utils.write_ray_address
    monkeypatch.setattr(ray_utils, "write_ray_address", lambda address, _temp_dir=None: write(address, str(temp_dir)))


@pytest.mark.slow
def test_a_simulated_run_spans_two_ray_nodes_on_loopback(tmp_path, monkeypatch):
    from ray.cluster_utils import Cluster

    temp_dir = make_temp_dir()
    address_file_in(temp_dir, monkeypatch)
    node = {"node_ip_address": LOOPBACK, "temp_dir": str(temp_dir)}
    cluster = None
    try:
        cluster = two_nodes(Cluster, node)
        config = simulated_system("sim-2node", "h200", workers=2, layout="disaggregated", policy="round_robin",
                                  prefill_fraction=0.5, qps={"server": 2.0}, duration_ms=4000, samples=8,
                                  simulation={"model": "qwen3-vl-30b-a3b", "workers_per_process": 1})
        prefill, decode = config["workers"]["pools"]
        prefill["resources"], decode["resources"] = {"node_a": 1}, {"node_b": 1}
        assert cluster.address.startswith(f"{LOOPBACK}:")
        assert (temp_dir / "ray_current_cluster").read_text() == cluster.address  # not the machine's /tmp/ray
        point = run_point(config, "server", tmp_path, timeout_s=150, ray_address=cluster.address)
        assert point.get("valid"), point
        assert point["completed_qps"] > 1.0
        nodes = {pid: cmd for pid, cmd in descendants(os.getpid()).items() if "ray" in cmd}
        listeners = listening_sockets(nodes)
        assert sum("gcs_server" in one.command for one in listeners) >= 1
        assert sum("raylet" in one.command for one in listeners) >= 2  # both nodes
        outside = [one for one in listeners if not one.loopback]
        assert outside == [], f"the nodes listen outside loopback: {outside}"
        assert (temp_dir / "session_latest").exists()
    finally:
        if cluster is not None:
            cluster.shutdown()
        remove_temp_dir(temp_dir)


def two_nodes(cluster_class, node: dict):
    """The head (node_a) and a second node (node_b), both up. A start that times out (a raylet that did not register
    within Ray's fixed 30 s, CI on 2026-12-07 with the other test worker busy) is made once more, as the harness
    does for its own embedded Ray (harness.ray_workers)."""
    try:
        return _start_two_nodes(cluster_class, node)
    except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception when a node does not come up in time
        if not start_timed_out(exc):
            raise
    return _start_two_nodes(cluster_class, node)


def _start_two_nodes(cluster_class, node: dict):
    cluster = cluster_class()  # no node yet: the first one added is the head
    try:
        cluster.add_node(num_cpus=1, resources={"node_a": 4}, include_dashboard=False, **node)
        cluster.add_node(num_cpus=1, resources={"node_b": 4}, **node)
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster
