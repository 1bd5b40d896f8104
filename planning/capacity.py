"""``fleetgate plan capacity``: how many replicas keep p95 TTFT inside its SLO at a given rate.

The prefill stage is modelled as an M/M/c queue (``planning/erlang.py``): each replica is one
server, a request's service time is the prefill time of its *uncached* prompt tokens (from the
roofline engine model of ``replica/sim/roofline.py``, or given with ``--prefill-ms``), and

    TTFT_q = wait_q(c replicas) + prefill time.

The smallest ``c`` with TTFT_q <= SLO is the answer. ``APPROXIMATIONS`` says where this is
optimistic or pessimistic; it is printed with every answer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from planning.erlang import erlang_c, wait_percentile
from planning.plot_path import plot_path_problem

APPROXIMATIONS = (
    "Each replica is one server prefilling one request at a time; batching of prefills and "
    "decode steps sharing the GPU are not modelled, so keep headroom above the answer.",
    "Service times are taken as exponential (M/M/c); real prefill time is nearly fixed for a "
    "given prompt length, which queues less (M/D/c waits are about half): pessimistic here.",
    "Arrivals are Poisson at a constant rate; bursty traffic queues more than this predicts: "
    "size for the peak rate of the busiest window, not the daily average.",
    "The cached fraction is assumed to hit on every request; it only holds when routing is "
    "prefix-aware and the prefix stays resident.",
    "Roofline prefill time ignores attention FLOPs and assumes a fixed MFU; long prompts take "
    "longer than it says.",
)

#: Utilisations at which the hockey stick is tabulated.
HOCKEY_STICK_UTILISATION = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.97, 0.99)


class CapacityError(ValueError):
    """The question cannot be answered as asked (bad input, or an SLO no fleet size can meet)."""


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    """The queue at one fleet size and arrival rate."""

    replicas: int
    rate: float
    utilisation: float
    prob_wait: float
    ttft_ms: float


def ttft_percentile_ms(
    replicas: int, rate: float, prefill_ms: float, quantile: float, overhead_ms: float = 0.0
) -> float:
    """TTFT at ``quantile``: the queueing delay percentile plus the (fixed) prefill time, plus
    ``overhead_ms`` of the request's path outside the engine (no replica busy meanwhile)."""
    wait_s = wait_percentile(replicas, rate, 1000.0 / prefill_ms, quantile)
    return wait_s * 1000.0 + prefill_ms + overhead_ms


def operating_point(
    replicas: int, rate: float, prefill_ms: float, quantile: float, overhead_ms: float = 0.0
) -> OperatingPoint:
    """Utilisation, P(wait) and TTFT percentile of ``replicas`` serving ``rate`` req/s."""
    load = rate * prefill_ms / 1000.0  # offered load in Erlangs: replicas busy on average
    return OperatingPoint(
        replicas=replicas,
        rate=rate,
        utilisation=load / replicas,
        prob_wait=erlang_c(replicas, load),
        ttft_ms=ttft_percentile_ms(replicas, rate, prefill_ms, quantile, overhead_ms),
    )


#: The largest offered load sized (replicas busy on average): Erlang C costs a step per
#: replica, and a fleet past this is a typo in --rate (per second) or --prefill-ms.
MAX_OFFERED_LOAD = 100_000


def replicas_needed(
    rate: float, slo_ttft_ms: float, prefill_ms: float, quantile: float, overhead_ms: float = 0.0
) -> int:
    """The smallest replica count whose TTFT at ``quantile`` is within ``slo_ttft_ms``."""
    for name, value in (("rate", rate), ("slo_ttft_ms", slo_ttft_ms), ("prefill_ms", prefill_ms)):
        if not (math.isfinite(value) and value > 0):
            raise CapacityError(f"{name} must be a finite number > 0 (got {value})")
    offered = rate * prefill_ms / 1000.0
    if offered > MAX_OFFERED_LOAD:
        raise CapacityError(
            f"{rate:g} requests/s of {prefill_ms:g} ms prefill keep {offered:,.0f} replicas busy "
            f"on average, over the {MAX_OFFERED_LOAD:,} this sizes: check --rate (requests per "
            "second) and --prefill-ms"
        )
    if prefill_ms + overhead_ms >= slo_ttft_ms:
        path = f" and {overhead_ms:.1f} ms of request path" if overhead_ms else ""
        raise CapacityError(
            f"prefill alone takes {prefill_ms + overhead_ms:.1f} ms ({prefill_ms:.1f} ms of "
            f"prefill{path}), at or over the TTFT SLO of {slo_ttft_ms:g} ms: no number of "
            "replicas helps. Cut uncached prompt tokens (prefix caching), use faster hardware, "
            "or relax the SLO."
        )

    def meets(replicas: int) -> bool:
        return ttft_percentile_ms(replicas, rate, prefill_ms, quantile, overhead_ms) <= slo_ttft_ms

    # TTFT falls as replicas are added, so double to bracket the answer, then bisect.
    low = math.floor(rate * prefill_ms / 1000.0)  # at or below the offered load: unstable
    high = max(1, 2 * low)
    while not meets(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    return high


def hockey_stick(
    replicas: int, prefill_ms: float, quantile: float, overhead_ms: float = 0.0
) -> list[OperatingPoint]:
    """TTFT vs utilisation at a fixed fleet size: flat, then a sharp rise near 100%."""
    service_rate = 1000.0 / prefill_ms
    return [
        operating_point(replicas, rho * replicas * service_rate, prefill_ms, quantile, overhead_ms)
        for rho in HOCKEY_STICK_UTILISATION
    ]


# --------------------------------------------------------------------------- roofline wiring


@dataclass(frozen=True, slots=True)
class EngineModel:
    """What sizing needs from the engine model: prefill time per token count and a price."""

    describe: str
    prefill_ms: Callable[[float], float]
    price_per_hour: float
    #: A request's time on its path outside the engine (a calibrated profile's
    #: ``request_overhead_s``): in its TTFT, but no replica is busy with it meanwhile.
    overhead_ms: float = 0.0


def engine_model(preset: str) -> EngineModel:
    """The roofline model of an engine preset from ``replica/sim/profiles/presets.yaml``.

    Imported here, not at the top, so sizing with ``--prefill-ms`` works without the engine
    model and its profile files.
    """
    try:
        from replica.sim.profiles import load_hardware, load_model, load_preset
        from replica.sim.roofline import Roofline
    except ImportError as exc:  # the engine model is optional for this command
        raise CapacityError(
            f"the roofline engine model is unavailable ({exc}); pass --prefill-ms instead"
        ) from exc
    try:
        settings = load_preset(preset)
        tensor_parallel = int(settings.get("tensor_parallel_size", 1))
        roofline = Roofline(
            hardware=load_hardware(settings["hardware"]),
            model=load_model(settings["model"]),
            weight_dtype=settings.get("weight_dtype", "bf16"),
            kv_dtype=settings.get("kv_dtype", "bf16"),
            tensor_parallel_size=tensor_parallel,
        )
        step_time = settings.get("step_time")
        if step_time is not None:
            # A calibrated profile (`fleetgate sim calibrate`): its measured prefill time.
            from replica.sim.engine import EngineConfig
            from replica.sim.step_time import StepTimeModel

            measured = StepTimeModel.from_mapping(step_time)
            # A lone request's TTFT as the simulator serves it with this profile: the request
            # path's overhead, and the prefill in chunks (one step without chunked prefill).
            chunk = int(settings.get("max_num_batched_tokens", EngineConfig.max_num_batched_tokens))
            if not settings.get("enable_chunked_prefill", True):
                chunk = 1 << 62
            return EngineModel(
                describe=(
                    f"measured step time: profile {preset} "
                    f"({measured.prefill_tokens_per_s():,.0f} prefill tokens/s, chunks of "
                    f"{min(chunk, 1 << 30):,} tokens, {measured.request_overhead_s * 1000:g} ms "
                    "request overhead)"
                ),
                # The engine steps alone: the request path's overhead is no replica's work.
                prefill_ms=lambda tokens: (
                    measured.lone_ttft_s(tokens, chunk) - measured.request_overhead_s
                )
                * 1000.0,
                overhead_ms=measured.request_overhead_s * 1000.0,
                price_per_hour=roofline.hardware.price_per_hour * tensor_parallel,
            )
    except ValueError as exc:  # ProfileError is a ValueError: unknown preset, bad YAML
        raise CapacityError(f"--profile {preset}: {exc}") from exc
    return EngineModel(
        describe=(
            f"roofline: preset {preset} = {settings['model']} on {tensor_parallel}× "
            f"{settings['hardware']}, {roofline.weight_dtype} weights, MFU {roofline.mfu:g}"
        ),
        prefill_ms=lambda tokens: roofline.prefill_s(tokens) * 1000.0,
        price_per_hour=roofline.hardware.price_per_hour * tensor_parallel,
    )


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """The answer to one ``plan capacity`` question, ready to print or serialise."""

    rate: float
    slo_ttft_ms: float
    quantile: float
    prompt_tokens: int
    cached_fraction: float
    output_tokens: int
    uncached_tokens: float
    prefill_ms: float
    service_time_source: str
    sized: OperatingPoint
    price_per_hour: float | None
    hockey_stick: list[OperatingPoint]
    #: The request path outside the engine, in every TTFT (a calibrated profile's overhead).
    overhead_ms: float = 0.0

    @property
    def fleet_cost_per_hour(self) -> float | None:
        """$/hour of the sized fleet, when a price is known."""
        if self.price_per_hour is None:
            return None
        return self.sized.replicas * self.price_per_hour

    @property
    def cost_per_million_tokens(self) -> float | None:
        """$ per 1M tokens (prompt + output) at the planned rate, when a price is known."""
        cost = self.fleet_cost_per_hour
        tokens_per_hour = self.rate * 3600 * (self.prompt_tokens + self.output_tokens)
        if cost is None:
            return None
        return cost / (tokens_per_hour / 1e6)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form of the plan (``--json``)."""
        return {
            "inputs": {
                "rate": self.rate,
                "slo_ttft_ms": self.slo_ttft_ms,
                "quantile": self.quantile,
                "prompt_tokens": self.prompt_tokens,
                "cached_fraction": self.cached_fraction,
                "output_tokens": self.output_tokens,
            },
            "service": {
                "uncached_tokens": self.uncached_tokens,
                "prefill_ms": self.prefill_ms,
                "request_overhead_ms": self.overhead_ms,
                "source": self.service_time_source,
                "offered_load_erlangs": self.rate * self.prefill_ms / 1000.0,
            },
            "sized": asdict(self.sized),
            "cost": {
                "price_per_replica_hour": self.price_per_hour,
                "fleet_per_hour": self.fleet_cost_per_hour,
                "per_million_tokens": self.cost_per_million_tokens,
            },
            "hockey_stick": [asdict(point) for point in self.hockey_stick],
            "approximations": list(APPROXIMATIONS),
        }


def plan_capacity(args: argparse.Namespace) -> CapacityPlan:
    """Validate the command-line question and answer it."""
    _validate(args)
    uncached = args.prompt_tokens * (1.0 - args.cached_fraction)
    price = args.price_per_hour
    overhead_ms = 0.0
    if args.prefill_ms is not None:
        prefill_ms, source = args.prefill_ms, "given with --prefill-ms"
        if args.profile is not None and price is None:
            price = engine_model(args.profile).price_per_hour
    else:
        model = engine_model(args.profile)
        prefill_ms, source = model.prefill_ms(uncached), model.describe
        overhead_ms = model.overhead_ms
        price = model.price_per_hour if price is None else price
    replicas = replicas_needed(
        args.rate, args.slo_ttft_ms, prefill_ms, args.quantile, overhead_ms
    )
    return CapacityPlan(
        rate=args.rate,
        slo_ttft_ms=args.slo_ttft_ms,
        quantile=args.quantile,
        prompt_tokens=args.prompt_tokens,
        cached_fraction=args.cached_fraction,
        output_tokens=args.output_tokens,
        uncached_tokens=uncached,
        prefill_ms=prefill_ms,
        service_time_source=source,
        sized=operating_point(replicas, args.rate, prefill_ms, args.quantile, overhead_ms),
        price_per_hour=price,
        hockey_stick=hockey_stick(replicas, prefill_ms, args.quantile, overhead_ms),
        overhead_ms=overhead_ms,
    )


def _finite(value: float) -> float:
    """``value``, or NaN where it is infinite: every comparison with it then fails, as NaN's
    does (``--rate inf`` passed ``> 0`` and failed later with an inner name; an infinite
    price reached the JSON as ``Infinity``: the CLI review)."""
    return value if math.isfinite(value) else math.nan


def _validate(args: argparse.Namespace) -> None:
    checks = [
        (_finite(args.rate) > 0, f"--rate must be a number > 0 requests/s (got {args.rate})"),
        (
            _finite(args.slo_ttft_ms) > 0,
            f"--slo-ttft-ms must be a number > 0 (got {args.slo_ttft_ms})",
        ),
        (args.prompt_tokens >= 1, f"--prompt-tokens must be >= 1 (got {args.prompt_tokens})"),
        (args.output_tokens >= 0, f"--output-tokens must be >= 0 (got {args.output_tokens})"),
        (
            0 <= args.cached_fraction < 1,
            f"--cached-fraction must be in [0, 1) (got {args.cached_fraction})",
        ),
        (0 < args.quantile < 1, f"--quantile must be in (0, 1) (got {args.quantile})"),
        (
            args.prefill_ms is None or _finite(args.prefill_ms) > 0,
            f"--prefill-ms must be a number > 0 (got {args.prefill_ms})",
        ),
        (
            args.price_per_hour is None or _finite(args.price_per_hour) >= 0,
            f"--price-per-hour must be a number >= 0 (got {args.price_per_hour})",
        ),
        (
            args.prefill_ms is not None or args.profile is not None,
            "give --profile PRESET (roofline prefill time) or --prefill-ms MS (measured)",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise CapacityError(message)


# --------------------------------------------------------------------------- output


def render_text(plan: CapacityPlan) -> str:
    """The human-readable answer: sizing, cost, hockey-stick table, approximations."""
    q = f"p{plan.quantile * 100:g}"
    sized = plan.sized
    lines = [
        "fleetgate plan capacity: M/M/c (Erlang C) sizing of the prefill stage",
        f"  demand:  {plan.rate:g} req/s, {plan.prompt_tokens} prompt tokens "
        f"({plan.cached_fraction:.0%} cached -> {plan.uncached_tokens:.0f} to prefill), "
        f"{plan.output_tokens} output tokens",
        f"  service: {plan.prefill_ms:.1f} ms prefill per request ({plan.service_time_source})"
        + (
            f"; + {plan.overhead_ms:.1f} ms request path in every TTFT (no replica busy)"
            if plan.overhead_ms
            else ""
        ),
        f"  load:    {plan.rate * plan.prefill_ms / 1000:.2f} Erlangs (replicas busy on average)",
        "",
        f"replicas needed: {sized.replicas}  (utilisation {sized.utilisation:.0%}, "
        f"P(wait) {sized.prob_wait:.0%}, {q} TTFT {sized.ttft_ms:.0f} ms vs SLO "
        f"{plan.slo_ttft_ms:g} ms)",
    ]
    if plan.price_per_hour is None:
        lines.append("cost: pass --price-per-hour (or --profile) for $/hour and $ per 1M tokens")
    else:
        lines.append(
            f"cost: {sized.replicas} × ${plan.price_per_hour:.2f}/h = "
            f"${plan.fleet_cost_per_hour:.2f}/h; ${plan.cost_per_million_tokens:.4f} per 1M "
            "tokens (prompt + output)"
        )
    lines += [
        "",
        f"TTFT hockey stick at {sized.replicas} replicas ({q}, ms):",
        f"  {'utilisation':>11}  {'req/s':>8}  {'P(wait)':>7}  {q + ' TTFT':>10}",
    ]
    for point in plan.hockey_stick:
        marker = "  <- SLO exceeded" if point.ttft_ms > plan.slo_ttft_ms else ""
        lines.append(
            f"  {point.utilisation:>11.0%}  {point.rate:>8.2f}  {point.prob_wait:>7.0%}  "
            f"{point.ttft_ms:>10.0f}{marker}"
        )
    lines += ["", "approximations (read before trusting the numbers):"]
    lines += [
        textwrap.fill(text, width=100, initial_indent="  - ", subsequent_indent="    ")
        for text in APPROXIMATIONS
    ]
    return "\n".join(lines)


def plot_hockey_stick(plan: CapacityPlan, path: str) -> None:
    """Write TTFT vs utilisation (with the SLO and the sized point) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt

    q = f"p{plan.quantile * 100:g}"
    # A fine grid makes the knee of the curve visible; the table keeps the coarse one.
    service_rate = 1000.0 / plan.prefill_ms
    replicas = plan.sized.replicas
    rhos = [i / 200 for i in range(1, 199)]
    ttft = [
        ttft_percentile_ms(
            replicas, rho * replicas * service_rate, plan.prefill_ms, plan.quantile,
            plan.overhead_ms,
        )
        for rho in rhos
    ]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.plot([r * 100 for r in rhos], ttft, label=f"{q} TTFT, {replicas} replicas")
    axes.axhline(
        plan.slo_ttft_ms, color="red", linestyle="--", label=f"SLO {plan.slo_ttft_ms:g} ms"
    )
    axes.plot(
        [plan.sized.utilisation * 100],
        [plan.sized.ttft_ms],
        "o",
        color="black",
        label=f"planned: {plan.rate:g} req/s",
    )
    axes.set_ylim(0, max(plan.slo_ttft_ms * 3, plan.sized.ttft_ms * 1.5))
    axes.set_xlabel("utilisation (%)")
    axes.set_ylabel(f"{q} TTFT (ms)")
    axes.set_title("TTFT vs utilisation (M/M/c approximation)")
    axes.legend(loc="upper left")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# --------------------------------------------------------------------------- CLI

EPILOG = """\
examples:
  # 20 req/s of 4,000-token RAG prompts, 70% served from the prefix cache, p95 TTFT <= 800 ms
  fleetgate plan capacity --rate 20 --slo-ttft-ms 800 --prompt-tokens 4000 \\
      --cached-fraction 0.7 --output-tokens 250 --profile h100-llama3-8b --plot ttft.png
  # the same with a measured prefill time instead of the roofline model
  fleetgate plan capacity --rate 20 --slo-ttft-ms 800 --prompt-tokens 4000 \\
      --output-tokens 250 --prefill-ms 120 --price-per-hour 3.0 --json

Presets (--profile) live in replica/sim/profiles/presets.yaml. The model is approximate; the
output lists how. Size for the busiest window's rate, not the daily average.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``fleetgate plan capacity``."""
    parser.description = (
        "Replicas needed to keep TTFT at a percentile within its SLO, from Erlang C on the\n"
        "prefill stage; plus the TTFT-vs-utilisation hockey stick and the fleet's cost."
    )
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--rate", type=float, required=True, help="arrival rate, requests/s")
    parser.add_argument(
        "--slo-ttft-ms", type=float, required=True, help="TTFT SLO at --quantile, in ms"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, required=True, help="mean prompt length, tokens"
    )
    parser.add_argument(
        "--cached-fraction",
        type=float,
        default=0.0,
        help="share of prompt tokens served from the prefix cache, 0..1 (default: 0); shortens "
        "the prefill that --profile models (--prefill-ms is the uncached part's time already)",
    )
    parser.add_argument(
        "--output-tokens", type=int, required=True, help="mean output length, tokens (for cost)"
    )
    parser.add_argument(
        "--profile",
        help="engine preset for the roofline prefill time and price (e.g. h100-llama3-8b), or "
        "a profile YAML from `fleetgate sim calibrate` (its measured step time: a lone "
        "request's request-path overhead and its prefill in chunks, as `fleetgate simulate` "
        "serves it)",
    )
    parser.add_argument(
        "--prefill-ms",
        type=float,
        help="measured prefill time of one request's uncached tokens, ms (overrides --profile)",
    )
    parser.add_argument(
        "--price-per-hour",
        type=float,
        help="$ per replica-hour (default: the --profile hardware's list price × GPUs)",
    )
    parser.add_argument(
        "--quantile", type=float, default=0.95, help="TTFT percentile of the SLO (default: 0.95)"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="write the hockey stick as a PNG")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    """Answer the question; exit status 2 with a one-line error for bad or impossible input."""
    try:
        plan = plan_capacity(args)
        if not _finite_figures(plan.to_dict()):
            # Each input finite, a product not ($inf/h at --price-per-hour 1e308; and JSON
            # has no infinity).
            raise CapacityError(
                "these inputs give figures past what a float holds: check the magnitudes of "
                "--rate, --price-per-hour and the prefill and token numbers"
            )
    except CapacityError as exc:
        print(f"fleetgate plan capacity: error: {exc}", file=sys.stderr)
        return 2
    if args.prefill_ms is not None and args.cached_fraction:
        print(
            "fleetgate plan capacity: note: --prefill-ms is taken as the prefill time of what "
            "is not cached already, so --cached-fraction changes nothing here (give the cold "
            "prompt's time with --profile instead, to let the cache shorten it)",
            file=sys.stderr,
        )
    if args.plot:
        problem = plot_path_problem(args.plot)
        if problem is not None:
            print(
                f"fleetgate plan capacity: error: cannot write {args.plot}: {problem}",
                file=sys.stderr,
            )
            return 2
        try:
            plot_hockey_stick(plan, args.plot)
        except (OSError, ValueError) as exc:  # e.g. the disk filled up
            print(f"fleetgate plan capacity: cannot write {args.plot}: {exc}", file=sys.stderr)
            return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else render_text(plan))
    if args.plot and not args.json:
        print(f"\nwrote {args.plot}")
    return 0


def _finite_figures(value: object) -> bool:
    """True when every number in ``value`` (a plan's dict) is finite."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite_figures(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_finite_figures(v) for v in value)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run as ``python -m planning.capacity`` (same flags as ``fleetgate plan capacity``)."""
    parser = argparse.ArgumentParser(prog="fleetgate plan capacity")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
