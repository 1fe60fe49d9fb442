"""The SUT against an in-test gRPC router double, driven by real LoadGen: every query is completed exactly
once, failures become empty responses plus a failed-samples record, and issue_queries never blocks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import mlperf_loadgen as lg
import pytest

from audit.rules.rounds import FAILED_SAMPLES_FILE
from contract.types import PromptInput
from contract.wire import pb, pb_grpc
from harness.embedded_routing import EmbeddedRouting, ReservedAddress, embedded_routing
from harness.progress import Progress
from harness.qsl import StoreQSL
from harness.sut import FailedSamplesLog, RouterSUT, SUTSettings
from router.config import parse_router_config

ANSWER = '{"category": "A > B", "brand": "x", "is_secondhand": false}'
# What the double does with a request is chosen by the prompt's first token.
OK, ERROR_CHUNK, HANG, RPC_ERROR, CANCEL_FIRST_CALL = 1, 2, 3, 4, 5
BEHAVIOUR = {0: OK, 1: OK, 2: ERROR_CHUNK, 3: HANG, 4: RPC_ERROR, 6: OK, 7: CANCEL_FIRST_CALL}
BAD_PROMPT = 5  # the store could not build this sample's prompt
NUM_SAMPLES = 8
TIMEOUT_S = 1.5


STREAM_INTERVAL = 16


class RouterDouble(pb_grpc.RouterServiceServicer):
    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        behaviour = request.prompt_token_ids[0]
        if behaviour == HANG:
            await asyncio.sleep(3600)
        if behaviour == RPC_ERROR:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy worker")
        if behaviour == ERROR_CHUNK:
            yield pb.GenerateChunk(request_id=request.request_id, finish_reason=pb.ERROR, error="image too large")
            return
        ids = [ord(c) for c in ANSWER]
        if behaviour == CANCEL_FIRST_CALL and not request.resume_token_ids:
            yield pb.GenerateChunk(request_id=request.request_id, token_ids=ids[:5])
            await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        if request.resume_token_ids:  # a re-sent query continues after what it received
            assert list(request.resume_token_ids) == ids[:5]
            yield pb.GenerateChunk(request_id=request.request_id, token_ids=ids[5:], finish_reason=pb.STOP)
            return
        yield pb.GenerateChunk(request_id=request.request_id, token_ids=ids[:5])
        yield pb.GenerateChunk(
            request_id=request.request_id, token_ids=ids[5:], finish_reason=pb.STOP, completion_tokens=len(ids)
        )


@contextlib.contextmanager
def serving(servicer: pb_grpc.RouterServiceServicer):
    """`servicer` on a loopback gRPC server and an event loop of its own; yields its address."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server = grpc.aio.server()
        pb_grpc.add_RouterServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


@pytest.fixture
def router_double():
    servicer = RouterDouble()
    with serving(servicer) as address:
        yield servicer, address


@dataclass
class Prepared:
    prompt: PromptInput | None
    error: str | None


class StoreDouble:
    def __init__(self) -> None:
        self.loaded: set[int] = set()

    def load(self, indices):
        self.loaded.update(indices)

    def unload(self, indices):
        self.loaded.difference_update(indices)

    def get(self, index: int) -> Prepared:
        assert index in self.loaded, f"sample {index} used before load_samples"
        if index == BAD_PROMPT:
            return Prepared(None, "cannot decode image: truncated JPEG")
        return Prepared(PromptInput([BEHAVIOUR[index], 100, 101], [b"jpeg-bytes"]), None)


class GatedRouter(RouterDouble):
    """Answers nothing until `issue_returned` is set; counts the calls that gave up waiting for it (TIMEOUT_S)."""

    def __init__(self) -> None:
        super().__init__()
        self.issue_returned = threading.Event()
        self.answered_before_issue_returned = 0

    async def Generate(self, request, context):
        if not await asyncio.to_thread(self.issue_returned.wait, TIMEOUT_S):
            self.answered_before_issue_returned += 1  # issue_queries was waiting for the router
        async for chunk in super().Generate(request, context):
            yield chunk


class GateOpeningSUT(RouterSUT):
    """Opens its router's gate once LoadGen's issue_queries call has returned."""

    def __init__(self, *args, gate: threading.Event) -> None:
        super().__init__(*args)
        self._gate = gate

    def issue_queries(self, query_samples):
        super().issue_queries(query_samples)
        self._gate.set()


LATENCY_BOUND_S = 12.0


def test_queries_carry_loadgens_target_latency_as_their_bound_and_offline_none():
    from harness.loadgen_run import latency_bound_s
    from harness.scenarios import Scenario

    settings = lg.TestSettings()
    settings.server_target_latency_ns = 1_500_000_000
    assert latency_bound_s(Scenario.INTERACTIVE, settings) == 1.5
    assert latency_bound_s(Scenario.SERVER, settings) == 1.5
    assert latency_bound_s(Scenario.OFFLINE, settings) == 0.0


def run_loadgen(address: str, out: Path, scenario: lg.TestScenario, mode: lg.TestMode,
                reconnect_s: float = 0.0, sut_class=RouterSUT) -> RouterSUT:
    settings = SUTSettings(router_address=address, timeout_s=TIMEOUT_S, stream_interval=STREAM_INTERVAL,
                           reconnect_s=reconnect_s, reconnect_interval_s=0.05, latency_bound_s=LATENCY_BOUND_S)
    return run_sut_test(StoreDouble(), lambda ids: "".join(chr(i) for i in ids), settings, out, scenario, mode,
                        NUM_SAMPLES, sut_class)


def run_sut_test(store, decode, sut_settings: SUTSettings, out: Path, scenario: lg.TestScenario,
                 mode: lg.TestMode, samples: int, sut_class=RouterSUT) -> RouterSUT:
    """One real LoadGen test of `samples` samples through a SUT over `store`; every query completed."""
    settings = lg.TestSettings()
    settings.scenario = scenario
    settings.mode = mode
    settings.min_query_count = samples
    settings.min_duration_ms = 100
    settings.server_target_qps = 50
    settings.offline_expected_qps = 50
    log_settings = lg.LogSettings()
    log_settings.log_output.outdir = str(out)
    log_settings.enable_trace = False
    failed = FailedSamplesLog(out / FAILED_SAMPLES_FILE)
    qsl = StoreQSL(store, samples, samples)
    sut = sut_class(store, decode, sut_settings, failed, Progress("test", enabled=False))
    try:
        lg.StartTestWithLogSettings(sut.handle, qsl.handle, settings, log_settings, str(out / "audit.config"))
        assert sut.outstanding == 0
    finally:
        sut.close()
        qsl.close()
        failed.close()
    return sut


def read_failed(out: Path) -> dict[int, str]:
    records = json.loads((out / FAILED_SAMPLES_FILE).read_text())
    return {r["sample_index"]: r["error"] for r in records}


def test_accuracy_run_completes_every_sample_once_with_failures_empty(router_double, tmp_path):
    servicer, address = router_double
    run_loadgen(address, tmp_path, lg.TestScenario.Offline, lg.TestMode.AccuracyOnly)

    entries = json.loads((tmp_path / "mlperf_log_accuracy.json").read_text())
    by_index = {}
    for entry in entries:
        assert entry["qsl_idx"] not in by_index, f"sample {entry['qsl_idx']} answered twice"
        by_index[entry["qsl_idx"]] = bytes.fromhex(entry["data"]).decode("utf-8")
    assert sorted(by_index) == list(range(NUM_SAMPLES))
    failed_indices = {2, 3, 4, 7, BAD_PROMPT}
    for index, text in by_index.items():
        assert text == ("" if index in failed_indices else ANSWER), index

    failed = read_failed(tmp_path)
    assert set(failed) == failed_indices
    assert "image too large" in failed[2]
    assert "no response within" in failed[3]
    assert "UNAVAILABLE" in failed[4]
    assert "CANCELLED" in failed[7]  # no reconnect window: a cancelled call fails its sample
    assert "truncated JPEG" in failed[BAD_PROMPT]
    # The bad prompt never reached the router; every other sample did, once, with the MLPerf sampling.
    sent = [r for r in servicer.requests]
    assert len(sent) == NUM_SAMPLES - 1
    assert all(r.sampling.use_model_defaults and r.sampling.max_tokens == 150 for r in sent)
    assert all(list(r.images) == [b"jpeg-bytes"] for r in sent)


def test_a_query_whose_router_call_is_cancelled_is_sent_again_after_the_tokens_it_received(router_double, tmp_path):
    servicer, address = router_double
    sut = run_loadgen(address, tmp_path, lg.TestScenario.Offline, lg.TestMode.AccuracyOnly, reconnect_s=1.0)
    answers = {e["qsl_idx"]: bytes.fromhex(e["data"]).decode("utf-8")
               for e in json.loads((tmp_path / "mlperf_log_accuracy.json").read_text())}
    assert answers[7] == ANSWER  # whole, each token once
    assert 7 not in read_failed(tmp_path)
    attempts = [r for r in servicer.requests if r.prompt_token_ids[0] == CANCEL_FIRST_CALL]
    assert [len(r.resume_token_ids) for r in attempts] == [0, 5]
    assert attempts[1].sampling.max_tokens == attempts[0].sampling.max_tokens - 5
    assert sut.resent >= 1
    # UNAVAILABLE is re-sent too, until the window passes without progress; then the sample fails as before
    assert "UNAVAILABLE" in read_failed(tmp_path)[4]


def test_issue_queries_returns_before_the_router_has_answered_anything(tmp_path):
    router = GatedRouter()  # holds every answer until issue_queries has returned
    with serving(router) as address:
        run_loadgen(address, tmp_path, lg.TestScenario.Offline, lg.TestMode.PerformanceOnly,
                    sut_class=functools.partial(GateOpeningSUT, gate=router.issue_returned))
    assert router.requests and router.answered_before_issue_returned == 0  # (run_sut_test: every query completed)


def test_server_run_completes_every_issued_query(router_double, tmp_path):
    router, address = router_double
    sut = run_loadgen(address, tmp_path, lg.TestScenario.Server, lg.TestMode.PerformanceOnly)
    assert {r.stream_interval for r in router.requests} == {STREAM_INTERVAL}  # the SUT asks for batched chunks
    assert {r.latency_bound_s for r in router.requests} == {LATENCY_BOUND_S}  # and says what its bound is
    issued, completed, failed = sut.progress.counts
    assert issued == completed >= NUM_SAMPLES
    assert failed == len(json.loads((tmp_path / FAILED_SAMPLES_FILE).read_text())) > 0
    assert "Scenario : Server" in (tmp_path / "mlperf_log_summary.txt").read_text()


class TextStore:
    """Every sample a text prompt of its own."""

    def load(self, indices):
        pass

    def unload(self, indices):
        pass

    def get(self, index: int) -> Prepared:
        return Prepared(PromptInput([index + 1, 100, 101], []), None)


@contextlib.contextmanager
def small_cluster(router: dict, embedded_at: str | None = None):
    """One instant worker (5 ms a step) behind a real router from `router` (a RouterConfig dict), on an event loop
    of its own; with embedded_at, the worker registers there too (where an embedded SUT's router listens)."""
    from tests.helpers.router_fixtures import Cluster

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cluster = Cluster(roles=("aggregated",), step_delay_s=0.005, config=router, also_register_at=embedded_at)
    asyncio.run_coroutine_threadsafe(cluster.__aenter__(), loop).result(30)
    try:
        yield cluster
    finally:
        asyncio.run_coroutine_threadsafe(cluster.__aexit__(None, None, None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def sut_routing(mode: str, router: dict, address: str) -> EmbeddedRouting | None:
    """The SUT's EmbeddedRouting for router.mode `mode`: its own router from `router`, listening at `address`."""
    if mode == "process":
        return None
    from tests.helpers.router_fixtures import FAST_HEALTH

    return embedded_routing(parse_router_config({"health": FAST_HEALTH} | router | {"listen": address}), workers=1)


def offline_through_a_small_router(tmp_path: Path, max_inflight: int | None, mode: str = "process"
                                   ) -> dict[int, str]:
    """32 Offline samples through a real router (one instant worker, 2 calls in flight, 2 queued), routed as `mode`
    says (router.mode); LoadGen on this thread, as the harness runs it. Returns the failed samples."""
    samples = 32
    tmp_path.mkdir(parents=True)
    router = {"limits": {"max_inflight_per_worker": 2, "max_queue": 2}}
    with ReservedAddress() as reserved, small_cluster(router, reserved.address if mode == "embedded" else None
                                                      ) as cluster:
        settings = SUTSettings(router_address=cluster.router.address, max_tokens=8, max_inflight=max_inflight,
                               embedded=sut_routing(mode, router, reserved.address))
        run_sut_test(TextStore(), lambda ids: "x" * len(ids), settings, tmp_path, lg.TestScenario.Offline,
                     lg.TestMode.PerformanceOnly, samples)
    return read_failed(tmp_path)


@pytest.mark.parametrize("mode", ["process", "embedded"])
def test_an_offline_test_larger_than_the_router_admits_answers_every_sample(mode, tmp_path):
    # LoadGen issues all 32 at once; the router takes 4 (2 running, 2 queued) and refuses the rest, so the SUT
    # keeps the others until a call ends; the router's admission is the same code whichever process it runs in
    assert offline_through_a_small_router(tmp_path / "bounded", max_inflight=4, mode=mode) == {}
    refused = offline_through_a_small_router(tmp_path / "unbounded", max_inflight=None, mode=mode)
    assert refused and all("RESOURCE_EXHAUSTED" in error for error in refused.values())


def test_an_embedded_sut_routes_in_its_own_process_straight_to_the_workers(tmp_path):
    # router.mode embedded: the workers register with the SUT's own router as well as with the router process,
    # and every query goes from the SUT to a worker, none through the router process
    with ReservedAddress() as reserved, small_cluster({}, reserved.address) as cluster:
        settings = SUTSettings(router_address=cluster.router.address, max_tokens=8,
                               embedded=sut_routing("embedded", {}, reserved.address))
        run_sut_test(TextStore(), lambda ids: "x" * len(ids), settings, tmp_path, lg.TestScenario.Offline,
                     lg.TestMode.AccuracyOnly, 6)
        engine_requests = cluster.engines[0].requests_seen
        via_router_process = cluster.router.dispatcher.metrics.render()
    entries = json.loads((tmp_path / "mlperf_log_accuracy.json").read_text())
    answers = [bytes.fromhex(e["data"]).decode() for e in entries]
    assert answers == ["x" * 8] * 6 and read_failed(tmp_path) == {}
    assert len(engine_requests) == 6
    assert b"q3vl_router_requests_total{" not in via_router_process  # the router process counted no request


def test_an_embedded_sut_whose_workers_never_register_fails_at_start_naming_them(tmp_path):
    with ReservedAddress() as reserved:  # no worker registers there
        routing = sut_routing("embedded", {}, reserved.address)
        settings = SUTSettings(router_address="127.0.0.1:1", embedded=dataclasses.replace(routing, ready_timeout_s=0.3))
        with pytest.raises(TimeoutError, match="0 of 1 workers registered"):
            RouterSUT(TextStore(), str, settings, FailedSamplesLog(tmp_path / "failed.json"))
        assert "sut-event-loop" not in {thread.name for thread in threading.enumerate()}  # none left behind


class LingeringRouter(pb_grpc.RouterServiceServicer):
    """Ends each call a while after its final chunk, as a router does while it frees the call's worker slot;
    counts the calls open at once, and those the caller cancelled."""

    def __init__(self) -> None:
        self.open = 0
        self.most_open = 0
        self.cancelled = 0

    async def Generate(self, request, context):
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            yield pb.GenerateChunk(request_id=request.request_id, token_ids=[120], finish_reason=pb.STOP)
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.open -= 1


def test_a_sut_slot_is_freed_when_the_router_ends_the_call_not_at_its_final_chunk(tmp_path):
    # The router counts a call against its admission limits until the call ends: a SUT that sent its next query
    # at the previous one's final chunk would be refused RESOURCE_EXHAUSTED now and then (CI saw 3 of 32)
    router = LingeringRouter()
    with serving(router) as address:
        run_sut_test(TextStore(), lambda ids: "x" * len(ids), SUTSettings(router_address=address, max_inflight=1),
                     tmp_path, lg.TestScenario.Offline, lg.TestMode.PerformanceOnly, 6)
    assert read_failed(tmp_path) == {}
    assert router.cancelled == 0  # each call read to its end, not cancelled once its answer was in
    assert router.most_open == 1


class CancelledAfterItsAnswer(pb_grpc.RouterServiceServicer):
    """Sends a whole answer (ending STOP), then the call ends CANCELLED."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        yield pb.GenerateChunk(request_id=request.request_id, token_ids=[ord(c) for c in ANSWER],
                               finish_reason=pb.STOP)
        await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")


def test_a_call_that_fails_after_its_final_chunk_keeps_its_answer_and_is_not_sent_again(tmp_path):
    router = CancelledAfterItsAnswer()
    with serving(router) as address:
        settings = SUTSettings(router_address=address, reconnect_s=1.0, reconnect_interval_s=0.05)
        run_sut_test(TextStore(), lambda ids: "".join(chr(i) for i in ids), settings, tmp_path,
                     lg.TestScenario.Offline, lg.TestMode.AccuracyOnly, 3)
    answers = [bytes.fromhex(e["data"]).decode("utf-8")
               for e in json.loads((tmp_path / "mlperf_log_accuracy.json").read_text())]
    assert answers == [ANSWER] * 3
    assert read_failed(tmp_path) == {}
    assert len(router.requests) == 3  # a re-sent query would have continued past its stop


def test_the_sut_bound_is_what_the_routers_admit_without_refusing():
    from harness.system_config import load_system_config, sut_inflight_bound

    config = load_system_config(Path(__file__).resolve().parents[1] / "mlperf_configs" / "h200x8.yaml")
    # two workers of 512 calls each (the router's defaults), and as many queued
    assert sut_inflight_bound(config) == 2 * 512 + 1024
    pinned = config.model_copy(update={"requests": config.requests.model_copy(update={"max_inflight": 300})})
    assert sut_inflight_bound(pinned) == 300
