"""LoRA adapter load times, measured on a live engine and turned into the simulator's bandwidths.

The engine model (``replica/sim/lora.py``) loads an adapter in two stages, as vLLM does:

* from storage into host memory: ``size / lora_storage_gbps``;
* from host memory into one of the ``--max-loras`` slots: ``size / lora_h2d_gbps``.

``POST /v1/load_lora_adapter`` pays both while a slot is free (vLLM answers once the adapter is
in it). A request on an adapter that other adapters pushed out of its slot, but that is still in
host memory (``--max-cpu-loras``), pays the second stage alone, inside its first step.

For each adapter given (``fleetgate sim calibrate --adapter NAME=PATH``), each repeat:

1. unloads it, then times its load call: both stages;
2. loads the same files under ``max_loras`` other names, which push it out of its slot and, with
   ``max_cpu_loras > max_loras``, not out of host memory;
3. sends a fresh prompt to the adapter, then another of the same length once it is back in its
   slot: the first one's extra time to first token is the slot stage (a request on an adapter
   in its slot may cost more than one on the base model, for the adapter's own matmuls; that
   cost is in both and cancels);
4. unloads the extra names.

Repeats are combined by their median. The profile gets the two bandwidths that reproduce those
times for the measured size, and that size as ``adapter_default_size_mb``. Where the host cache
has no room beyond the slots, or the slot stage is within the noise of two requests, only the
total is fitted (to the storage bandwidth) and the host-to-device bandwidth stays the base
profile's. A load call that costs a fixed overhead more than bytes gives an *effective*
bandwidth: right for adapters of the measured size, optimistic for larger ones.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from planning.calibrate.probe import EngineProbe, ProbeError

__all__ = [
    "AdapterFit",
    "AdapterLoad",
    "AdapterSpec",
    "adapter_size_bytes",
    "fit_adapters",
    "measure_adapters",
    "parse_adapter",
]

#: The simulator's units (``replica/sim/lora.py``): decimal MB and GB.
MB = 1e6
GB = 1e9
#: Prompt tokens of the base/adapter probe pair, and the tokens each streams.
PROBE_PROMPT_TOKENS = 32
PROBE_MAX_TOKENS = 2
#: A slot stage shorter than this (seconds) is within the noise of two requests' TTFTs: the
#: host-to-device bandwidth is then left to the base profile.
MIN_ACTIVATION_S = 0.002


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """An adapter to measure: the name to load it under, its path as the engine sees it, and
    its size (read from the path on this machine)."""

    name: str
    path: str
    size_bytes: int


@dataclass(frozen=True, slots=True)
class AdapterLoad:
    """One repeat on one adapter."""

    name: str
    size_bytes: int
    #: Duration of ``POST /v1/load_lora_adapter`` with a free slot: storage and slot stages.
    load_s: float
    #: Time to first token on the adapter once pushed out of its slot, minus that of the next
    #: request on it (same prompt length): the slot stage. None where the host cache had no
    #: room to keep it.
    activation_s: float | None


@dataclass(frozen=True, slots=True)
class AdapterFit:
    """Bandwidths that reproduce the measured stages, and what they came from."""

    size_mb: float
    storage_gbps: float
    #: None where the slot stage was within the noise (the base profile's bandwidth stays).
    h2d_gbps: float | None
    loads: tuple[AdapterLoad, ...]

    def table(self) -> str:
        rows = ["adapter              size MB   load ms  slot ms  (median of repeats)"]
        by_name: dict[str, list[AdapterLoad]] = {}
        for load in self.loads:
            by_name.setdefault(load.name, []).append(load)
        for name, loads in by_name.items():
            rows.append(
                f"{name:<20} {loads[0].size_bytes / MB:8.3f} "
                f"{statistics.median(x.load_s for x in loads) * 1000:9.2f} "
                f"{_median_ms([x.activation_s for x in loads])}  (x{len(loads)})"
            )
        h2d = f"{self.h2d_gbps:.4g} GB/s" if self.h2d_gbps is not None else (
            f"not fitted (slot stage under {MIN_ACTIVATION_S * 1000:g} ms or not shorter than "
            "the load call: noise; the base profile's)"
        )
        rows.append(
            f"storage -> host {self.storage_gbps:.4g} GB/s, host -> slot {h2d}, for "
            f"{self.size_mb:.3f} MB adapters (effective: any fixed cost per load is folded in)"
        )
        return "\n".join(rows)


def _median_ms(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.median(known) * 1000:8.2f}" if known else "       -"


def adapter_size_bytes(path: Path) -> int:
    """Bytes of an adapter on disk: the file, or every file under the directory."""
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    raise FileNotFoundError(path)


def parse_adapter(text: str) -> AdapterSpec:
    """``NAME=PATH`` (the path as the engine sees it, readable here to size the adapter)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--adapter wants NAME=PATH (got {text!r})")
    try:
        size = adapter_size_bytes(Path(path))
    except FileNotFoundError:
        raise ValueError(
            f"--adapter {text}: {path} is not readable here; calibration reads the adapter's "
            "size from it, so run it on the engine's machine (or where the same path is mounted)"
        ) from None
    if size <= 0:
        raise ValueError(f"--adapter {text}: {path} is empty")
    return AdapterSpec(name, path, size)


async def measure_adapters(
    probe: EngineProbe, adapters: list[AdapterSpec], repeats: int,
    fresh_prompt: Callable[[int], list[int]], max_loras: int, max_cpu_loras: int,
) -> list[AdapterLoad]:
    """``repeats`` rounds on each adapter (see the module docstring)."""
    evict = max_cpu_loras > max_loras >= 1
    loads: list[AdapterLoad] = []
    for _ in range(repeats):
        for spec in adapters:
            aliases = [f"{spec.name}-fg-calibrate-{i}" for i in range(max_loras)] if evict else []
            for name in (spec.name, *aliases):
                await probe.unload_adapter(name)  # absent is fine
            load_s = await probe.load_adapter(spec.name, spec.path)
            activation_s = None
            if evict:
                for alias in aliases:
                    await probe.load_adapter(alias, spec.path)
                first = await probe.complete(
                    spec.name, fresh_prompt(PROBE_PROMPT_TOKENS), PROBE_MAX_TOKENS
                )
                warm = await probe.complete(
                    spec.name, fresh_prompt(PROBE_PROMPT_TOKENS), PROBE_MAX_TOKENS
                )
                activation_s = first.ttft_s - warm.ttft_s
                for alias in aliases:
                    await probe.unload_adapter(alias)
            loads.append(AdapterLoad(spec.name, spec.size_bytes, load_s, activation_s))
    for spec in adapters:  # leave the engine as calibration found it
        await probe.unload_adapter(spec.name)
    return loads


def fit_adapters(loads: list[AdapterLoad]) -> AdapterFit:
    """Median stage times over every repeat of every adapter, as bandwidths for their median
    size."""
    if not loads:
        raise ProbeError("no adapter load was measured")
    size = statistics.median(x.size_bytes for x in loads)
    total_s = statistics.median(x.load_s for x in loads)
    slots = [x.activation_s for x in loads if x.activation_s is not None]
    slot_s = statistics.median(slots) if slots else None
    if slot_s is None or slot_s < MIN_ACTIVATION_S or slot_s >= total_s:
        return AdapterFit(size / MB, size / max(total_s, 1e-9) / GB, None, tuple(loads))
    return AdapterFit(
        size / MB, size / (total_s - slot_s) / GB, size / slot_s / GB, tuple(loads)
    )
