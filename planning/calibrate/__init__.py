"""``fleetgate sim calibrate``: fit the engine model's step time to a live engine.

Drive the engine with a designed workload (``workload.py``), fit the linear step-time model by
least squares (``fit.py``), read the KV cache's shape from its metrics, and write a profile YAML
that ``fleetgate sim``, ``fleetgate simulate`` and ``fleetgate plan capacity`` accept as
``--profile FILE.yaml``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from planning.calibrate.adapters import AdapterFit, AdapterSpec, fit_adapters, measure_adapters
from planning.calibrate.fit import FitResult, Observation, fit_step_time
from planning.calibrate.probe import CacheInfo, EngineProbe, ProbeError
from planning.calibrate.request_path import PathFit, fit_request_path
from planning.calibrate.workload import CalibrationPlan, _Prompts, run_workload
from replica.sim.engine import EngineConfig
from replica.sim.profiles import load_preset
from replica.sim.step_time import StepTimeModel

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "AdapterSpec",
    "CalibrationPlan",
    "CalibrationResult",
    "EngineLimits",
    "ProbeError",
    "calibrate",
    "write_profile",
]


#: vLLM's defaults for the scheduler limits its metrics do not publish.
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Scheduler limits the engine does not publish: say what it was started with."""

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    #: LoRA slots and host cache (``--max-loras``, ``--max-cpu-loras``); None: the base
    #: profile's. Adapter calibration needs them to push an adapter out of its slot.
    max_loras: int | None = None
    max_cpu_loras: int | None = None


@dataclass(frozen=True, slots=True)
class CalibrationResult:
    """Everything calibration learned about one engine."""

    engine_url: str
    served_model: str
    cache: CacheInfo
    max_model_len: int
    limits: EngineLimits
    fit: FitResult
    #: The fit's model with the request path's work (what the profile holds).
    path: PathFit
    observations: list[Observation]
    #: The preset whose hardware and model geometry the profile keeps (for LoRA sizes, price).
    base_profile: str
    elapsed_s: float
    #: Adapter load stages, where ``--adapter`` asked for them (``adapters.py``).
    adapters: AdapterFit | None = None

    def profile(self) -> dict[str, Any]:
        """The profile mapping (validated by building an ``EngineConfig`` from it)."""
        settings = _engine_settings(
            self.base_profile, self.cache, self.max_model_len, self.limits, self.path.model
        )
        if self.adapters is not None:
            settings["lora_storage_gbps"] = float(f"{self.adapters.storage_gbps:.6g}")
            if self.adapters.h2d_gbps is not None:
                settings["lora_h2d_gbps"] = float(f"{self.adapters.h2d_gbps:.6g}")
            settings["adapter_default_size_mb"] = float(f"{self.adapters.size_mb:.6g}")
        EngineConfig.from_profile(**_as_overrides(settings))  # raises on anything invalid
        settings["calibration"] = {
            "engine": self.engine_url,
            "served_model": self.served_model,
            "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "observations": len(self.observations),
            "median_abs_error": round(self.fit.median_abs_error, 4),
            "max_abs_error": round(self.fit.max_abs_error, 4),
        }
        return settings


def _engine_settings(
    base_profile: str, cache: CacheInfo, max_model_len: int, limits: EngineLimits,
    step_time: StepTimeModel,
) -> dict[str, Any]:
    """A profile mapping: the base preset's hardware and model, the engine's measured shape."""
    base = load_preset(base_profile)
    settings: dict[str, Any] = {
        "hardware": base["hardware"],
        "model": base["model"],
        "block_size": cache.block_size,
        "num_gpu_blocks_override": cache.num_gpu_blocks,
        "max_model_len": max_model_len,
        "max_num_seqs": limits.max_num_seqs,
        "max_num_batched_tokens": limits.max_num_batched_tokens,
        "step_time": {k: float(f"{v:.6g}") for k, v in step_time.as_mapping().items()},
    }
    for key in ("max_loras", "max_cpu_loras"):
        given = getattr(limits, key)
        if given is not None:
            settings[key] = given
        elif key in base:
            settings[key] = base[key]
    return settings


def _as_overrides(settings: dict[str, Any]) -> dict[str, Any]:
    """``EngineConfig.from_profile`` arguments for a profile mapping (any preset as the base:
    every field it sets is overridden)."""
    return {"name": "tiny", **settings}


def write_profile(result: CalibrationResult, path: Path) -> None:
    """Write the calibrated profile YAML, with a header saying where it came from."""
    header = (
        f"# Calibrated by `fleetgate sim calibrate --engine {result.engine_url}`.\n"
        "# Use with: fleetgate sim|simulate|plan capacity --profile THIS_FILE.yaml\n"
    )
    body = yaml.safe_dump(result.profile(), sort_keys=False)
    path.write_text(header + body, encoding="utf-8")


async def calibrate(
    engine_url: str,
    metrics_url: str | None = None,
    plan: CalibrationPlan | None = None,
    limits: EngineLimits | None = None,
    base_profile: str = "tiny",
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    request_timeout_s: float = 120.0,
    adapters: tuple[AdapterSpec, ...] = (),
    adapter_repeats: int = 3,
) -> CalibrationResult:
    """Run the designed workload against a live engine and fit the step-time model; with
    ``adapters``, measure their load stages too (``adapters.py``)."""
    limits = limits or EngineLimits()
    started = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        probe = EngineProbe(session, engine_url, metrics_url)
        try:
            model, reported_len = await probe.model()
            cache = await probe.cache_info()
        except aiohttp.ClientError as exc:
            raise ProbeError(f"cannot reach the engine at {engine_url}: {exc}") from exc
        max_model_len = reported_len or 2048
        fitted_plan = (plan or CalibrationPlan()).fitted_to(
            max_model_len, limits.max_num_batched_tokens, limits.max_num_seqs
        )
        measured = await run_workload(probe, model, fitted_plan, seed, progress)
        fit = fit_step_time(measured.steps)
        # The engine as the profile will describe it: its LoRA slots and host cache too.
        config = EngineConfig.from_profile(**_as_overrides(
            _engine_settings(base_profile, cache, max_model_len, limits, fit.model)
        ))
        adapter_fit = None
        if adapters:
            slots, host = config.max_loras, config.max_cpu_loras
            if progress is not None:
                how = (f"load, pushed out of its slot by {slots} more, two requests"
                       if host > slots >= 1 else
                       "load only (the host cache holds no more than the slots: the slot stage "
                       "cannot be isolated, the whole load is fitted to storage)")
                progress(f"{len(adapters)} adapter(s) x{adapter_repeats}: {how} "
                         f"(max_loras {slots}, max_cpu_loras {host})")
            loads = await measure_adapters(
                probe, list(adapters), adapter_repeats, _Prompts(seed + 1).fresh,
                max_loras=slots, max_cpu_loras=host,
            )
            adapter_fit = fit_adapters(loads)
    return CalibrationResult(
        engine_url=engine_url,
        served_model=model,
        cache=cache,
        max_model_len=max_model_len,
        limits=limits,
        fit=fit,
        path=fit_request_path(config, measured.bursts),
        observations=measured.steps,
        base_profile=base_profile,
        elapsed_s=time.perf_counter() - started,
        adapters=adapter_fit,
    )
