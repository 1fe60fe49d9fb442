"""System configs: every shipped YAML loads, and a bad one fails with one line naming the key."""

from __future__ import annotations

import copy

import pytest
import yaml

from harness.system_config import (
    CONFIG_DIR,
    ConfigError,
    available_systems,
    load_system_config,
    parse_system_config,
)

SHIPPED = available_systems()


def cpu_tiny() -> dict:
    return yaml.safe_load((CONFIG_DIR / "cpu-tiny.yaml").read_text())


def error_for(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_system_config(data, "test.yaml")
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_embedded_default_and_the_gpu_systems_are_shipped():
    assert {"cpu-tiny", "h200x1", "h200x2", "h200x2-disagg", "h200x8", "gb300-nvl72", "vr-nvl72"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_yaml_loads_with_its_system_description(name):
    config = load_system_config(name)
    assert config.system.name == name
    assert config.system.system_desc_path.is_file()
    for scenario in ("offline", "server", "interactive"):
        section = config.scenario(scenario)
        assert section.performance_sample_count >= 1


def test_nvl72_systems_use_all_72_gpus():
    for name in ("gb300-nvl72", "vr-nvl72"):
        assert load_system_config(name).workers.num_gpus == 72


def test_h200x8_runs_two_tp4_instances():
    (pool,) = load_system_config("h200x8").workers.pools
    assert (pool.count, pool.gpus_per_worker, pool.tp, pool.ep) == (2, 4, 4, 4)


def test_cpu_tiny_makes_its_checkpoint_and_catalogue():
    config = load_system_config("cpu-tiny")
    assert config.model.tiny_arch == "moe"
    assert config.dataset("server").synthetic_count == config.scenario("server").performance_sample_count
    assert config.dataset("interactive").synthetic_count == config.scenario("interactive").performance_sample_count


def test_interactive_has_the_1500_ms_target_and_server_12_s():
    config = load_system_config("cpu-tiny")
    assert config.scenario("interactive").target_latency_ms == 1500
    assert config.scenario("server").target_latency_ms == 12000


def test_unknown_top_level_key_is_named():
    data = cpu_tiny()
    data["scenarioz"] = {}
    assert "test.yaml: scenarioz: Extra inputs are not permitted" in error_for(data)


def test_unknown_nested_key_is_named_with_its_path():
    data = cpu_tiny()
    data["scenarios"]["server"]["target_qsp"] = 3
    assert "scenarios.server.target_qsp" in error_for(data)


def test_bad_value_names_the_key():
    data = cpu_tiny()
    data["scenarios"]["offline"]["target_qps"] = -1
    assert "scenarios.offline.target_qps" in error_for(data)


def test_bad_pool_role_names_the_pool():
    data = cpu_tiny()
    data["workers"]["pools"][0]["role"] = "encoder"
    assert "workers.pools.0.role" in error_for(data)


def test_tp_must_match_the_gpus_of_a_worker():
    data = cpu_tiny()
    data["workers"]["pools"][0].update(gpus_per_worker=4, tp=2)
    assert "workers.pools.0" in error_for(data) and "tp (2)" in error_for(data)


def test_prefill_pool_without_decode_pool_is_rejected():
    data = cpu_tiny()
    data["workers"]["pools"] = [{"role": "prefill", "count": 1}]
    assert "workers" in error_for(data) and "decode pool" in error_for(data)


def test_engine_keys_are_validated_by_the_engine_config():
    data = cpu_tiny()
    data["engine"]["max_num_seqz"] = 4
    assert "engine.max_num_seqz" in error_for(data)


def test_a_scenario_may_override_engine_settings_for_itself_only():
    data = cpu_tiny()
    data["scenarios"]["offline"]["engine"] = {"max_num_batched_tokens": 4096}
    config = parse_system_config(data, "test.yaml")
    assert config.for_scenario("offline").engine["max_num_batched_tokens"] == 4096
    assert config.for_scenario("server").engine == config.engine == cpu_tiny()["engine"]


def test_a_scenarios_engine_keys_are_validated_and_named_with_the_scenario():
    data = cpu_tiny()
    data["scenarios"]["offline"]["engine"] = {"max_num_batched_tokenz": 4096}
    assert "scenarios.offline.engine.max_num_batched_tokenz" in error_for(data)


def test_router_keys_are_validated_by_the_router_config():
    data = cpu_tiny()
    data["router"]["policy"] = {"name": "random"}
    assert "router.policy.name" in error_for(data)


def test_the_router_runs_as_its_own_process_unless_the_yaml_says_embedded():
    from harness.system_config import router_config

    assert parse_system_config(cpu_tiny(), "test.yaml").router_mode == "process"
    data = cpu_tiny()
    data["router"]["mode"] = "embedded"
    config = parse_system_config(data, "test.yaml")
    assert config.router_mode == "embedded"
    assert router_config(config, "127.0.0.1:0").policy.name == "least_loaded"  # the rest is the router's config


def test_an_unknown_router_mode_is_rejected_naming_the_key():
    data = cpu_tiny()
    data["router"]["mode"] = "inline"
    assert "router.mode: 'inline' is not one of process, embedded" in error_for(data)


def test_embedded_routing_takes_one_router_not_shards():
    data = cpu_tiny()
    data["router"]["mode"] = "embedded"
    data["router_shards"] = 2
    assert "router_shards: 2 router processes, but router.mode embedded" in error_for(data)


def test_interactive_needs_the_8k_dataset():
    data = cpu_tiny()
    del data["datasets"]["catalogue-8k"]
    assert "datasets.catalogue-8k is required by scenarios.interactive" in error_for(data)


def test_offline_has_no_latency_target():
    data = cpu_tiny()
    data["scenarios"]["offline"]["target_latency_ms"] = 100
    assert "offline.target_latency_ms" in error_for(data)


def test_performance_sample_count_above_the_synthetic_dataset_is_named():
    data = cpu_tiny()
    data["scenarios"]["interactive"]["performance_sample_count"] = 25
    assert ("scenarios.interactive.performance_sample_count: 25 is more than the 24 samples of "
            "datasets.catalogue-8k") in error_for(data)


def test_performance_sample_count_above_the_published_dataset_is_named():
    data = cpu_tiny()
    data["datasets"]["catalogue-8k"]["path"] = "/data/shopify-product-catalogue-8k"
    data["scenarios"]["interactive"]["performance_sample_count"] = 48289
    assert "scenarios.interactive.performance_sample_count: 48289 is more than the 8000 samples" in error_for(data)
    data["scenarios"]["interactive"]["performance_sample_count"] = 8000
    assert parse_system_config(data, "test.yaml").dataset_size("interactive") == 8000


def test_performance_sample_count_above_a_catalogue_on_disk_is_named_with_its_row_count(tmp_path):
    from harness.synthetic_catalogue import write_synthetic_catalogue

    write_synthetic_catalogue(tmp_path / "cat", 32, seed=0, dataset="product-catalogue")  # 32 rows in 3 shards
    data = cpu_tiny()
    data["datasets"]["product-catalogue"]["path"] = str(tmp_path / "cat")
    data["scenarios"]["server"]["performance_sample_count"] = 64
    assert ("scenarios.server.performance_sample_count: 64 is more than the 32 samples of datasets.product-catalogue "
            f"at {tmp_path / 'cat'}") in error_for(data)
    data["scenarios"]["server"]["performance_sample_count"] = 32
    assert parse_system_config(data, "test.yaml").dataset_size("server") == 32


def test_a_catalogue_path_without_its_shards_is_named_at_validation(tmp_path):
    (tmp_path / "cat" / "data").mkdir(parents=True)
    data = cpu_tiny()
    data["datasets"]["product-catalogue"]["path"] = str(tmp_path / "cat")
    assert "datasets.product-catalogue.path: product-catalogue: no train shards in" in error_for(data)
    for name in ("train-00000-of-00001.parquet", "test-00000-of-00001.parquet"):
        (tmp_path / "cat" / "data" / name).write_bytes(b"not parquet")
    assert "datasets.product-catalogue.path: " in error_for(data) and "not a readable parquet file" in error_for(data)


def test_bad_synthetic_dataset_names_the_key():
    data = cpu_tiny()
    data["datasets"]["product-catalogue"]["path"] = "synthetic:lots"
    assert "datasets.product-catalogue.path" in error_for(data)


def test_empty_measurement_field_is_named():
    data = copy.deepcopy(cpu_tiny())
    data["measurements"]["retraining"] = ""
    assert "measurements.retraining" in error_for(data)


def test_unknown_system_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown system 'nope' \\(known: .*cpu-tiny"):
        load_system_config("nope")


def test_unconfigured_scenario_is_named(tmp_path):
    data = cpu_tiny()
    del data["scenarios"]["offline"]
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(data))
    config = load_system_config(path)
    with pytest.raises(ConfigError, match="scenarios.offline is not configured"):
        config.scenario("offline")


def test_unreadable_yaml_is_one_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("system: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_system_config(path)
    assert str(info.value).startswith(f"{path}: cannot read YAML") and "\n" not in str(info.value)


@pytest.mark.parametrize("key", ["name", "submitter"])
@pytest.mark.parametrize("value", ["../../etc", "a/b", ".hidden", "..", "two words", "back\\slash"])
def test_a_system_name_that_is_not_a_safe_path_component_is_refused(key, value):
    data = cpu_tiny()
    data["system"][key] = value
    message = error_for(data)
    assert f"test.yaml: system.{key}: " in message and "not a safe directory name" in message


def test_ordinary_submitter_and_system_names_are_accepted():
    data = cpu_tiny()
    data["system"].update(submitter="Red_Hat-2", name="NVIDIA_H200-SXM-141GBx8_TRT+v6.1")
    config = parse_system_config(data, "test.yaml")
    assert config.system.submitter == "Red_Hat-2"


@pytest.mark.parametrize(("path", "value"), [
    (("workers", "pools", 0, "count"), True),
    (("workers", "pools", 0, "count"), "2"),
    (("workers", "pools", 0, "count"), 2.0),
    (("scenarios", "server", "min_query_count"), False),
    (("scenarios", "offline", "target_qps"), True),
    (("scenarios", "offline", "target_qps"), "2.5"),
    (("requests", "max_tokens"), True),
    (("ray", "num_cpus"), True),
    (("router_shards",), True),
])
def test_a_boolean_or_a_string_is_not_a_number(path, value):
    data = cpu_tiny()
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = value
    assert f"test.yaml: {'.'.join(str(p) for p in path)}: Input should be a valid" in error_for(data)


def test_an_integer_is_a_valid_float():
    data = cpu_tiny()
    data["scenarios"]["offline"]["target_qps"] = 2
    data["workers"]["pools"][0]["cpus_per_worker"] = 1
    config = parse_system_config(data, "test.yaml")
    assert config.scenario("offline").target_qps == 2.0


def test_a_duplicate_key_is_named_with_both_lines(tmp_path):
    lines = (CONFIG_DIR / "cpu-tiny.yaml").read_text().splitlines()
    server = next(i for i, line in enumerate(lines) if line.lstrip().startswith("server:"))
    lines.insert(server, "  server: {target_qps: 9.0}")  # a second `server` inside `scenarios`, just above
    path = tmp_path / "dup.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as info:
        load_system_config(path)
    assert str(info.value) == f"{path}: duplicate key 'server' on lines {server + 1} and {server + 2}"


def test_a_duplicate_top_level_key_is_refused(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text((CONFIG_DIR / "cpu-tiny.yaml").read_text() + "router_shards: 1\nrouter_shards: 2\n")
    lines = path.read_text().splitlines()
    with pytest.raises(ConfigError, match=f"duplicate key 'router_shards' on lines {len(lines) - 1} and {len(lines)}"):
        load_system_config(path)


def test_a_yaml_merge_key_may_still_override_what_it_merges(tmp_path):
    data = cpu_tiny()
    data.pop("scenarios")
    text = yaml.safe_dump(data) + (
        "scenarios:\n"
        "  offline: {target_qps: 2.0, min_duration_ms: 10000, min_query_count: 32, performance_sample_count: 32}\n"
        "  server: &server {target_qps: 1.0, min_duration_ms: 15000, min_query_count: 16,"
        " performance_sample_count: 32, target_latency_ms: 12000}\n"
        "  interactive:\n    <<: *server\n    performance_sample_count: 24\n    target_latency_ms: 1500\n")
    path = tmp_path / "merge.yaml"
    path.write_text(text)
    assert load_system_config(path).scenario("interactive").target_latency_ms == 1500
