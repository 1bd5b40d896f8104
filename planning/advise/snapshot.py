"""Snapshots as files: read a JSON/YAML snapshot (``--input``), write one (``--save``).

A snapshot is what ``advise`` saw, so a live reading can be saved, committed as a test fixture
and advised on again later with the same answer::

    pools:
      chat:                       # pool name
        replicas: 4
        hardware: h100-sxm        # profile names (replica/sim/profiles), optional
        model: llama3-8b
        flags: {max-model-len: 131072, max-num-seqs: 256, kv-cache-dtype: auto}
        flag_sources: {max-model-len: engine-reported}   # optional; default "given"
        measured: {context_p99: 2900, kv_usage: 0.41, timers: {ttft: {p95_ms: 420}}}

``--flags pool=FILE.yaml`` files are a bare ``flags`` mapping.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import yaml

from planning import yamlio
from planning.advise.model import (
    FLAG_FIELDS,
    MEASUREMENT_FIELDS,
    SOURCES,
    AdviceError,
    EngineFlags,
    Measurements,
    Percentiles,
    PoolSnapshot,
)

_POOL_KEYS = {"replicas", "hardware", "model", "sim_profile", "flags", "flag_sources", "measured"}


def read_yaml(path: str | Path) -> Any:
    """A YAML (or JSON) file's data; errors name the file."""
    path = Path(path)
    try:
        return yamlio.load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise AdviceError(f"{path}: cannot read ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise AdviceError(f"{path}: not valid YAML or JSON ({exc})") from exc


def load_snapshot(path: str | Path) -> dict[str, PoolSnapshot]:
    """Pool name -> snapshot from a file."""
    return parse_snapshot(read_yaml(path), str(path))


def load_flags(path: str | Path) -> EngineFlags:
    """A ``--flags`` file: flag -> value, all ``given``."""
    return EngineFlags.from_mapping(read_yaml(path) or {}, "given", str(path))


def parse_snapshot(data: Any, where: str = "input") -> dict[str, PoolSnapshot]:
    """Pool name -> snapshot from parsed YAML/JSON."""
    if not isinstance(data, dict) or not isinstance(data.get("pools"), dict) or not data["pools"]:
        raise AdviceError(f"{where}: expected a mapping with a non-empty 'pools' mapping")
    return {
        str(name): parse_pool(str(name), body, f"{where}.pools.{name}")
        for name, body in data["pools"].items()
    }


def parse_pool(name: str, body: Any, where: str) -> PoolSnapshot:
    """One pool's mapping."""
    if not isinstance(body, dict):
        raise AdviceError(f"{where}: expected a mapping")
    unknown = sorted(set(body) - _POOL_KEYS)
    if unknown:
        raise AdviceError(f"{where}.{unknown[0]}: unknown key; expected {', '.join(_POOL_KEYS)}")
    flags = EngineFlags.from_mapping(body.get("flags") or {}, "given", f"{where}.flags")
    sources = body.get("flag_sources") or {}
    if not isinstance(sources, dict):
        raise AdviceError(f"{where}.flag_sources: expected a mapping of flag -> source")
    merged = dict(flags.sources)
    for key, source in sources.items():
        field = str(key).lstrip("-").replace("-", "_")
        if field not in FLAG_FIELDS or source not in SOURCES:
            raise AdviceError(
                f"{where}.flag_sources.{key}: expected a flag -> one of {', '.join(SOURCES)}"
            )
        merged[field] = source
    flags = EngineFlags(**_values(flags), sources=merged)
    replicas = body.get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise AdviceError(f"{where}.replicas: must be an integer >= 1 (got {replicas!r})")
    return PoolSnapshot(
        pool=name,
        flags=flags,
        measured=parse_measurements(body.get("measured") or {}, f"{where}.measured"),
        replicas=replicas,
        hardware=body.get("hardware"),
        model=body.get("model"),
        sim_profile=body.get("sim_profile"),
    )


def parse_measurements(data: Any, where: str) -> Measurements:
    """A ``measured`` mapping."""
    if not isinstance(data, dict):
        raise AdviceError(f"{where}: expected a mapping")
    unknown = sorted(set(data) - MEASUREMENT_FIELDS)
    if unknown:
        raise AdviceError(f"{where}.{unknown[0]}: unknown measurement")
    values = dict(data)
    timers = values.pop("timers", None) or {}
    if not isinstance(timers, dict):
        raise AdviceError(f"{where}.timers: expected timer -> {{p50_ms, p95_ms, p99_ms}}")
    try:
        parsed = {str(k): Percentiles(**(v or {})) for k, v in timers.items()}
        return Measurements(**values, timers=parsed)
    except TypeError as exc:
        raise AdviceError(f"{where}: {exc}") from None
    except AdviceError as exc:
        raise AdviceError(f"{where}.{exc}") from None


def to_mapping(pools: dict[str, PoolSnapshot]) -> dict[str, Any]:
    """The snapshot file's data for ``pools`` (``--save``); ``parse_snapshot`` reads it back."""
    out: dict[str, Any] = {}
    for name, pool in pools.items():
        flags = {k: v for k, v in _values(pool.flags).items() if v is not None}
        measured = {
            k: v for k, v in asdict(pool.measured).items() if v is not None and k != "timers"
        }
        timers = {
            name: {
                k: list(v) if isinstance(v, tuple) else v
                for k, v in asdict(p).items()
                if v is not None and v != ()
            }
            for name, p in pool.measured.timers.items()
        }
        if timers:
            measured["timers"] = timers
        body: dict[str, Any] = {"replicas": pool.replicas}
        for key in ("hardware", "model", "sim_profile"):
            if getattr(pool, key):
                body[key] = getattr(pool, key)
        body["flags"] = flags
        body["flag_sources"] = {k: pool.flags.source(k) for k in flags}
        body["measured"] = measured
        out[name] = body
    return {"pools": out}


def _values(flags: EngineFlags) -> dict[str, Any]:
    return {f.name: getattr(flags, f.name) for f in fields(flags) if f.name != "sources"}
