"""Hostile network input against the real router process (`python -m router`): malformed protobuf, oversized
messages, calls without the token on a non-local bind, remote image URLs, and a flood beyond admission. And the
run's own footprint: a cpu-tiny run listens on loopback only (router, workers, Ray), removes its Ray session
files, and an unreachable --ray-address fails in bounded time."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import grpc.aio
import pytest
import yaml
from PIL import Image

from contract.transport import call_metadata
from contract.wire import pb
from harness.ray_network import RayUnreachable, probe_address, temp_dirs_of
from harness.system_config import CONFIG_DIR
from lab.soak.fault_soak import HarnessRun, free_port, soak_system
from lab.soak.process_tree import descendants
from router.client import RouterClient
from tests.helpers.net_fixtures import listening_sockets
from tests.helpers.router_fixtures import request, run
from workers.serve.server import WorkerServer
from workers.serve.worker_build import WorkerSettings
from workers.sim.instant_engine import InstantEngine

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "tests" / "harness"
TOKEN = "s3cret-token"
MAX_MESSAGE = 1024 * 1024
LIMITS = {"max_inflight_total": 4, "max_inflight_per_worker": 4, "max_queue": 8, "max_message_bytes": MAX_MESSAGE}
FLOOD = 400  # requests per flood round, all at once
GENERATE = "/q3vl.v1.RouterService/Generate"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """The router process bound to 0.0.0.0 (so it needs the token), reached only via 127.0.0.1."""
    tmp = tmp_path_factory.mktemp("hostile")
    config = {"listen": "0.0.0.0:0", "http_listen": "127.0.0.1:0", "token": TOKEN, "limits": LIMITS,
              "health": {"heartbeat_interval_s": 0.2, "down_after_s": 2.0}}
    (tmp / "router.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "router", "--config", str(tmp / "router.yaml")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=open(tmp / "router.log", "w"), text=True)
    try:
        port = int(proc.stdout.readline().split(":")[-1])
        http_port = int(proc.stdout.readline().split(":")[-1])
        yield {"address": f"127.0.0.1:{port}", "http": f"http://127.0.0.1:{http_port}", "pid": proc.pid}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Workers:
    """Two instant-engine workers (a test double for the engine) registered with the router process."""

    def __init__(self, address: str, step_delay_s: float = 0.002):
        self.engines = [InstantEngine(step_delay_s=step_delay_s) for _ in range(2)]
        self.servers = [WorkerServer(e, WorkerSettings(f"w{i}", router_address=address, token=TOKEN,
                                                       heartbeat_interval_s=0.2))
                        for i, e in enumerate(self.engines)]
        self.client = RouterClient(address, token=TOKEN)

    async def __aenter__(self) -> Workers:
        for server in self.servers:
            await server.start()
        await self.client.wait_for_workers(2, timeout=20)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        for server in self.servers:
            await server.stop(0)


async def served(client: RouterClient, rid: str, max_tokens: int = 4) -> list[int]:
    tokens = []
    async for chunk in client.generate(request(rid, max_tokens=max_tokens)):
        tokens.extend(chunk.token_ids)
        assert chunk.finish_reason in (pb.FINISH_REASON_UNSPECIFIED, pb.LENGTH, pb.STOP)
    return tokens


def test_malformed_protobuf_bytes_are_refused_and_the_router_keeps_serving(router):
    async def body():
        async with Workers(router["address"]) as w:
            channel = grpc.aio.insecure_channel(router["address"])
            raw = channel.unary_stream(GENERATE, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            for garbage in (b"\xff" * 64, b"\x0a\xff\xff\xff\xff\x0f", random.Random(0).randbytes(4096)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in raw(garbage, metadata=call_metadata(TOKEN)):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"{GENERATE}: request is not a valid message" in err.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as err:  # without the token, nothing is parsed or said
                    async for _ in raw(garbage):
                        pass
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await channel.close()
            assert len(await served(w.client, "after-garbage")) == 4

    run(body())


def test_messages_over_the_configured_maximum_get_resource_exhausted(router):
    async def body():
        async with Workers(router["address"]) as w:
            big = request("too-big", images=[os.urandom(MAX_MESSAGE + 1024)])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [c async for c in w.client.generate(big)]
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len(await served(w.client, "after-big")) == 4

    run(body())


def test_calls_without_or_with_a_wrong_token_on_a_non_local_bind_are_unauthenticated(router):
    async def body():
        async with Workers(router["address"]):
            for token in (None, "wrong"):
                async with RouterClient(router["address"], token=token) as stranger:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stranger.list_workers()
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        [c async for c in stranger.generate(request(f"stranger-{token}"))]
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    # A worker registration from a stranger is refused too (nobody can hijack traffic).
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stranger._stub.RegisterWorker(pb.WorkerInfo(worker_id="evil", address="127.0.0.1:1"),
                                                            metadata=call_metadata(token))
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

    run(body())


class RecordingHandler(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's naming)
        RecordingHandler.hits.append(self.path)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def router_gauge(base: str, name: str, token: str | None = TOKEN) -> float:
    """One of the router's Prometheus gauges, read from its /metrics page."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(f"{base}/metrics", headers=headers), timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not on {base}/metrics")


def wait_for_full_admission(base: str, timeout_s: float = 60.0) -> None:
    """Until the router holds max_inflight_total requests in flight and max_queue waiting (no fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while (router_gauge(base, "q3vl_router_inflight_requests") < LIMITS["max_inflight_total"]
           or router_gauge(base, "q3vl_router_queue_depth") < LIMITS["max_queue"]):
        assert time.monotonic() < deadline, "admission never filled"
        time.sleep(0.05)


def post_chat(base: str, body: dict, token: str | None = TOKEN) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


SERVED_MODEL = "Qwen/Qwen3-VL-235B-A22B-Instruct"  # the router's served_model_name: others get 404


def test_remote_image_urls_get_400_and_are_never_fetched(router):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RecordingHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for scheme in ("http", "https"):
            url = f"{scheme}://127.0.0.1:{server.server_port}/product.jpg"
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                     {"type": "text", "text": "What is this?"}]}]
            status, reply = post_chat(router["http"], {"model": SERVED_MODEL, "messages": messages, "max_tokens": 4})
            assert status == 400, reply
            assert "remote image URLs are not fetched" in reply["error"]["message"]
        assert RecordingHandler.hits == []
    finally:
        server.shutdown()
        server.server_close()


def png_data_url() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 200, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_a_flood_beyond_admission_is_refused_fast_and_the_router_stays_healthy_with_bounded_memory(router):
    async def flood(client: RouterClient, round_: int) -> tuple[int, int]:
        async def one(i: int) -> str:
            try:
                await served(client, f"flood-{round_}-{i}")
                return "ok"
            except grpc.aio.AioRpcError as exc:
                return exc.code().name

        outcomes = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(FLOOD))), 60)
        assert set(outcomes) <= {"ok", "RESOURCE_EXHAUSTED"}, set(outcomes)
        return outcomes.count("ok"), outcomes.count("RESOURCE_EXHAUSTED")

    async def body():
        async with Workers(router["address"], step_delay_s=0.01) as w:
            await flood(w.client, 0)  # warms allocator pools and caches
            before = rss_kib(router["pid"])
            totals = [await flood(w.client, r) for r in range(1, 4)]
            after = rss_kib(router["pid"])
            assert all(ok >= LIMITS["max_inflight_total"] and refused > 0 for ok, refused in totals), totals
            assert after - before < 20 * 1024, f"router RSS grew {before} -> {after} KiB over {3 * FLOOD} requests"
            listing = await w.client.list_workers()
            assert all(listing.healthy)
            assert len(await served(w.client, "after-flood")) == 4

    run(body(), timeout=240)


def test_http_flood_gets_429_and_health_stays_ok(router):
    async def body():
        async with Workers(router["address"], step_delay_s=0.05) as w:
            held = [asyncio.ensure_future(served(w.client, f"hold-{i}", max_tokens=40)) for i in range(12)]
            await asyncio.to_thread(wait_for_full_admission, router["http"])  # 4 in flight + 8 queued
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url()}},
                                                     {"type": "text", "text": "Describe it."}]}]
            status, reply = await asyncio.to_thread(
                post_chat, router["http"], {"model": SERVED_MODEL, "messages": messages, "max_tokens": 4})
            assert status == 429, reply
            await asyncio.gather(*held)
            with urllib.request.urlopen(f"{router['http']}/health", timeout=10) as health:
                assert json.loads(health.read())["status"] == "healthy"

    run(body(), timeout=60)


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A cpu-tiny Server run (router, two Ray workers, LoadGen), caught with requests in flight."""
    tmp = tmp_path_factory.mktemp("live-run")
    harness_run = HarnessRun(soak_system(tmp, 12, qps=1.0), tmp / "out", CACHE).start()
    try:
        harness_run.wait_for_loadgen()
        assert harness_run.wait_for_inflight(1), harness_run.process.communicate()[1][-3000:]
        yield harness_run
    finally:
        if harness_run.process.poll() is None:
            harness_run.process.terminate()
            harness_run.process.wait(timeout=120)


@pytest.mark.slow
def test_no_process_of_a_cpu_tiny_run_listens_outside_loopback(live_run):
    processes = {live_run.pid: "harness", **descendants(live_run.pid)}
    listeners = listening_sockets(processes)
    for kind, marker in {"gcs_server": "gcs_server", "raylet": "raylet", "router": " -m router ",
                         "worker": "ray::ModelWorker"}.items():  # the check covers every kind of listener
        assert any(marker in f" {one.command} " for one in listeners), f"no {kind} listener found: {listeners}"
    outside = [one for one in listeners if not one.loopback]
    assert outside == [], f"listening outside loopback: {outside}"


@pytest.mark.slow
def test_an_interrupted_run_removes_its_ray_session_files(live_run):
    [temp_dir] = temp_dirs_of(live_run.pid)
    assert (temp_dir / "session_latest").exists()  # Ray's session files are in the harness's own directory
    live_run.process.send_signal(signal.SIGTERM)
    live_run.process.wait(timeout=120)
    assert live_run.process.returncode == 130
    assert not temp_dir.exists()


def test_an_unreachable_ray_address_fails_in_the_configured_time_naming_it_and_leaves_nothing_running(tmp_path):
    data = yaml.safe_load((CONFIG_DIR / "cpu-tiny.yaml").read_text())
    data["ray"]["connect_timeout_s"] = 1.0
    system = tmp_path / "cpu-tiny-join.yaml"
    system.write_text(yaml.safe_dump(data))
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    child = subprocess.Popen(
        [sys.executable, "-m", "harness", "--scenario", "offline", "--system", str(system), "--ray-address", address,
         "--output", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        _, stderr = child.communicate(timeout=120)  # Ray's own connect would retry for over ten minutes
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    assert child.returncode == 2, stderr
    [line] = stderr.strip().splitlines()
    assert f"--ray-address {address}: no Ray cluster answered within 1 s" in line
    with pytest.raises(ProcessLookupError):  # nothing of the run's process group is left
        os.killpg(child.pid, 0)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_a_ray_address_that_accepts_connections_passes_the_probe_and_a_malformed_one_is_named():
    with socket.create_server(("127.0.0.1", 0)) as server:
        probe_address(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=5)
        probe_address(f"ray://127.0.0.1:{server.getsockname()[1]}", timeout_s=5)
    with pytest.raises(RayUnreachable, match="--ray-address head-node: not host:port"):
        probe_address("head-node", timeout_s=5)
