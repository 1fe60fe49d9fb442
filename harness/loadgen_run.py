"""One LoadGen test in this process (`python -m harness run-test ...`): the QSL over the sample store, the
router SUT and settings from user.conf; LoadGen's logs and the failed-samples record land in the test's log dir.
With router.mode embedded the SUT routes in this process (harness/embedded_routing.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import mlperf_loadgen as lg

from audit.rules.rounds import FAILED_SAMPLES_FILE
from contract.dataset import load_catalogue
from contract.prompt import PromptBuilder
from contract.tokenizer import load_tokenizer
from harness.assets import resolve_dataset
from harness.embedded_routing import LOG_FILE, EmbeddedRouting, embedded_routing, log_router_to
from harness.progress import Progress
from harness.qsl import StoreQSL
from harness.sample_store import SampleStore
from harness.scenarios import LoadGenMode, Scenario, log_dir_for
from harness.sut import FailedSamplesLog, RouterSUT, SUTSettings
from harness.system_config import (
    DATASET_FOR_SCENARIO,
    SystemConfig,
    image_pixel_limits,
    load_system_config,
    router_config,
    sut_inflight_bound,
)
from harness.user_conf import expected_sample_count, load_test_settings

logger = logging.getLogger(__name__)

TRACE_FILE = "mlperf_log_trace.json"


@dataclass(frozen=True)
class LoadGenTestSpec:
    system: str  # a system name or a YAML path
    scenario: Scenario
    test: LoadGenMode
    router_address: str
    scenario_dir: Path  # holds user.conf; the test's logs go to log_dir_for(scenario_dir, test)
    cache_dir: Path
    show_progress: bool = True
    embedded_router: str | None = None  # router.mode embedded: the Cluster's address for this process's router


def latency_bound_s(scenario: Scenario, settings: lg.TestSettings) -> float:
    """The latency bound each query carries to the workers' schedulers: LoadGen's own target latency for the test
    (mlperf.conf with user.conf over it: 12 s Server, 1.5 s Interactive), none for Offline."""
    if scenario is Scenario.OFFLINE:
        return 0.0
    return settings.server_target_latency_ns / 1e9


def sut_routing(config: SystemConfig, spec: LoadGenTestSpec) -> EmbeddedRouting | None:
    """How the SUT reaches the workers: None for the router process at spec.router_address; with router.mode
    embedded, a router of its own at spec.embedded_router, logging to the scenario dir's embedded-router.log."""
    if (spec.embedded_router is not None) != (config.router_mode == "embedded"):
        given = "an --embedded-router address" if spec.embedded_router else "no --embedded-router address"
        raise ValueError(f"router.mode is {config.router_mode}, but this test was given {given}")
    if spec.embedded_router is None:
        return None
    log_router_to(spec.scenario_dir / LOG_FILE)
    routing = embedded_routing(router_config(config, spec.embedded_router), config.workers.num_workers)
    logger.info("routing in this process; its router listens for the workers on %s", spec.embedded_router)
    return routing


def run_loadgen_test(spec: LoadGenTestSpec) -> Path:
    """Runs the test to its end and returns the directory holding LoadGen's logs."""
    config = load_system_config(spec.system).for_scenario(spec.scenario.value)
    section = config.scenario(spec.scenario.value)
    kind = DATASET_FOR_SCENARIO[spec.scenario.value]
    dataset = config.dataset(spec.scenario.value)
    min_pixels, max_pixels = image_pixel_limits(config)
    catalogue = load_catalogue(resolve_dataset(dataset, kind, spec.cache_dir), kind)
    tokenizer = load_tokenizer()
    store = SampleStore(catalogue, PromptBuilder(tokenizer, dataset.prompt_variant, min_pixels, max_pixels))
    settings = load_test_settings(spec.scenario_dir / "user.conf", spec.scenario, spec.test)

    log_dir = log_dir_for(spec.scenario_dir, spec.test)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_settings = lg.LogSettings()
    log_settings.log_output.outdir = str(log_dir)
    log_settings.enable_trace = spec.test is LoadGenMode.PERFORMANCE  # per-sample latencies for the plot

    failed = FailedSamplesLog(log_dir / FAILED_SAMPLES_FILE)
    progress = Progress(
        f"{spec.scenario.result_dir_name} {spec.test.value}",
        total=expected_sample_count(settings, len(catalogue), section.performance_sample_count),
        enabled=spec.show_progress,
    )
    qsl = StoreQSL(store, len(catalogue), section.performance_sample_count)
    sut = RouterSUT(
        store,
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        SUTSettings(
            router_address=spec.router_address,
            max_tokens=config.requests.max_tokens,
            timeout_s=config.requests.timeout_s,
            reconnect_s=config.requests.reconnect_s,
            stream_interval=config.requests.stream_interval,
            latency_bound_s=latency_bound_s(spec.scenario, settings),
            max_inflight=sut_inflight_bound(config),
            token=config.router.get("token"),
            report_first_token=settings.use_token_latencies,
            embedded=sut_routing(config, spec),
        ),
        failed,
        progress,
    )
    try:
        # A missing audit.config path: compliance overrides must never be picked up from the CWD by accident.
        lg.StartTestWithLogSettings(sut.handle, qsl.handle, settings, log_settings, str(log_dir / "audit.config"))
    finally:
        sut.close()
        qsl.close()
        progress.close()
        failed.close()
    if sut.resent:
        logger.warning("%d queries were sent again (the router unreachable, or their call cancelled)", sut.resent)
    if failed.count:
        logger.warning("%d samples failed; see %s", failed.count, log_dir / FAILED_SAMPLES_FILE)
    return log_dir
