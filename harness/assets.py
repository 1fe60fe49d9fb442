"""Where a system's checkpoint and datasets are on disk: local paths as given, or what the config asks to be
made on first use in a cache directory (tiny checkpoints, weightless real-shape configs, synthetic catalogues)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from harness.system_config import ConfigError, DatasetKind, DatasetSection, GeneratedCheckpointSection, ModelSection

_SYNTHETIC_STAMP = ".synthetic-complete"


def resolve_checkpoint(model: ModelSection, cache_dir: Path) -> Path:
    """The checkpoint directory; a tiny:* or generated checkpoint is written into cache_dir the first time; a
    simulated:* checkpoint has none (its name passes through)."""
    if model.generate is not None:
        return generated_checkpoint(model.generate, cache_dir, model.weights)
    if model.simulated_hardware is not None:
        return Path(model.checkpoint)
    if model.tiny_arch is not None:
        from workers.tiny_checkpoint import make_tiny_checkpoint

        return make_tiny_checkpoint(cache_dir / f"tiny-{model.tiny_arch}", arch=model.tiny_arch, seed=0)
    path = Path(model.checkpoint)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.checkpoint: {path} has no config.json (copy the checkpoint there)")
    check_weight_format(model, path)
    return path


def check_weight_format(model: ModelSection, checkpoint: Path) -> None:
    """Raises ConfigError unless the checkpoint's config.json declares the format model.weights expects."""
    from workers.checkpoint_quant import QuantizationConfigError, weight_format

    config_json = checkpoint / "config.json"
    try:
        fmt = weight_format(json.loads(config_json.read_text()), str(config_json))
    except (ValueError, QuantizationConfigError) as exc:
        raise ConfigError(f"model.checkpoint: {exc}") from None
    found = fmt.checkpoint_weights
    if found != model.weights:
        raise ConfigError(
            f"model.weights: {model.weights!r}, but {config_json} declares {fmt.label} ({found!r}); set model.weights "
            f"to {found!r} or point model.checkpoint at a {model.weights} checkpoint"
        )


def generated_checkpoint(spec: GeneratedCheckpointSection, cache_dir: Path, weights: str = "bf16") -> Path:
    """cache_dir/generated-<preset>-<hash of config.json>: config.json and the side configs, no weights. Written
    aside and renamed into place, so a directory that exists is complete."""
    from workers.tiny_checkpoint import write_side_configs

    text = json.dumps(spec.config_json(weights), indent=2, sort_keys=True) + "\n"
    out = cache_dir / f"generated-{spec.preset}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    if (out / "config.json").is_file():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=cache_dir))
    try:
        (staging / "config.json").write_text(text)
        write_side_configs(staging)
        try:
            os.rename(staging, out)
        except OSError:
            if not (out / "config.json").is_file():  # not another process finishing first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def resolve_dataset(section: DatasetSection, kind: DatasetKind, cache_dir: Path) -> Path:
    """The catalogue directory; a synthetic:N catalogue (of the section's profile and seed, in `kind`'s layout)
    is written into cache_dir the first time."""
    count = section.synthetic_count
    if count is None:
        path = Path(section.path)
        if not path.is_dir():
            raise ConfigError(f"datasets.{kind}.path: {path} is not a directory (copy the dataset there)")
        return path
    from harness.synthetic_catalogue import write_synthetic_catalogue

    profile, seed = section.synthetic_profile, section.synthetic_seed
    out = cache_dir / f"synthetic-{kind}-{count}-{profile}-seed{seed}"
    stamp = out / _SYNTHETIC_STAMP
    if not stamp.is_file():
        shutil.rmtree(out, ignore_errors=True)  # a half-written catalogue from an interrupted run
        write_synthetic_catalogue(out, count, seed=seed, dataset=kind, profile=profile)
        stamp.write_text(json.dumps({"n_samples": count, "seed": seed, "profile": profile}) + "\n")
    return out
