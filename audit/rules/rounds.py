"""The submission rules for qwen3-vl-235b-a22b as data: one `RoundRules` per round (v6.0, v6.1) plus the
layout, system-description and file constants the MLCommons submission checker applies (reference §3)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

MODEL = "qwen3-vl-235b-a22b"
SCENARIOS = ("Offline", "Server", "Interactive")
DIVISIONS = ("closed", "open")

# LoadGen has no Interactive scenario: an Interactive dir holds a `TestScenario.Server` run (reference §2).
LOADGEN_SCENARIO = MappingProxyType({"Offline": "Offline", "Server": "Server", "Interactive": "Server"})

PERF_RUN_REQUIRED_FILES = ("mlperf_log_summary.txt", "mlperf_log_detail.txt")
PERF_RUN_OPTIONAL_FILES = ("mlperf_log_accuracy.json",)
ACCURACY_REQUIRED_FILES = ("mlperf_log_detail.txt", "accuracy.txt", "mlperf_log_accuracy.json")
ACCURACY_OPTIONAL_FILES = ("mlperf_log_summary.txt",)
SCENARIO_REQUIRED_FILES = ("measurements.json", "user.conf", "README.md")
COMPLIANCE_TEST_DIR = re.compile(r"^TEST\d\d$")

# truncate_accuracy_log.py: logs above MAX are cut to the first and last VIEWABLE bytes.
MAX_ACCURACY_LOG_SIZE = 10 * 1024
ACCURACY_LOG_VIEWABLE_SIZE = 4096
# The checker's ACC_PATTERN["F1_HIERARCHICAL"] (constants.py): digits and dots only, so it reads 6.9e-06 as 6.9.
ACCURACY_F1_PATTERN = r'\{.*"f1":\s*([\d\.]+).*\}'
# The JSON number actually written after "f1" (sign, fraction and exponent included).
ACCURACY_F1_WRITTEN = r'"f1":\s*(-?[\d.]+(?:[eE][-+]?\d+)?)'
ACCURACY_HASH_PATTERN = r"^hash=([\w\d]+)$"

# The harness writes FAILED_SAMPLES_FILE (JSON list of {"sample_index", "error"}) next to LoadGen's logs;
# the builder files it in the scenario dir as FILED_FAILED_SAMPLES (run dirs may hold LoadGen files only).
FAILED_SAMPLES_FILE = "failed_samples.json"
FILED_FAILED_SAMPLES = "failed_samples_{run}.json"

VALID_STATUS = ("available", "preview", "rdi")
VALID_SYSTEM_TYPES = ("datacenter", "edge", "datacenter,edge", "edge,datacenter")

SYSTEM_DESC_REQUIRED_FIELDS = (
    "division", "submitter", "status", "system_name", "number_of_nodes", "host_processor_model_name",
    "host_processors_per_node", "host_processor_core_count", "host_memory_capacity", "host_storage_capacity",
    "host_storage_type", "accelerators_per_node", "accelerator_model_name", "accelerator_memory_capacity",
    "framework", "operating_system", "system_type", "other_software_stack", "host_processor_frequency",
    "host_processor_caches", "host_memory_configuration", "host_processor_interconnect", "host_networking",
    "host_networking_topology", "accelerator_frequency", "accelerator_host_interconnect",
    "accelerator_interconnect", "accelerator_interconnect_topology", "accelerator_memory_configuration",
    "accelerator_on-chip_memories", "cooling", "hw_notes", "sw_notes", "host_network_card_count",
    "system_type_detail",
)
SYSTEM_DESC_MEANINGFUL_FIELDS = (
    "division", "submitter", "system_type", "status", "system_name", "number_of_nodes",
    "host_processor_model_name", "host_processors_per_node", "host_processor_core_count",
    "host_memory_capacity", "host_memory_configuration", "host_storage_capacity", "host_storage_type",
    "host_networking", "host_network_card_count", "host_networking_topology", "accelerators_per_node",
    "accelerator_model_name", "accelerator_memory_capacity", "accelerator_host_interconnect",
    "accelerator_memory_configuration", "accelerator_interconnect", "cooling", "framework",
    "operating_system", "other_software_stack",
)
MEASUREMENTS_REQUIRED_FIELDS = (
    "input_data_types", "retraining", "starting_weights_filename", "weight_data_types",
    "weight_transformations",
)


@dataclass(frozen=True)
class Seeds:
    qsl: int
    sample_index: int
    schedule: int


@dataclass(frozen=True)
class RoundRules:
    """What one submission round requires of a qwen3-vl-235b-a22b result (CHK/constants.py MODEL_CONFIG)."""

    version: str
    seeds: Seeds
    required_scenarios: tuple[str, ...]
    # At least one of these must be present as well (v6.1 loader.check_scenarios); empty = no such rule.
    one_of_scenarios: tuple[str, ...]
    accuracy_targets: Mapping[str, float]
    accuracy_sample_count: Mapping[str, int]
    latency_constraint_ns: Mapping[str, int]
    # Compliance (audit) tests this benchmark requires: none in v6.0/v6.1 (models_TEST0x lists, §3.4).
    compliance_tests: tuple[str, ...] = ()
    performance_sample_count: int = 48289
    offline_min_samples_per_query: int = 48289
    min_duration_ms: int = 600_000

    @property
    def allowed_scenarios(self) -> tuple[str, ...]:
        return tuple(s for s in SCENARIOS if s in self.required_scenarios or s in self.one_of_scenarios)


ROUNDS: Mapping[str, RoundRules] = MappingProxyType({
    "v6.0": RoundRules(
        version="v6.0",
        seeds=Seeds(2465351861681999779, 14276810075590677512, 3936089224930324775),
        required_scenarios=("Offline", "Server"),
        one_of_scenarios=(),
        accuracy_targets=MappingProxyType({"Offline": 0.7903 * 0.99, "Server": 0.7903 * 0.99}),
        accuracy_sample_count=MappingProxyType({"Offline": 48289, "Server": 48289}),
        latency_constraint_ns=MappingProxyType({"Server": 12_000_000_000}),
    ),
    "v6.1": RoundRules(
        version="v6.1",
        seeds=Seeds(2085463073848966840, 2747215439041700203, 16159082839903944936),
        required_scenarios=("Offline",),
        one_of_scenarios=("Server", "Interactive"),
        accuracy_targets=MappingProxyType(
            {"Offline": 0.7903 * 0.99, "Server": 0.7903 * 0.99, "Interactive": 0.7878 * 0.99}),
        accuracy_sample_count=MappingProxyType({"Offline": 48289, "Server": 48289, "Interactive": 8000}),
        latency_constraint_ns=MappingProxyType({"Server": 12_000_000_000, "Interactive": 1_500_000_000}),
    ),
})
DEFAULT_VERSION = "v6.1"
