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
