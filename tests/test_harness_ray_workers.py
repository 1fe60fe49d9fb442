"""Workers as Ray actors (with the router's model-free InstantEngine): they register with the router, serve
through it, and an actor that dies is restarted by Ray and registers again at its new address."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from contract.wire import pb
from harness.ray_network import temp_dirs_of
from harness.ray_workers import (GCS_PORT_WAIT_S, RAY_GCS_WAIT_ENV, ServedEngine, WorkerFleet, WorkerSpec, _node_address,
                                 init_ray)
from harness.system_config import PoolSection, RaySection
from lab.soak.process_tree import descendants
from router.client import RouterClient
from router.config import RouterConfig
from router.server import RouterServer
from tests.helpers.net_fixtures import listening_sockets
from workers.serve.worker_build import WorkerSettings
from workers.sim.instant_engine import InstantEngine


@pytest.fixture(scope="module")
def router():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = RouterServer(RouterConfig(health={"heartbeat_interval_s": 0.2, "down_after_s": 1.0}))
    asyncio.run_coroutine_threadsafe(server.start(), loop).result()

    def call(coro_fn):
        async def run():
            async with RouterClient(server.address) as client:
                return await coro_fn(client)

        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=60)

    yield server.address, call
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


@pytest.fixture(scope="module")
def fleet(router):
    address, _ = router
    session = init_ray(RaySection(num_cpus=2, num_gpus=0, object_store_memory_mb=80), address=None)

    def instant_engine() -> ServedEngine:  # nested: Ray ships it by value (tests/ is not importable there)
        engine = InstantEngine(step_delay_s=0.001)
        return ServedEngine(engine, engine.generation_defaults)

    template = WorkerSpec(WorkerSettings("", router_address=address, heartbeat_interval_s=0.2), instant_engine)
    pools = [PoolSection(role="prefill", count=1, cpus_per_worker=0.5),
             PoolSection(role="decode", count=1, cpus_per_worker=0.5)]
    fleet = WorkerFleet(pools, template)
    fleet.start()
    yield fleet
    fleet.stop()
    session.close()


def registered(call) -> dict[str, tuple[str, int, bool]]:
    listing = call(lambda c: c.list_workers())
    return {w.worker_id: (w.address, w.role, ok) for w, ok in zip(listing.workers, listing.healthy)}


def wait_for(predicate, timeout_s: float = 60.0, state=None):
    """predicate's first truthy value within timeout_s; else fails, with state() (what was seen) in the message."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"condition not reached in {timeout_s} s" + (f": {state()}" if state else ""))


@pytest.mark.slow
def test_actors_register_serve_and_come_back_after_a_crash(router, fleet):
    _, call = router
    addresses = fleet.addresses(timeout_s=60)
    assert set(addresses) == {"prefill-0", "decode-0"}
    workers = wait_for(lambda: (w := registered(call)) and len(w) == 2 and all(ok for *_, ok in w.values()) and w)
    assert workers["prefill-0"][1] == pb.PREFILL and workers["decode-0"][1] == pb.DECODE
    assert {w[0] for w in workers.values()} == set(addresses.values())

    async def generate(client):
        request = pb.GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3],
                                     sampling=pb.SamplingParams(max_tokens=5))
        return [chunk async for chunk in client.generate(request)]

    chunks = call(generate)
    assert sum(len(c.token_ids) for c in chunks) == 5 and chunks[-1].finish_reason == pb.LENGTH

    old_address = addresses["decode-0"]
    fleet.kill("decode-0")
    new_address = wait_for(lambda: (a := fleet.addresses(timeout_s=60)["decode-0"]) != old_address and a)
    wait_for(lambda: registered(call).get("decode-0", ("", 0, False))[0] == new_address)
    assert registered(call)["decode-0"][2]


@pytest.mark.slow
def test_the_embedded_ray_and_its_workers_listen_and_advertise_loopback_only(fleet):
    addresses = fleet.addresses(timeout_s=60)
    assert all(address.startswith("127.0.0.1:") for address in addresses.values()), addresses
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    assert {_node_address(instance.group) for instance in fleet.instances} == {"127.0.0.1"}  # a kv link's host
    ray_processes = {pid: cmd for pid, cmd in descendants(os.getpid()).items() if "ray" in cmd}
    listeners = listening_sockets({os.getpid(): "pytest", **ray_processes})
    assert any("raylet" in one.command for one in listeners) and any("gcs_server" in one.command for one in listeners)
    outside = [one for one in listeners if not one.loopback]
    assert outside == [], f"listening outside loopback: {outside}"


RAY_DASHBOARD_PORT = 8265  # ray_constants.DEFAULT_DASHBOARD_PORT


@pytest.mark.slow
def test_the_embedded_rays_dashboard_process_runs_minimal_with_no_web_ui(fleet):
    """What the README says runs: include_dashboard=False leaves Ray's dashboard process up, with its usage-stats
    module alone and the frontend off, and nothing listening on the dashboard's port. This fleet's Ray's alone (a
    Ray that an earlier test file in this process shut down may not have reaped its dashboard yet), and once there is
    exactly one (CI saw none for a moment once, and two once: a dashboard is not always up at a given instant; and
    on 2026-12-07 none for 30 s, on a loaded machine: so up to 90 s, and Ray's processes named if it fails)."""
    ours = f"--gcs-address={ray.get_runtime_context().gcs_address}"

    def ray_processes() -> dict[int, str]:
        return {pid: cmd for pid, cmd in descendants(os.getpid()).items() if "ray" in cmd}

    def one_dashboard() -> tuple[dict[int, str], str] | None:
        processes = ray_processes()
        found = [cmd for cmd in processes.values() if "dashboard/dashboard.py" in cmd and ours in cmd]
        return (processes, found[0]) if len(found) == 1 else None

    processes, dashboard = wait_for(one_dashboard, timeout_s=90,
                                    state=lambda: f"this Ray's {ours}; Ray's processes {ray_processes()}")
    assert "--disable-frontend" in dashboard and "--modules-to-load=UsageStatsHead" in dashboard
    assert any("ray::DashboardAgent" in cmd for cmd in processes.values())  # each raylet starts its agents
    assert RAY_DASHBOARD_PORT not in {one.port for one in listening_sockets(processes)}


def test_an_embedded_ray_that_times_out_starting_is_started_once_more(monkeypatch):
    calls = []

    def init(**kwargs):
        calls.append("init")
        if calls.count("init") == 1:
            raise Exception("The current node timed out during startup.")  # what Ray raises

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    session = init_ray(RaySection(num_cpus=1), address=None)
    assert session.owned and calls == ["init", "shutdown", "init"]
    session.close()


def test_an_embedded_ray_whose_gcs_server_never_published_its_port_is_started_once_more(monkeypatch, caplog):
    calls = []

    def init(**kwargs):
        calls.append("init")
        if calls.count("init") == 1:
            session = Path(kwargs["_temp_dir"]) / "session_1" / "logs"
            session.mkdir(parents=True)
            (session / "gcs_server.err").write_text("starting\nbind failed: address in use\n")
            raise RuntimeError(f"Timed out waiting for file {session.parent}/gcs_server_port_0a1b")  # what Ray raises

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    with caplog.at_level(logging.WARNING, logger="harness.ray_workers"):
        session = init_ray(RaySection(num_cpus=1), address=None)
    assert session.owned and calls == ["init", "shutdown", "init"]
    session.close()
    assert "gcs_server.err: starting | bind failed: address in use" in caplog.text  # its own words, in the warning


def test_an_embedded_ray_that_fails_otherwise_is_not_started_again(monkeypatch):
    calls = []

    def init(**kwargs):
        calls.append("init")
        raise RuntimeError("Timed out waiting for file /tmp/x/raylet_socket")  # not the GCS server's port

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    with pytest.raises(RuntimeError, match="raylet_socket"):
        init_ray(RaySection(num_cpus=1), address=None)
    assert calls.count("init") == 1


@pytest.mark.parametrize("operator", [None, "45"])
def test_the_embedded_ray_waits_longer_for_its_gcs_unless_the_operator_says(monkeypatch, operator):
    if operator is None:
        monkeypatch.delenv(RAY_GCS_WAIT_ENV, raising=False)
    else:
        monkeypatch.setenv(RAY_GCS_WAIT_ENV, operator)
    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.append(os.environ.get(RAY_GCS_WAIT_ENV)))
    session = init_ray(RaySection(num_cpus=1), address=None)
    session.close()
    assert seen == [operator or str(GCS_PORT_WAIT_S)] and GCS_PORT_WAIT_S > 30  # Ray's own default is 30 s
    assert os.environ.get(RAY_GCS_WAIT_ENV) == operator  # as it was once Ray is up


@pytest.mark.slow
def test_the_embedded_ray_is_our_own_even_with_another_cluster_running():
    """Another Ray cluster on the machine (another run's, a stray one) is what ray.init would join without an
    address (it is the latest in /tmp/ray/ray_current_cluster), and then refuse num_cpus; the embedded start makes
    a Ray of its own."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    head = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--port=0", "--num-cpus=3",
         "--include-dashboard=false", "--block"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )
    try:
        up = threading.Event()
        threading.Thread(target=lambda: [up.set() for line in head.stdout if "Ray runtime started" in line],
                         daemon=True).start()
        assert up.wait(90), "the other cluster did not come up"
        probe = (
            "from harness.system_config import RaySection\n"
            "from harness.ray_workers import init_ray\n"
            "import ray\n"
            "session = init_ray(RaySection(num_cpus=1, num_gpus=0), address=None)\n"
            "assert session.owned\n"
            "print(int(ray.cluster_resources()['CPU']))\n"
            "session.close()\n"
        )
        done = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parent.parent, env=env,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split()[-1] == "1"  # its own single CPU, not the other cluster's three
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)


def test_other_embedded_ray_start_errors_are_not_retried(monkeypatch):
    def init(**kwargs):
        raise ValueError("object_store_memory is too small")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    before = temp_dirs_of(os.getpid())  # another test's embedded Ray may be up
    with pytest.raises(ValueError, match="too small"):
        init_ray(RaySection(num_cpus=1), address=None)
    assert temp_dirs_of(os.getpid()) == before  # the failed start's session-file directory is gone
