"""The submission rules for qwen3-vl-235b-a22b as data: one `RoundRules` per round (v6.0, v6.1) plus the
layout, system-description and file constants the MLCommons submission checker applies (constants.py,
checks/ and loader.py of https://github.com/mlcommons/inference/tree/master/tools/submission/submission_checker)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

MODEL = "qwen3-vl-235b-a22b"
SCENARIOS = ("Offline", "Server", "Interactive")
DIVISIONS = ("closed", "open")

# LoadGen has no Interactive scenario (enum TestScenario of
# https://github.com/mlcommons/inference/blob/master/loadgen/test_settings.h): an Interactive dir holds a
# `TestScenario.Server` run.
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

# The checker lower-cases `status` before this test (not stripped) and compares `system_type` as written
# (SystemCheck.availability_check / system_type_check in submission_checker/checks/system_check.py).
VALID_STATUS = ("available", "preview", "rdi")
VALID_SYSTEM_TYPES = ("datacenter", "edge", "datacenter,edge", "edge,datacenter")
# `is_network` (a string the checker lower-cases) set at all makes these fields required too, and "true" is
# only allowed in the network division (SYSTEM_DESC_REQUIRED_FIELDS_NETWORK_MODE, constants.py).
SYSTEM_DESC_IS_NETWORK = "is_network"
SYSTEM_DESC_NETWORK_FIELDS = (
    "is_network", "network_type", "network_media", "network_rate", "nic_loadgen", "number_nic_loadgen",
    "net_software_stack_loadgen", "network_protocol", "number_connections", "nic_sut", "number_nic_sut",
    "net_software_stack_sut", "network_topology",
)
# Folder names the checker maps to a benchmark besides its own names (MODEL_CONFIG model_mapping, v6.0 and v6.1).
BENCHMARK_ALIASES: Mapping[str, str] = MappingProxyType({
    "ssd-resnet34": "retinanet", "mobilenet": "resnet", "resnet50": "resnet", "llama3_1-405b": "llama3.1-405b",
    "llama3_1-8b": "llama3.1-8b", "llama3_1-8b-edge": "llama3.1-8b-edge"})

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
    # The compliance tests the checker requires of the other benchmarks' scenario dirs in the closed division
    # (MODEL_CONFIG[round]["models_TEST0x"], read by ComplianceCheck.get_test_list): test -> benchmarks.
    benchmark_compliance: Mapping[str, tuple[str, ...]]
    # Compliance (audit) tests this benchmark requires: none in v6.0/v6.1 (the models_TEST0x lists of the
    # checker's constants.py leave it out).
    compliance_tests: tuple[str, ...] = ()
    # Every benchmark of the round (MODEL_CONFIG[round]["models"]): other results folders under a system.
    benchmarks: tuple[str, ...] = ()
    # One value for every scenario, Interactive's 8k catalogue included: MODEL_CONFIG[round]
    # ["performance-sample-count"]["qwen3-vl-235b-a22b"] (constants.py; checked on LoadGen logs only, not on
    # mlcommons/endpoints ones), and mlperf.conf's performance_sample_count_override. LoadGen loads
    # min(this, the QSL's total), so an Interactive run logging 48289 keeps all 8,000 samples loaded.
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
        benchmarks=("resnet", "retinanet", "bert-99", "bert-99.9", "3d-unet-99", "3d-unet-99.9", "llama3.1-8b",
                    "llama3.1-8b-edge", "llama2-70b-99", "llama2-70b-99.9", "stable-diffusion-xl", "mixtral-8x7b",
                    "llama3.1-405b", "rgat", "pointpainting", "deepseek-r1", "whisper", "gpt-oss-120b",
                    "wan-2.2-t2v-a14b", MODEL, "dlrm-v3", "yolo-95", "yolo-99"),
        benchmark_compliance=MappingProxyType({
            "TEST01": ("resnet", "retinanet", "bert-99", "bert-99.9", "dlrm-v2-99", "dlrm-v2-99.9", "3d-unet-99",
                       "3d-unet-99.9", "stable-diffusion-xl", "rgat", "pointpainting", "whisper", "yolo-99", "yolo-95"),
            "TEST04": ("resnet", "stable-diffusion-xl", "pointpainting", "wan-2.2-t2v-a14b"),
            "TEST06": ("llama2-70b-99", "llama2-70b-99.9", "llama3.1-405b", "llama3.1-8b", "mixtral-8x7b",
                       "deepseek-r1"),
            "TEST07": ("gpt-oss-120b",), "TEST08": ("dlrm-v3",), "TEST09": ("gpt-oss-120b",)}),
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
        benchmarks=("resnet", "bert-99", "bert-99.9", "3d-unet-99", "3d-unet-99.9", "llama3.1-8b",
                    "llama3.1-8b-edge", "llama2-70b-99.9", "stable-diffusion-xl", "rgat", "deepseek-r1", "whisper",
                    "gpt-oss-120b", "wan-2.2-t2v-a14b", MODEL, "qwen3.6-27b", "dlrm-v3", "yolo-95", "yolo-99",
                    "e2e-rag-qna", "e2e-rag-db"),
        benchmark_compliance=MappingProxyType({
            "TEST01": ("resnet", "bert-99", "bert-99.9", "3d-unet-99", "3d-unet-99.9", "stable-diffusion-xl", "rgat",
                       "whisper", "yolo-99", "yolo-95"),
            "TEST04": ("resnet", "stable-diffusion-xl", "wan-2.2-t2v-a14b"),
            "TEST06": ("llama2-70b-99.9", "llama3.1-8b", "deepseek-r1"),
            "TEST07": ("gpt-oss-120b",), "TEST08": ("dlrm-v3",), "TEST09": ("gpt-oss-120b", "e2e-rag-qna")}),
    ),
})
DEFAULT_VERSION = "v6.1"
