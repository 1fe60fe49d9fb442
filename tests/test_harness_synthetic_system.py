"""A GPU system that needs no weights and no data (h200x1-synthetic): its YAML declares a generated real-shape
config.json and realistic synthetic catalogues; both are made on first use in the cache dir and validated like
every other key."""

from __future__ import annotations

import typing

import pytest
import yaml

from contract.dataset import load_catalogue
from harness.assets import generated_checkpoint, resolve_checkpoint, resolve_dataset
from harness.synthetic_catalogue import PROFILES
from harness.system_config import (
    CONFIG_DIR,
    ConfigError,
    DatasetSection,
    GeneratedCheckpointSection,
    SyntheticProfile,
    load_system_config,
    parse_system_config,
)
from workers.tiny_checkpoint import GENERATION_CONFIG, released_config
from workers.model_config import load_generation_config, load_model_config

SYSTEM = "h200x1-synthetic"


def synthetic_system() -> dict:
    return yaml.safe_load((CONFIG_DIR / f"{SYSTEM}.yaml").read_text())


def error_for(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_system_config(data, "test.yaml")
    return str(info.value)


def test_h200x1_synthetic_generates_the_30b_shape_and_loads_random_weights_in_every_scenario():
    config = load_system_config(SYSTEM)
    assert config.model.checkpoint is None
    assert config.model.generate.preset == "qwen3-vl-30b-a3b"
    for scenario in ("offline", "server", "interactive"):
        assert config.for_scenario(scenario).engine["load_format"] == "random"


def test_h200x1_synthetic_keeps_h200x1s_step_budgets():
    config, h200x1 = load_system_config(SYSTEM), load_system_config("h200x1")
    for scenario, tokens in (("offline", 16384), ("server", 8192), ("interactive", 8192)):
        assert config.for_scenario(scenario).engine["max_num_batched_tokens"] == tokens
        assert config.for_scenario(scenario).engine == {**h200x1.for_scenario(scenario).engine, "load_format": "random"}


def test_h200x1_synthetic_catalogues_are_realistic_and_fully_loaded():
    config = load_system_config(SYSTEM)
    for scenario in ("offline", "server", "interactive"):
        dataset = config.dataset(scenario)
        assert dataset.synthetic_profile == "realistic"
        assert dataset.synthetic_count == config.scenario(scenario).performance_sample_count


def test_the_profiles_a_config_may_name_are_the_catalogue_writers():
    assert typing.get_args(SyntheticProfile) == PROFILES


def test_generated_checkpoint_without_random_load_format_names_the_key():
    data = synthetic_system()
    del data["engine"]["load_format"]
    assert "engine.load_format: model.generate writes config.json only" in error_for(data)


def test_a_scenario_that_loads_safetensors_from_a_generated_checkpoint_is_named():
    data = synthetic_system()
    data["scenarios"]["server"]["engine"] = {"load_format": "safetensors"}
    assert "scenarios.server.engine.load_format" in error_for(data)


def test_checkpoint_and_generate_are_exclusive():
    data = synthetic_system()
    data["model"]["checkpoint"] = "/models/x"
    assert "exactly one of model.checkpoint and model.generate" in error_for(data)
    del data["model"]["checkpoint"], data["model"]["generate"]
    assert "exactly one of model.checkpoint and model.generate" in error_for(data)


def test_unknown_preset_and_override_key_are_named():
    data = synthetic_system()
    data["model"]["generate"] = {"preset": "qwen3-vl-1t"}
    assert "model.generate" in error_for(data) and "unknown preset 'qwen3-vl-1t'" in error_for(data)
    data["model"]["generate"] = {"preset": "qwen3-vl-30b-a3b", "overrides": {"text_config.num_layerz": 2}}
    assert "'text_config.num_layerz': no such key" in error_for(data)


def test_unknown_catalogue_profile_is_named():
    data = synthetic_system()
    data["datasets"]["catalogue-8k"]["synthetic_profile"] = "huge"
    assert "datasets.catalogue-8k.synthetic_profile" in error_for(data)


def test_synthetic_keys_on_a_real_dataset_path_are_named():
    data = synthetic_system()
    data["datasets"]["product-catalogue"]["path"] = "/data/product-catalogue"
    assert "synthetic_profile: only for a synthetic:N path" in error_for(data)


def test_generated_checkpoint_is_the_presets_config_and_side_configs_made_once(tmp_path):
    spec = load_system_config(SYSTEM).model
    path = resolve_checkpoint(spec, tmp_path)
    assert path.parent == tmp_path and sorted(p.name for p in path.iterdir()) == [
        "config.json", "generation_config.json", "preprocessor_config.json"]
    model = load_model_config(path)  # what the workers read, with load_format random, instead of weights
    shape = released_config("qwen3-vl-30b-a3b")["text_config"]
    assert (model.text.num_hidden_layers, model.text.num_experts, model.text.hidden_size) == (
        shape["num_hidden_layers"], shape["num_experts"], shape["hidden_size"])
    assert load_generation_config(path).temperature == GENERATION_CONFIG["temperature"]
    written = (path / "config.json").stat().st_mtime_ns
    assert resolve_checkpoint(spec, tmp_path) == path and (path / "config.json").stat().st_mtime_ns == written


def test_overrides_make_another_generated_checkpoint(tmp_path):
    base = generated_checkpoint(GeneratedCheckpointSection(preset="qwen3-vl-30b-a3b"), tmp_path)
    shallow = generated_checkpoint(GeneratedCheckpointSection(
        preset="qwen3-vl-30b-a3b", overrides={"text_config.num_hidden_layers": 2}), tmp_path)
    assert shallow != base
    assert load_model_config(shallow).text.num_hidden_layers == 2


@pytest.mark.parametrize("kind,splits", [("product-catalogue", {"train", "test"}), ("catalogue-8k", {"train"})])
def test_realistic_catalogue_is_made_on_first_use_in_its_datasets_layout(tmp_path, kind, splits):
    section = DatasetSection(path="synthetic:5", synthetic_profile="realistic")
    path = resolve_dataset(section, kind, tmp_path)
    assert {p.name.split("-")[0] for p in (path / "data").glob("*.parquet")} == splits
    catalogue = load_catalogue(path, kind)
    assert len(catalogue) == 5
    assert all(catalogue[i].image_bytes[:3] == b"\xff\xd8\xff" for i in range(5))  # realistic: all JPEG
    stamp = path / ".synthetic-complete"
    written = stamp.stat().st_mtime_ns
    assert resolve_dataset(section, kind, tmp_path) == path and stamp.stat().st_mtime_ns == written
    small = resolve_dataset(DatasetSection(path="synthetic:5"), kind, tmp_path)
    assert small != path  # another profile is another catalogue
