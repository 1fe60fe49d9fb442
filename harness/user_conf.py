"""user.conf for one scenario from the system config, and the TestSettings LoadGen builds from it.

mlperf.conf (embedded in LoadGen) is loaded by the first FromConfig call of a process, so each process
loads exactly one user.conf: one LoadGen test per process.

A config that keeps the whole dataset loaded leaves mlperf.conf's
`qwen3-vl-235b-a22b.*.performance_sample_count_override = 48289` in force, in every scenario: the checker wants
effective_performance_sample_count >= 48289 whatever the scenario (MODEL_CONFIG["v6.1"]["performance-sample-count"]
in tools/submission/submission_checker/constants.py), and LoadGen loads min(that count, the QSL's total)
(GenerateLoadableSets in loadgen/loadgen.cc), i.e. all 8,000 samples of Interactive's catalogue, as the v6.1
rules ask ("Performance sample count: 8000", multimodal/qwen3-vl/README.md). https://github.com/mlcommons/inference
"""

from __future__ import annotations

from pathlib import Path

import mlperf_loadgen as lg

from harness.scenarios import LoadGenMode, Scenario
from harness.system_config import SystemConfig

MODEL_KEY = "qwen3-vl-235b-a22b"


def render_user_conf(config: SystemConfig, scenario: Scenario) -> str:
    """The user.conf text; Interactive is LoadGen's Server scenario with its own latency target."""
    section = config.scenario(scenario.value)
    prefix = f"{MODEL_KEY}.{scenario.loadgen_name}"
    lines = [
        f"# {config.system.name}: {scenario.result_dir_name} (LoadGen scenario {scenario.loadgen_name})",
        f"{prefix}.target_qps = {section.target_qps!r}",
        f"{prefix}.min_duration = {section.min_duration_ms}",
        f"{prefix}.min_query_count = {section.min_query_count}",
    ]
    if section.performance_sample_count < config.dataset_size(scenario.value):
        lines.append(f"{prefix}.performance_sample_count_override = {section.performance_sample_count}")
    else:
        lines.append(f"# performance_sample_count_override: mlperf.conf's value; LoadGen keeps all "
                     f"{section.performance_sample_count} samples loaded")
    if section.target_latency_ms is not None:
        lines.append(f"{prefix}.target_latency = {section.target_latency_ms}")
    return "\n".join(lines) + "\n"


def write_user_conf(config: SystemConfig, scenario: Scenario, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_user_conf(config, scenario))
    return path


def load_test_settings(user_conf: Path, scenario: Scenario, mode: LoadGenMode) -> lg.TestSettings:
    """TestSettings from mlperf.conf + user.conf. Call once per process (see the module docstring)."""
    settings = lg.TestSettings()
    settings.scenario = scenario.loadgen_scenario
    settings.mode = mode.loadgen_mode
    rc = settings.FromConfig(str(user_conf), MODEL_KEY, scenario.loadgen_name)
    if rc != 0:
        raise RuntimeError(f"LoadGen rejected {user_conf} (FromConfig returned {rc})")
    return settings


def expected_sample_count(settings: lg.TestSettings, total_sample_count: int, performance_sample_count: int) -> int:
    """How many samples LoadGen will issue under `settings` (the progress bar's total), by LoadGen's own rules
    (https://github.com/mlcommons/inference/blob/master/loadgen/test_settings_internal.cc and loadgen.cc's
    GenerateQueries). Accuracy: every sample of the QSL once (or accuracy_sample_count_override of them).
    Offline: one query of max(min_query_count, int(1.1 x min_duration x expected QPS)) samples. Server (and
    Interactive): Poisson arrivals until both min_duration and min_query_count are met, so an estimate:
    max(min_query_count, target_qps x min_duration), capped by max_query_count when one is set. With
    sample_concatenate_permutation (mlperf.conf sets it for this benchmark) LoadGen issues the loaded set equally:
    both round up to a multiple of the performance sample count (`performance_sample_count`, the QSL's, unless
    the settings override it)."""
    if settings.mode == lg.TestMode.AccuracyOnly:
        override = settings.accuracy_sample_count_override
        return min(override, total_sample_count) if override else total_sample_count
    seconds = settings.min_duration_ms / 1000
    if settings.scenario == lg.TestScenario.Offline:
        count = max(settings.min_query_count, int(1.1 * seconds * settings.offline_expected_qps))
    else:
        count = max(settings.min_query_count, int(settings.server_target_qps * seconds))
    if settings.sample_concatenate_permutation:
        loaded = min(settings.performance_sample_count_override or performance_sample_count, total_sample_count)
        count = -(-count // loaded) * loaded
    if settings.scenario != lg.TestScenario.Offline and settings.max_query_count:
        count = min(count, settings.max_query_count)
    return count
