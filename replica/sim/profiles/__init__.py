"""Hardware, model and preset profiles for the simulated engine, loaded from the YAML beside this.

``hardware.yaml`` holds accelerators (memory, HBM bandwidth, peak FLOPS, price), ``models.yaml``
holds model geometry (parameters, layers, KV heads), and ``presets.yaml`` names a hardware + model
pair plus engine settings, for ``EngineConfig.from_profile``. Every loader validates strictly:
unknown keys and bad values are errors that name the file, the entry and the field.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields
from importlib import resources
from typing import Any

import yaml

__all__ = [
    "HardwareProfile",
    "ModelProfile",
    "ProfileError",
    "hardware_names",
    "is_profile_file",
    "load_hardware",
    "load_model",
    "load_preset",
    "load_profile_file",
    "model_names",
    "preset_names",
]


class ProfileError(ValueError):
    """A profile is unknown or its YAML is invalid."""


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator, as the roofline sees it."""

    name: str
    memory_gb: float
    hbm_bandwidth_tbps: float
    bf16_tflops: float
    #: None where the chip has no FP8 tensor cores (A100): FP8 weights then compute in 16-bit.
    fp8_tflops: float | None
    price_per_hour: float
    #: Practical host->device copy rate, for LoRA loads from the host-memory adapter cache.
    h2d_gbps: float = 25.0

    def __post_init__(self) -> None:
        for name in ("memory_gb", "hbm_bandwidth_tbps", "bf16_tflops", "h2d_gbps"):
            _require_positive(f"hardware {self.name}.{name}", getattr(self, name))
        if self.fp8_tflops is not None:
            _require_positive(f"hardware {self.name}.fp8_tflops", self.fp8_tflops)
        if self.price_per_hour < 0:
            raise ProfileError(
                f"hardware {self.name}.price_per_hour: must be >= 0 (got {self.price_per_hour})"
            )


@dataclass(frozen=True)
class ModelProfile:
    """A decoder-only transformer, reduced to what the roofline and KV cache need."""

    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int = 32000
    max_model_len: int = 8192
    #: Size of a typical adapter for this model (rank 16, all linear layers, bf16).
    lora_adapter_mb: float = 100.0

    def __post_init__(self) -> None:
        for name in (
            "params",
            "layers",
            "kv_heads",
            "head_dim",
            "vocab_size",
            "max_model_len",
            "lora_adapter_mb",
        ):
            _require_positive(f"model {self.name}.{name}", getattr(self, name))


def _require_positive(path: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ProfileError(f"{path}: must be a number > 0 (got {value!r})")


@functools.cache
def _read(filename: str) -> dict[str, dict[str, Any]]:
    text = resources.files(__name__).joinpath(filename).read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ProfileError(f"{filename}: expected a mapping of name -> mapping")
    return data


def _build(cls: type, filename: str, name: str) -> Any:
    entries = _read(filename)
    if name not in entries:
        raise ProfileError(
            f"{filename}: unknown profile {name!r}; choose from: {', '.join(sorted(entries))}"
        )
    entry = dict(entries[name])
    allowed = {f.name for f in fields(cls)} - {"name"}
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ProfileError(f"{filename}: {name}.{unknown[0]}: unknown key")
    try:
        return cls(name=name, **entry)
    except TypeError as exc:  # a required field is missing
        raise ProfileError(f"{filename}: {name}: {exc}") from None


def load_hardware(name: str) -> HardwareProfile:
    """The hardware profile ``name`` from ``hardware.yaml`` (e.g. ``"h100-sxm"``)."""
    return _build(HardwareProfile, "hardware.yaml", name)


def load_model(name: str) -> ModelProfile:
    """The model profile ``name`` from ``models.yaml`` (e.g. ``"llama3-8b"``)."""
    return _build(ModelProfile, "models.yaml", name)


#: Top-level keys of a profile file that describe where it came from; the engine ignores them.
PROFILE_FILE_METADATA = ("calibration",)


def is_profile_file(name: str) -> bool:
    """Whether ``--profile NAME`` names a file rather than a preset: ``*.yaml``/``*.yml``, a
    path (presets have no ``/``), or a file that exists (``calibrate --output cpu.profile``)."""
    return name.endswith((".yaml", ".yml")) or "/" in name or os.path.isfile(name)


def load_profile_file(path: str) -> dict[str, Any]:
    """A profile file: one preset's mapping (``hardware``, ``model``, engine settings, and
    optionally a measured ``step_time``), as ``fleetgate sim calibrate`` writes it."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise ProfileError(f"profile file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ProfileError(f"profile file {path}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"profile file {path}: expected a mapping of engine settings")
    preset = {k: v for k, v in data.items() if k not in PROFILE_FILE_METADATA}
    for key in ("hardware", "model"):
        if not isinstance(preset.get(key), str):
            raise ProfileError(f"profile file {path}: {key}: required profile name")
    return preset


def load_preset(name: str) -> dict[str, Any]:
    """The preset ``name`` from ``presets.yaml`` (or the profile file ``name`` if it ends in
    ``.yaml``/``.yml``): ``hardware``, ``model`` and engine settings."""
    if is_profile_file(name):
        return load_profile_file(name)
    if os.path.isdir(name):  # read as an unknown preset's name before (the CLI review)
        raise ProfileError(f"{name} is a folder, not a profile YAML or a preset name")
    presets = _read("presets.yaml")
    if name not in presets:
        raise ProfileError(
            f"presets.yaml: unknown preset {name!r}; choose from: {', '.join(sorted(presets))}"
        )
    preset = dict(presets[name])
    for key in ("hardware", "model"):
        if not isinstance(preset.get(key), str):
            raise ProfileError(f"presets.yaml: {name}.{key}: required profile name")
    return preset


def hardware_names() -> list[str]:
    """Names of all hardware profiles."""
    return sorted(_read("hardware.yaml"))


def model_names() -> list[str]:
    """Names of all model profiles."""
    return sorted(_read("models.yaml"))


def preset_names() -> list[str]:
    """Names of all engine presets."""
    return sorted(_read("presets.yaml"))
