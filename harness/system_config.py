"""One YAML per system (mlperf_configs/<system>.yaml) validated into typed objects.

A bad file fails before anything starts with one line naming the key (`ConfigError`): numbers are strict (a YAML
`true` is no count), a key given twice is named with both lines, and names that become directories are checked.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "mlperf_configs"
TINY_PREFIX = "tiny:"
SIMULATED_PREFIX = "simulated:"  # simulated:<hardware profile>: model-free workers timed by workers.sim
SYNTHETIC_PREFIX = "synthetic:"

DatasetKind = Literal["product-catalogue", "catalogue-8k"]
SyntheticProfile = Literal["small", "mixed", "realistic"]  # harness.synthetic_catalogue.PROFILES
ScenarioName = Literal["offline", "server", "interactive"]
# Where LoadGen's queries are routed: in the router process (the SUT -> router -> worker), or in the SUT's own process
# (SUT -> worker; harness/embedded_routing.py), the router process still serving HTTP clients and health.
RouterMode = Literal["process", "embedded"]
ROUTER_MODES: tuple[RouterMode, ...] = ("process", "embedded")


class ConfigError(ValueError):
    """A system config that cannot be used; the message is one line naming the file and key."""


class _Strict(BaseModel):
    # strict: YAML's `true` is not the count 1, nor "2" the number 2 (an int still passes where a float is
    # expected: `target_qps: 2`).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# One path component that is the same on every file system the tree is copied to: no separators, no "." or ".."
# and no hidden names (the submission tree puts these names in directory paths).
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


class SystemSection(_Strict):
    """Who submits what: names that appear in the submission tree (as directories: safe path components)."""

    name: str = Field(min_length=1)
    submitter: str = Field(min_length=1)
    division: Literal["closed", "open"]
    system_desc: str = Field(
        min_length=1, description="systems/*.json path, relative to mlperf_configs/"
    )

    @field_validator("name", "submitter")
    @classmethod
    def _safe_path_component(cls, value: str) -> str:
        if not _SAFE_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not a safe directory name (letters, digits and . _ + -, "
                             f"starting with a letter or digit)")
        return value

    @property
    def system_desc_path(self) -> Path:
        return CONFIG_DIR / self.system_desc


class GeneratedCheckpointSection(_Strict):
    """A weightless checkpoint made on first use in the cache dir: the config.json of a released preset
    (workers.tiny_checkpoint.RELEASED_CONFIGS) with dotted-path overrides, plus the released side configs.
    The engine builds random weights of that shape on the device (engine.load_format: random)."""

    preset: str = Field(min_length=1)
    overrides: dict[str, Any] = Field(
        default_factory=dict, description='dotted config.json paths, e.g. {"text_config.num_hidden_layers": 24}'
    )

    fp8_layout: Literal["block", "channel"] = Field(
        "block", description="with model.weights fp8: Qwen's released layout (e4m3 in 128x128 blocks, activations per "
        "token and group of 128) or the FP8-dynamic one (compressed-tensors: one scale per output channel, activations "
        "per token)"
    )

    @model_validator(mode="after")
    def _preset_and_overrides_exist(self) -> GeneratedCheckpointSection:
        self.config_json()
        return self

    def config_json(self, weights: str = "bf16") -> dict[str, Any]:
        """The config.json this spec writes (ValueError naming an unknown preset or override key); weights "fp8"
        adds the quantization_config of fp8_layout (Qwen's released block FP8, or FP8-dynamic per channel), so the
        random weights are FP8 in that layout; "nvfp4" adds ModelOpt's NVFP4 one (random weights as the engine holds
        an NVFP4 checkpoint: FP8 per channel)."""
        from workers.quantized_checkpoint import released_quantization_config
        from workers.tiny_checkpoint import released_config

        try:
            config = released_config(self.preset, self.overrides)
        except KeyError as exc:  # KeyError's str() quotes its message
            raise ValueError(exc.args[0]) from None
        if weights == "fp8":
            config["quantization_config"] = released_quantization_config(self.fp8_layout, config)
        elif weights == "nvfp4":
            config["quantization_config"] = released_quantization_config("nvfp4", config)
        return config


class ModelSection(_Strict):
    """The checkpoint, exactly one of: `checkpoint`, a local HF directory, "tiny:moe" / "tiny:dense" (made on
    first use), or "simulated:<hardware profile>" (simulated workers, mlperf_configs/hardware/<profile>.yaml);
    or `generate`, a weightless real-shape checkpoint made on first use."""

    checkpoint: str | None = Field(None, min_length=1)
    generate: GeneratedCheckpointSection | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"]
    weights: Literal["bf16", "fp8", "nvfp4"] = Field(
        "bf16", description="The checkpoint format this system expects: 'bf16' (float weights, no quantization_config), "
        "'fp8' (config.json's quantization_config: Qwen's block FP8 or compressed-tensors FP8-dynamic) or 'nvfp4' "
        "(ModelOpt NVFP4, NVIDIA's MLPerf checkpoints; converted to FP8 per channel at load on Hopper). Checked "
        "against the checkpoint's config.json before anything starts."
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.checkpoint is None) == (self.generate is None):
            raise ValueError("give exactly one of model.checkpoint and model.generate")
        return self

    @field_validator("checkpoint")
    @classmethod
    def _known_tiny_arch(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if value.startswith(TINY_PREFIX) and value[len(TINY_PREFIX):] not in ("moe", "dense"):
            raise ValueError(f"tiny checkpoint must be tiny:moe or tiny:dense, got {value!r}")
        if value.startswith(SIMULATED_PREFIX):
            from workers.sim.step_model import load_hardware

            load_hardware(value[len(SIMULATED_PREFIX):])
        return value

    @property
    def simulated_hardware(self) -> str | None:
        if self.checkpoint is not None and self.checkpoint.startswith(SIMULATED_PREFIX):
            return self.checkpoint[len(SIMULATED_PREFIX):]
        return None

    @property
    def tiny_arch(self) -> Literal["moe", "dense"] | None:
        if self.checkpoint is not None and self.checkpoint.startswith(TINY_PREFIX):
            return self.checkpoint[len(TINY_PREFIX):]  # type: ignore[return-value]
        return None


class DatasetSection(_Strict):
    """A catalogue on disk, or "synthetic:N" (N samples written on first use, in the layout of the dataset
    kind it stands in for; `synthetic_profile` and `synthetic_seed` as harness.synthetic_catalogue takes them)."""

    path: str = Field(min_length=1)
    prompt_variant: Literal["v6.0", "v6.1"] = "v6.1"
    synthetic_seed: int = 0
    synthetic_profile: SyntheticProfile = "small"

    @model_validator(mode="after")
    def _synthetic_keys_need_a_synthetic_path(self) -> DatasetSection:
        stray = sorted({"synthetic_seed", "synthetic_profile"} & self.model_fields_set)
        if stray and self.synthetic_count is None:
            raise ValueError(f"{stray[0]}: only for a synthetic:N path, not {self.path!r}")
        return self

    @field_validator("path")
    @classmethod
    def _synthetic_count(cls, value: str) -> str:
        if value.startswith(SYNTHETIC_PREFIX):
            count = value[len(SYNTHETIC_PREFIX):]
            if not count.isdigit() or int(count) < 1:
                raise ValueError(f"synthetic dataset must be synthetic:N with N >= 1, got {value!r}")
        return value

    @property
    def synthetic_count(self) -> int | None:
        if self.path.startswith(SYNTHETIC_PREFIX):
            return int(self.path[len(SYNTHETIC_PREFIX):])
        return None


class PoolSection(_Strict):
    """A pool of identical model instances; each instance is one Ray actor on its own GPUs."""

    role: Literal["aggregated", "prefill", "decode"]
    count: PositiveInt
    gpus_per_worker: NonNegativeInt = 0
    cpus_per_worker: PositiveFloat = 1.0
    tp: PositiveInt = 1
    ep: PositiveInt = 1
    resources: dict[str, PositiveFloat] = Field(
        default_factory=dict, description="custom Ray resources per worker (e.g. a node label) to place it by"
    )

    @model_validator(mode="after")
    def _parallelism_fits_gpus(self) -> PoolSection:
        width = max(self.gpus_per_worker, 1)
        if self.tp != width:
            raise ValueError(f"tp ({self.tp}) must equal gpus_per_worker ({self.gpus_per_worker}, CPU counts as 1)")
        if self.ep not in (1, self.tp):
            raise ValueError(f"ep ({self.ep}) must be 1 or equal to tp ({self.tp})")
        return self


class KvLinkSection(_Strict):
    """The GPU-to-GPU KV hand-off (workers/serve/kv_transfer.py, NCCL; gloo on CPU) between the one prefill and the one
    decode instance: the prefill worker listens on `port` of its node, the decode worker connects there. Off,
    the KV goes over gRPC (PullKv). A restarted end does not rejoin its running peer (it waits timeout_s, fails and
    is restarted again); meanwhile the router prefills on the decode worker."""

    enabled: bool = False
    port: int = Field(29650, ge=1024, le=65535)
    timeout_s: PositiveFloat = Field(600.0, description="how long each end waits for the other to connect")


class WorkersSection(_Strict):
    pools: list[PoolSection] = Field(min_length=1)
    kv_link: KvLinkSection = KvLinkSection()

    @model_validator(mode="after")
    def _prefill_needs_decode(self) -> WorkersSection:
        roles = {pool.role for pool in self.pools}
        if ("prefill" in roles) != ("decode" in roles):
            raise ValueError("a prefill pool needs a decode pool and vice versa")
        return self

    @field_validator("kv_link")
    @classmethod
    def _kv_link_joins_one_pair(cls, value: KvLinkSection, info: ValidationInfo) -> KvLinkSection:
        pools = info.data.get("pools")
        if not value.enabled or pools is None:
            return value
        count = {role: sum(p.count for p in pools if p.role == role) for role in ("prefill", "decode", "aggregated")}
        if (count["prefill"], count["decode"], count["aggregated"]) != (1, 1, 0):
            raise ValueError(f"enabled: supported for one prefill and one decode instance and no aggregated pool "
                             f"(one link joins one pair); these pools have {count['prefill']} prefill, "
                             f"{count['decode']} decode and {count['aggregated']} aggregated instances: "
                             f"set enabled: false (KV over gRPC)")
        return value

    @property
    def disaggregated(self) -> bool:
        return any(pool.role == "prefill" for pool in self.pools)

    @property
    def num_workers(self) -> int:
        return sum(pool.count for pool in self.pools)

    @property
    def num_gpus(self) -> int:
        return sum(pool.count * pool.gpus_per_worker for pool in self.pools)

    @property
    def num_cpus(self) -> float:
        return sum(pool.count * pool.cpus_per_worker for pool in self.pools)

    def check_fits(self, gpus: float | None, cpus: float | None, where: str) -> None:
        """ConfigError when the pools need more GPUs or CPUs than `where` has (None: not known)."""
        for name, need, have in (("GPU", self.num_gpus, gpus), ("CPU", self.num_cpus, cpus)):
            if have is not None and need > have:
                raise ConfigError(f"workers.pools need {need:g} {name}s in all; {where} has {have:g}")


class ScenarioSection(_Strict):
    """LoadGen settings written to user.conf for one scenario (times in ms)."""

    target_qps: PositiveFloat
    min_duration_ms: NonNegativeInt
    min_query_count: PositiveInt
    performance_sample_count: PositiveInt
    target_latency_ms: PositiveInt | None = None
    # Engine settings for this scenario only, over the `engine` section (e.g. Offline's larger step budget:
    # throughput, where Server and Interactive keep smaller steps for latency).
    engine: dict[str, Any] = Field(default_factory=dict)


class ScenariosSection(_Strict):
    offline: ScenarioSection | None = None
    server: ScenarioSection | None = None
    interactive: ScenarioSection | None = None

    @model_validator(mode="after")
    def _latency_targets(self) -> ScenariosSection:
        if self.offline is not None and self.offline.target_latency_ms is not None:
            raise ValueError("offline.target_latency_ms: Offline has no latency target")
        for name in ("server", "interactive"):
            section = getattr(self, name)
            if section is not None and section.target_latency_ms is None:
                raise ValueError(f"{name}.target_latency_ms is required")
        return self


class MeasurementsSection(_Strict):
    """measurements.json fields the submission checker requires non-empty."""

    input_data_types: str = Field(min_length=1)
    retraining: str = Field(min_length=1)
    starting_weights_filename: str = Field(min_length=1)
    weight_data_types: str = Field(min_length=1)
    weight_transformations: str = Field(min_length=1)


class RequestsSection(_Strict):
    """What the SUT asks of every query."""

    max_tokens: PositiveInt = 150
    timeout_s: PositiveFloat = 7200.0
    reconnect_s: NonNegativeFloat = 60.0  # a query re-sent while the router is unreachable (restarting), this long
    # Tokens a worker may batch into one chunk after the first (GenerateRequest.stream_interval). q3vl tracks
    # end-to-end latency only, so per-token chunks would only cost router and SUT CPU; a migrated request
    # regenerates at most this many tokens.
    stream_interval: NonNegativeInt = 16
    # Router calls the SUT keeps open at once; the other issued queries wait in the SUT. None: what the router
    # admits without refusing (sut_inflight_bound).
    max_inflight: PositiveInt | None = None


class RaySection(_Strict):
    """Resources the embedded `ray.init()` may use (ignored when joining a cluster), and how long a joined
    cluster's address (--ray-address) may take to answer before the run fails."""

    num_cpus: PositiveInt | None = None
    num_gpus: NonNegativeInt | None = None
    object_store_memory_mb: PositiveInt | None = None
    connect_timeout_s: PositiveFloat = 30.0


DATASET_FOR_SCENARIO: dict[str, DatasetKind] = {
    "offline": "product-catalogue",
    "server": "product-catalogue",
    "interactive": "catalogue-8k",
}


class SystemConfig(_Strict):
    system: SystemSection
    model: ModelSection
    datasets: dict[DatasetKind, DatasetSection] = Field(min_length=1)
    engine: dict[str, Any] = Field(default_factory=dict)
    workers: WorkersSection
    # router.config.RouterConfig's keys, and `mode` (RouterMode, default process), which is the harness's
    router: dict[str, Any] = Field(default_factory=dict)
    # Router processes: worker i registers with router i mod N and the SUT spreads queries over all N
    # (one Python router process carries ~150 req/s; an NVL72 needs many).
    router_shards: PositiveInt = 1
    simulation: dict[str, Any] = Field(default_factory=dict)  # workers.sim.engine.SimulationConfig
    scenarios: ScenariosSection
    measurements: MeasurementsSection
    requests: RequestsSection = RequestsSection()
    ray: RaySection = RaySection()

    @field_validator("router")
    @classmethod
    def _known_router_mode(cls, value: dict[str, Any]) -> dict[str, Any]:
        mode = value.get("mode", "process")
        if mode not in ROUTER_MODES:
            raise ValueError(f"router.mode: {mode!r} is not one of {', '.join(ROUTER_MODES)}")
        return value

    @model_validator(mode="after")
    def _embedded_routing_is_one_router(self) -> SystemConfig:
        if self.router_mode == "embedded" and self.router_shards != 1:
            raise ValueError(f"router_shards: {self.router_shards} router processes, but router.mode embedded "
                             f"routes LoadGen's queries in the SUT's process; set router_shards: 1")
        return self

    @property
    def router_mode(self) -> RouterMode:
        return self.router.get("mode", "process")

    @model_validator(mode="after")
    def _kv_link_needs_a_model(self) -> SystemConfig:
        if self.workers.kv_link.enabled and self.model.simulated_hardware is not None:
            raise ValueError("workers.kv_link.enabled: simulated workers hold no KV cache to send; set it false")
        return self

    @model_validator(mode="after")
    def _generated_checkpoint_loads_random(self) -> SystemConfig:
        if self.model.generate is None:
            return self
        for name in DATASET_FOR_SCENARIO:  # the engine as each configured scenario runs it
            if getattr(self.scenarios, name) is None:
                continue
            if self.for_scenario(name).engine.get("load_format") != "random":
                where = f"scenarios.{name}.engine" if "load_format" in self.scenario(name).engine else "engine"
                raise ValueError(f"{where}.load_format: model.generate writes config.json only, no weights; "
                                 f"set load_format: random")
        return self

    @model_validator(mode="after")
    def _datasets_for_scenarios(self) -> SystemConfig:
        for name, kind in DATASET_FOR_SCENARIO.items():
            if getattr(self.scenarios, name) is not None and kind not in self.datasets:
                raise ValueError(f"datasets.{kind} is required by scenarios.{name}")
        return self

    @model_validator(mode="after")
    def _performance_samples_fit_datasets(self) -> SystemConfig:
        # LoadGen cannot keep more samples loaded than the QSL has (it would log the count and load fewer); found
        # here, not after the cluster is up.
        for name, kind in DATASET_FOR_SCENARIO.items():
            section = getattr(self.scenarios, name)
            if section is None or kind not in self.datasets:
                continue
            if section.performance_sample_count > (size := self.dataset_size(name)):
                path = self.datasets[kind].path
                where = "" if self.datasets[kind].synthetic_count is not None else f" at {path}"
                raise ValueError(f"scenarios.{name}.performance_sample_count: {section.performance_sample_count} "
                                 f"is more than the {size} samples of datasets.{kind}{where}")
        return self

    def dataset_size(self, scenario: ScenarioName) -> int:
        """Samples in the scenario's catalogue: N for synthetic:N; for a path, the rows its parquet shards hold
        (footers only); the published dataset's size where the path is not on this machine (yet)."""
        from contract.dataset import DATASETS, DatasetFormatError, catalogue_size

        dataset, kind = self.dataset(scenario), DATASET_FOR_SCENARIO[scenario]
        if dataset.synthetic_count is not None:
            return dataset.synthetic_count
        if not Path(dataset.path).is_dir():
            return DATASETS[kind].size
        try:
            return catalogue_size(dataset.path, kind)
        except (DatasetFormatError, OSError) as exc:  # DatasetNotFoundError is an OSError
            raise ValueError(f"datasets.{kind}.path: {str(exc).splitlines()[0]}") from None

    def scenario(self, name: ScenarioName) -> ScenarioSection:
        section = getattr(self.scenarios, name)
        if section is None:
            raise ConfigError(f"system {self.system.name}: scenarios.{name} is not configured")
        return section

    def dataset(self, scenario: ScenarioName) -> DatasetSection:
        return self.datasets[DATASET_FOR_SCENARIO[scenario]]

    def for_scenario(self, name: ScenarioName) -> SystemConfig:
        """This config as one scenario runs it: the scenario's engine settings over the `engine` section."""
        return self.model_copy(update={"engine": {**self.engine, **self.scenario(name).engine}})


def _one_line(source: str, exc: ValidationError) -> str:
    errors = exc.errors()
    first = errors[0]
    key = ".".join(str(part) for part in first["loc"]) or "<root>"
    more = len(errors) - 1
    suffix = f" (+{more} more)" if more else ""
    hint = _misspelling(errors)
    return f"{source}: {hint}" if hint else f"{source}: {key}: {first['msg']}{suffix}"


def _misspelling(errors: list[dict]) -> str | None:
    """'workerz: unknown key; did you mean workers?' when a required key is missing next to an unknown one."""
    missing = {e["loc"]: e for e in errors if e["type"] == "missing"}
    for error in errors:
        if error["type"] != "extra_forbidden":
            continue
        parent, name = error["loc"][:-1], str(error["loc"][-1])
        candidates = [str(loc[-1]) for loc in missing if loc[:-1] == parent]
        close = difflib.get_close_matches(name, candidates, n=1)
        if close:
            dotted = ".".join(str(part) for part in error["loc"])
            return f"{dotted}: unknown key; did you mean {close[0]}? ({close[0]} is required)"
    return None


def parse_system_config(data: Any, source: str) -> SystemConfig:
    """Validates already-parsed YAML; `source` names the file in the error."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: <root>: expected a mapping of sections")
    try:
        config = SystemConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_one_line(source, exc)) from None
    _validate_components(config, source)
    return config


def _validate_components(config: SystemConfig, source: str) -> None:
    """The engine and router sections are validated by their owners' typed configs; the engine also as each
    configured scenario overrides it."""
    overridden = [name for name in DATASET_FOR_SCENARIO if getattr(config.scenarios, name) is not None
                  and config.scenario(name).engine]
    for section, build in (
        ("engine", lambda: engine_config(config, Path("checkpoint"))),
        *((f"scenarios.{name}.engine", lambda name=name: engine_config(config.for_scenario(name), Path("checkpoint")))
          for name in overridden),
        ("router", lambda: router_config(config, "127.0.0.1:0")),
        ("simulation", lambda: simulation_config(config)),
    ):
        try:
            build()
        except ValidationError as exc:
            raise ConfigError(_one_line(source, exc).replace(": ", f": {section}.", 1)) from None


def engine_config(config: SystemConfig, checkpoint: Path):
    """The workers' EngineConfig: the `engine` section plus the resolved checkpoint and dtype."""
    from workers.config import EngineConfig

    return EngineConfig.model_validate(
        {**config.engine, "checkpoint": str(checkpoint), "dtype": config.model.dtype}
    )


def worker_settings(config: SystemConfig, checkpoint: Path, router_address: str, token: str | None):
    """The workers' WorkerSettings, built once: what they register as (the checkpoint, the engine's KV blocks and
    context), the router they register with and its heartbeat, the `workers.kv_link` pair's link on the engine's
    (rank 0's) device. Its worker id, its role and its link's host and role are placeholders: the fleet sets each
    worker's id and role, and the prefill node's host."""
    from workers.config import KvLinkConfig
    from workers.serve.worker_build import WorkerSettings

    engine, section = engine_config(config, checkpoint), config.workers.kv_link
    link = None
    if section.enabled:
        device = "cuda:0" if engine.device == "cuda" else engine.device
        link = KvLinkConfig(host="", port=section.port, role="prefill", device=device, timeout_s=section.timeout_s)
    return WorkerSettings(
        worker_id="", router_address=router_address, token=token, model_name=str(checkpoint),
        kv_block_size=engine.block_size, max_model_len=engine.max_model_len,
        heartbeat_interval_s=router_config(config, router_address).health.heartbeat_interval_s, kv_link=link,
    )


def image_pixel_limits(config: SystemConfig) -> tuple[int, int]:
    """(min_pixels, max_pixels) the workers resize images to; prompts must size images the same way."""
    engine = engine_config(config, Path("checkpoint"))  # the limits do not depend on the checkpoint
    return engine.min_pixels, engine.max_pixels


def simulation_config(config: SystemConfig):
    """The simulated workers' SimulationConfig (defaults when the section is absent)."""
    from workers.sim.config import SimulationConfig

    return SimulationConfig.model_validate(config.simulation)


def router_config(config: SystemConfig, listen: str):
    """The router's RouterConfig: the `router` section (less the harness's `mode`) listening on `listen`."""
    from router.config import RouterConfig

    section = {key: value for key, value in config.router.items() if key != "mode"}
    return RouterConfig.model_validate({**section, "listen": listen})


def sut_inflight_bound(config: SystemConfig) -> int:
    """How many queries the SUT may have at the routers at once (requests.max_inflight, else this): each router
    shard takes its serving workers' in-flight limits (capped by max_inflight_total) and queues as many again,
    within max_queue, so the workers never wait for the SUT and no query is refused RESOURCE_EXHAUSTED."""
    if config.requests.max_inflight is not None:
        return config.requests.max_inflight
    limits = router_config(config, "127.0.0.1:0").limits
    serving = sum(pool.count for pool in config.workers.pools if pool.role != "prefill")
    per_shard = max(1, serving // config.router_shards)  # worker i registers with shard i mod router_shards
    running = min(limits.max_inflight_total, per_shard * limits.max_inflight_per_worker)
    return config.router_shards * (running + min(limits.max_queue, running))


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (plain SafeLoader keeps the last value)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges; its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.setdefault(key, line)
            except TypeError:  # an unhashable key: the base constructor reports it
                break
            if first != line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} on lines {first} and {line}", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def read_system_yaml(path: Path) -> Any:
    """The parsed YAML of a system file, not yet validated; a key given twice fails naming it and its lines."""
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.constructor.ConstructorError as exc:
        if exc.problem and exc.problem.startswith("duplicate key"):
            raise ConfigError(f"{path}: {exc.problem}") from None
        raise ConfigError(f"{path}: cannot read YAML: {' '.join(str(exc).split())}") from None
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read YAML: {' '.join(str(exc).split())}") from None


def with_engine_settings(raw: Any, settings: dict[str, Any]) -> Any:
    """A system file's YAML data (read_system_yaml) with `settings` over its `engine` section; validated with the rest
    by parse_system_config (a scenario's own engine settings still win there)."""
    return {**raw, "engine": {**(raw.get("engine") or {}), **settings}}


def system_config_path(name_or_path: str | Path) -> Path:
    """mlperf_configs/<name>.yaml for a system name; a YAML path as given."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = CONFIG_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            known = ", ".join(available_systems()) or "none"
            raise ConfigError(f"unknown system {str(name_or_path)!r} (known: {known})")
    return path


def load_system_config(name_or_path: str | Path) -> SystemConfig:
    """Loads mlperf_configs/<name>.yaml (or a YAML path) and validates it."""
    path = system_config_path(name_or_path)
    config = parse_system_config(read_system_yaml(path), str(path))
    if path.parent == CONFIG_DIR and config.system.name != path.stem:
        raise ConfigError(f"{path}: system.name: {config.system.name!r} must equal the file name {path.stem!r}")
    return config


DEFAULT_SYSTEM = "cpu-tiny"  # the embedded default: runs with no --system, on CPU, with nothing on disk


def available_systems() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
