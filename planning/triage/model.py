"""What triage reads (``RouteMetrics``) and what it answers (``Lever``), with strict validation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

#: The fixed lever vocabulary; dashboards and runbooks key on these strings.
LeverCategory = Literal[
    "prefix-caching",
    "queueing",
    "kv-quantization",
    "weight-quantization",
    "reduce-batch",
    "multi-lora",
    "capacity-headroom",
]
CATEGORIES: tuple[str, ...] = get_args(LeverCategory)
HeadroomState = Literal["within SLO", "SLO not checked", "no signals"]
HEADROOM_STATES: tuple[str, ...] = get_args(HeadroomState)


class MetricsError(ValueError):
    """Triage input that is missing, mistyped or out of range; the message names the field."""


class SourceError(RuntimeError):
    """A metrics source (gateway, Prometheus) could not be read; the message names the URL."""


def scrubbed(text: str, base_url: str) -> str:
    """``text`` without the password of ``base_url``'s user-info (basic auth in the URL): error
    messages are printed, and CI and incident logs keep them (the Prometheus review)."""
    password = urlsplit(base_url).password
    return text.replace(f":{password}@", ":***@") if password else text


def drop_undeclared_misses(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with a route's miss shares kept only for the SLOs it declares: for the others
    the gateway counts against its defaults (2,000 ms, 100 ms), not the SLO triage is given on
    the command line, and a route over a ``--slo-ttft-ms 5`` read as within it (the diff
    review). Both live sources read them so."""
    for slo in ("ttft", "tpot"):
        if values.get(f"{slo}_slo_ms") is None:
            values.pop(f"{slo}_slo_missed", None)
    return values


@dataclass(frozen=True, slots=True)
class Lever:
    """One thing to change, and why, for one route.

    ``action`` names the change; ``why`` quotes the numbers that triggered it. Two levers with
    the same category and action are the same change (triage merges their reasons).
    """

    category: LeverCategory
    action: str
    why: str
    #: Only on the ``capacity-headroom`` lever: what "no rule fired" rests on. ``within SLO``
    #: (an SLO was checked and met), ``SLO not checked`` (other signals only) or ``no signals``
    #: (nothing could be checked: unknown is not healthy).
    state: HeadroomState | None = None

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"unknown lever category {self.category!r}")
        if self.state is not None and self.state not in HEADROOM_STATES:
            raise ValueError(f"unknown lever state {self.state!r}")

    @property
    def reason(self) -> str:
        """``action: why``, the text ``--json`` prints as ``reason``."""
        return f"{self.action}: {self.why}"

    def to_dict(self) -> dict[str, str]:
        """``{"lever": category, "reason": text}``, the ``--json`` shape (plus ``state`` on the
        ``capacity-headroom`` lever)."""
        out = {"lever": self.category, "reason": self.reason}
        if self.state is not None:
            out["state"] = self.state
        return out


#: The route label of requests refused before a route was known (bad key, malformed body):
#: the gateway's ``gateway.request.route.UNROUTED``. Not a route: nothing to triage there.
UNROUTED = "unrouted"


@dataclass(frozen=True, slots=True)
class RouteMetrics:
    """The signals triage reads for one route. ``None`` means unknown: rules needing it are skipped.

    Latencies in ms; ``shared_prefix_fraction``, ``kv_cache_usage`` and ``utilisation`` in 0..1.
    """

    ttft_p95_ms: float | None = None
    ttft_slo_ms: float | None = None
    tpot_p95_ms: float | None = None
    tpot_slo_ms: float | None = None
    #: Share of prompt tokens that are a prefix shared with earlier requests.
    shared_prefix_fraction: float | None = None
    kv_cache_usage: float | None = None
    preemptions_per_min: float | None = None
    #: Requests waiting per replica, on average (``vllm:num_requests_waiting``): with KV usage it
    #: tells a full cache that limits from one doing its job (``planning.kv_pressure``).
    waiting_mean: float | None = None
    #: Growth of the waiting queue per replica, requests per minute (the slope of
    #: ``vllm:num_requests_waiting``): a growing queue at 90%+ KV usage also means the cache
    #: limits, as in advise.
    waiting_growth_per_min: float | None = None
    #: Fine-tuned model variants served behind this route (full models or adapters).
    fine_tuned_variants: int | None = None
    #: True when the owner says the model can afford some quality loss (quantization).
    quality_headroom: bool = False
    #: True when the gateway saw shared content behind a unique first block (e.g. a timestamp).
    cache_busting_layout: bool | None = None
    #: Average share of replica time with at least one request of this gateway's running (busy
    #: time, not batch slots: continuous batching makes a replica "busy" long before it is full).
    utilisation: float | None = None
    #: Share of requests that missed the TTFT / TPOT SLO (the gateway's exact count,
    #: ``fleetgate_slo_requests_total``): decides "over SLO" where known (more than 5% missed is
    #: a p95 over it), since a p95 read from histogram buckets is interpolated.
    ttft_slo_missed: float | None = None
    tpot_slo_missed: float | None = None
    #: Share of requests flow control refused because the fleet was saturated (429; token
    #: budgets not counted), fleet-wide: latencies then describe only the admitted ones.
    shed_share: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_p95_ms", "tpot_p95_ms", "preemptions_per_min", "waiting_mean"):
            _check_number(name, getattr(self, name), low=0.0)
        _check_number("waiting_growth_per_min", self.waiting_growth_per_min, low=-math.inf)
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            _check_number(name, getattr(self, name), low=0.0, exclusive=True)
        for name in (
            "shared_prefix_fraction", "kv_cache_usage", "utilisation", "ttft_slo_missed",
            "tpot_slo_missed", "shed_share",
        ):
            _check_number(name, getattr(self, name), low=0.0, high=1.0)
        variants = self.fine_tuned_variants
        if variants is not None and (
            isinstance(variants, bool) or not isinstance(variants, int) or variants < 0
        ):
            raise MetricsError(f"fine_tuned_variants: must be an integer >= 0 (got {variants!r})")
        if not isinstance(self.quality_headroom, bool):
            raise MetricsError(
                f"quality_headroom: must be true or false (got {self.quality_headroom!r})"
            )
        busting = self.cache_busting_layout
        if busting is not None and not isinstance(busting, bool):
            raise MetricsError(f"cache_busting_layout: must be true or false (got {busting!r})")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "") -> RouteMetrics:
        """Build from a YAML/JSON mapping; unknown keys and bad values name ``where.key``."""
        prefix = f"{where}." if where else ""
        if not isinstance(data, Mapping):
            raise MetricsError(f"{where or 'input'}: expected a mapping of metric -> value")
        unknown = sorted(set(data) - FIELD_NAMES, key=str)
        if unknown:
            raise MetricsError(
                f"{prefix}{unknown[0]}: unknown key; expected some of: {', '.join(FIELD_ORDER)}"
            )
        values = dict(data)
        if values.get("quality_headroom") is None:
            values.pop("quality_headroom", None)
        try:
            return cls(**values)
        except MetricsError as exc:
            raise MetricsError(f"{prefix}{exc}") from None

    def merged(self, defaults: RouteMetrics) -> RouteMetrics:
        """This route's values, with ``defaults`` filling the unknown ones."""
        values = {
            name: getattr(self, name)
            if getattr(self, name) is not None
            else getattr(defaults, name)
            for name in FIELD_ORDER
        }
        values["quality_headroom"] = self.quality_headroom or defaults.quality_headroom
        return RouteMetrics(**values)


FIELD_ORDER: tuple[str, ...] = tuple(f.name for f in fields(RouteMetrics))
FIELD_NAMES = frozenset(FIELD_ORDER)


def _check_number(
    name: str, value: Any, low: float, high: float | None = None, exclusive: bool = False
) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise MetricsError(f"{name}: must be a number (got {value!r})")
    if math.isinf(low) and math.isinf(value):
        raise MetricsError(f"{name}: must be a finite number (got {value!r})")
    too_low = value <= low if exclusive else value < low
    too_high = high is not None and value > high
    if too_low or too_high:
        bounds = (
            f"in [{low:g}, {high:g}]"
            if high is not None
            else f"{'>' if exclusive else '>='} {low:g}"
        )
        raise MetricsError(f"{name}: must be {bounds} (got {value!r})")
