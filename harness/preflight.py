"""Checks of the machine a run is about to use, made before anything starts: the engine's CUDA device and the
output directory. Each failure is a ConfigError (exit 2, one line) instead of a failure after the cluster is up."""

from __future__ import annotations

import tempfile
from pathlib import Path

from harness.system_config import ConfigError, ScenarioName, SystemConfig, engine_config


def check_engine_device(config: SystemConfig, scenario: ScenarioName) -> None:
    """An engine on CUDA needs CUDA here: the embedded cluster's workers run on this machine. Probed now (it
    initialises nothing on the GPU), not at import, so commands that never start an engine stay cheap."""
    device = engine_config(config.for_scenario(scenario), Path("checkpoint")).device
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        key = f"scenarios.{scenario}.engine.device" if "device" in config.scenario(scenario).engine else "engine.device"
        raise ConfigError(f"{key}: {device!r}, but torch finds no CUDA device on this machine "
                          f"(torch.cuda.is_available() is False); use device cpu, or --ray-address a cluster with GPUs")


def check_output_writable(output: Path) -> None:
    """--output must be a directory this process can create files in (made if missing)."""
    try:
        output.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output):
            pass
    except OSError as exc:
        raise ConfigError(f"--output: {output} is not a writable directory: {exc.strerror or exc}") from None
