"""``fleetgate triage``: read a route's symptoms and print the serving levers to pull, in order.

The decision chart lives in ``planning/triage/decide.py`` (pure); this module only picks the
source (a file, a running gateway, Prometheus), applies command-line defaults and prints.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import httpx

from fleetgate.commands._args import http_url, positive_float, promql_duration, promql_seconds
from planning.triage import MetricsError, RouteMetrics, triage
from planning.triage.flags import annotate
from planning.triage.gateway_source import fetch_gateway_metrics
from planning.triage.inputs import load_metrics_file
from planning.triage.model import SourceError
from planning.triage.prometheus_source import fetch_prometheus_metrics
from planning.triage.render import to_json, to_text

EPILOG = """\
decision chart (levers are listed in this order):
  1. TTFT p95 over SLO  -> prefix caching + prefix-aware routing (if > 30% of prompt tokens are a
                           shared prefix), then queueing (replicas, admission control), then
                           chunked prefill or prefill/decode disaggregation
  2. KV cache limits     -> FP8 KV cache, then FP8/INT4 weights (vLLM --quantization fp8);
                           "limits": any preemption, or KV >= 90% while requests wait
                           (waiting_mean >= 1) or the queue grows (waiting_growth_per_min > 0):
                           the definition `fleetgate advise` uses
  3. TPOT p95 over SLO  -> weight quantization if --quality-headroom, else smaller max batch /
                           more replicas / speculative decoding
  4. > 3 fine-tuned variants -> LoRA adapters on one base model
  5. none of these      -> within SLO: capacity headroom and cost per 1M tokens, not tuning
                           ("SLO not checked" or "no signals" when that is all it rests on)
  Also flagged: cache-busting prompt layouts, and capacity planned from averages (p95 TTFT over
  SLO while average utilisation is low).

input file (YAML or JSON), one route or a mapping of route -> these keys (all optional):
  ttft_p95_ms, ttft_slo_ms, tpot_p95_ms, tpot_slo_ms, shared_prefix_fraction (0..1),
  kv_cache_usage (0..1), preemptions_per_min, waiting_mean (requests waiting per replica),
  waiting_growth_per_min (queue growth per replica, requests/min; may be negative),
  fine_tuned_variants, quality_headroom (bool), cache_busting_layout (bool), utilisation (0..1),
  ttft_slo_missed, tpot_slo_missed (0..1, share of requests that missed: decides over-SLO),
  shed_share (0..1, share flow control refused for saturation)

examples:
  fleetgate triage --input routes.yaml
  fleetgate triage --gateway http://localhost:8000 --slo-ttft-ms 1000 --slo-tpot-ms 50
  fleetgate triage --prometheus http://prometheus:9090 --window 30m --slo-ttft-ms 800 --json
  fleetgate triage --prometheus http://prometheus:9090 --window 15m --selector 'namespace="prod"'

--json prints [{"lever": CATEGORY, "reason": TEXT}, ...] for a single-route file, else
{ROUTE: [...]}. Categories: prefix-caching, queueing, kv-quantization, weight-quantization,
reduce-batch, multi-lora, capacity-headroom. The capacity-headroom lever also has "state":
"within SLO", "SLO not checked" or "no signals".
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``fleetgate triage``."""
    parser.description = (
        "Read per-route symptoms (TTFT/TPOT vs SLO, prefix sharing, KV pressure, fine-tunes)\n"
        "and print the levers to pull, in order, with the numbers behind each."
    )
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", metavar="FILE", help="YAML or JSON file of route metrics")
    source.add_argument(
        "--gateway", type=http_url("a gateway's URL"), metavar="URL",
        help="a running fleetgate gateway (scrapes URL/metrics)",
    )
    source.add_argument(
        "--prometheus", type=http_url("a Prometheus URL"), metavar="URL",
        help="a Prometheus server scraping gateways and engines",
    )
    parser.add_argument(
        "--window", type=promql_duration, default="10m",
        help="PromQL range for rates and percentiles (default: 10m)",
    )
    parser.add_argument(
        "--selector", type=_label_matchers, default="", metavar="MATCHERS",
        help="--prometheus: read only the series with these labels, e.g. "
        "'namespace=\"prod\"' (one Prometheus scraping staging and production mixed them)",
    )
    parser.add_argument(
        # The spelling of simulate, advise and plan first; the older one still works.
        "--slo-ttft-ms", "--ttft-slo-ms", dest="ttft_slo_ms", type=positive_float,
        help="TTFT p95 SLO for routes whose input has none",
    )
    parser.add_argument(
        "--slo-tpot-ms", "--tpot-slo-ms", dest="tpot_slo_ms", type=positive_float,
        help="TPOT p95 SLO for routes whose input has none",
    )
    parser.add_argument(
        "--quality-headroom",
        action="store_true",
        help="the model can afford some quality loss: allow weight quantization for TPOT",
    )
    parser.add_argument("--route", action="append", help="only these routes (repeatable)")
    parser.add_argument(
        "--timeout", type=positive_float, default=10.0, help="HTTP timeout, s (default 10)"
    )
    parser.add_argument("--json", action="store_true", help="print levers as JSON")
    parser.add_argument(
        "--advice",
        metavar="SNAPSHOT",
        help="a `fleetgate advise --save` snapshot: levers that name a vLLM flag also say, per "
        "pool, the value advise recommends for it",
    )


#: One PromQL label matcher: a label name, an operator, a double-quoted value.
_MATCHER = r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*'


def _label_matchers(text: str) -> str:
    """``name="value"`` matchers, comma-separated (PromQL's inside ``{}``), or a usage error."""
    import re

    text = text.strip().removeprefix("{").removesuffix("}").strip()
    if text and not re.fullmatch(f"{_MATCHER}(,{_MATCHER})*,?", text):
        raise argparse.ArgumentTypeError(
            f"label matchers such as namespace=\"prod\",job=~\"fleetgate.*\" (got {text!r})"
        )
    return text.rstrip(",")


#: The share of the window the data must cover before rates over it are trusted.
_COVERED = 0.8


def load(args: argparse.Namespace) -> dict[str, RouteMetrics]:
    """Route metrics from the chosen source, with command-line defaults filled in."""
    if args.input:
        routes = load_metrics_file(args.input)
    else:
        with httpx.Client(timeout=args.timeout) as client:
            if args.gateway:
                routes = fetch_gateway_metrics(args.gateway, client)
            else:
                routes = fetch_prometheus_metrics(
                    args.prometheus, client, args.window, args.selector
                )
                _warn_when_short(args, client)
                if note := engine_series_note(routes, args.selector):
                    print(f"fleetgate triage: warning: {note}", file=sys.stderr)
    defaults = RouteMetrics(
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
        quality_headroom=args.quality_headroom,
    )
    if args.route:
        unknown = sorted(set(args.route) - set(routes))
        if unknown:
            raise MetricsError(
                f"--route {unknown[0]}: not in the input"
                + (f" (or it had no requests in the last {args.window})" if args.prometheus else "")
                + f"; routes: {', '.join(routes) or 'none'}"
            )
        routes = {name: routes[name] for name in args.route}
    return {name: metrics.merged(defaults) for name, metrics in routes.items()}


def engine_series_note(routes: dict[str, RouteMetrics], selector: str) -> str | None:
    """What to check when Prometheus gave no engine figure at all (the KV rules then say only
    "needs kv_cache_usage", which names a source already in use)."""
    if not routes or any(
        m.kv_cache_usage is not None or m.preemptions_per_min is not None
        for m in routes.values()
    ):
        return None
    where = (
        f"; --selector {selector} must match the engines' labels too" if selector else ""
    )
    return (
        "no vllm:* series in the window: KV pressure is not checked. Does this Prometheus "
        f"scrape the engines (vLLM's /metrics){where}?"
    )


def _warn_when_short(args: argparse.Namespace, client: httpx.Client) -> None:
    """Say when the gateway's series reach back less than the window: every rate over it
    (utilisation, preemptions, refusals) is then diluted (a fleet 99% busy read 12% in a 1h
    window three minutes after the data began: the Prometheus review)."""
    from planning.triage.prometheus_source import window_coverage_s

    covered = window_coverage_s(args.prometheus, client, args.window, args.selector)
    window_s = promql_seconds(args.window)
    if covered is not None and covered < _COVERED * window_s:
        print(
            f"fleetgate triage: warning: the gateway's series cover only the last {covered:.0f} s "
            f"of the {args.window} window: rates over it are diluted; pass --window "
            f"{max(1, int(covered))}s",
            file=sys.stderr,
        )


def _advice(path: str) -> dict[str, list[Any]]:
    """Advise's rows per pool for the snapshot at ``path`` (the flags triage's levers name)."""
    from planning.advise.decide import advise
    from planning.advise.snapshot import load_snapshot

    return {pool: advise(snapshot) for pool, snapshot in load_snapshot(path).items()}


def run(args: argparse.Namespace) -> int:
    """Triage every route; exit 2 on bad input, 1 when a source cannot be read."""
    if args.selector and not args.prometheus:
        print("fleetgate triage: error: --selector reads Prometheus: give --prometheus URL",
              file=sys.stderr)
        return 2
    try:
        routes = load(args)
    except MetricsError as exc:
        print(f"fleetgate triage: error: {exc}", file=sys.stderr)
        return 2
    except SourceError as exc:
        print(f"fleetgate triage: cannot read metrics: {exc}", file=sys.stderr)
        return 1
    if not routes:
        print(
            "fleetgate triage: no route had requests in what the source holds"
            + (
                f" (the last {args.window}: a window shorter than two scrapes holds none; "
                "check --selector too)"
                if args.prometheus
                else ""
            ),
            file=sys.stderr,
        )
        return 1
    results = {name: triage(metrics) for name, metrics in routes.items()}
    if args.advice:
        try:
            advice = _advice(args.advice)
        except (OSError, ValueError) as exc:
            print(f"fleetgate triage: --advice {args.advice}: {exc}", file=sys.stderr)
            return 2
        results = {name: annotate(levers, advice) for name, levers in results.items()}
    print(to_json(results) if args.json else to_text(routes, results))
    return 0
