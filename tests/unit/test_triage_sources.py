"""Reading triage signals from a gateway's /metrics and from Prometheus (mock transports)."""

from __future__ import annotations

import math

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from planning.triage.gateway_source import fetch_gateway_metrics, parse_gateway_metrics
from planning.triage.histogram import histogram_quantile
from planning.triage.model import RouteMetrics, SourceError
from planning.triage.prometheus_source import fetch_prometheus_metrics


@pytest.mark.parametrize(
    ("quantile", "buckets", "expected"),
    [
        # 100 observations: 90 in (0, 1], 10 in (1, 2]; rank 95 is halfway into the second.
        (0.95, [(1.0, 90), (2.0, 100), (math.inf, 100)], 1.5),
        (0.5, [(1.0, 90), (2.0, 100), (math.inf, 100)], 50 / 90),
        # A rank in +Inf returns the highest finite bound, as Prometheus does.
        (0.99, [(1.0, 10), (math.inf, 100)], 1.0),
        # Unsorted input is fine.
        (0.95, [(math.inf, 100), (2.0, 100), (1.0, 90)], 1.5),
        (0.95, [(1.0, 0), (math.inf, 0)], None),
        (0.95, [], None),
    ],
)
def test_histogram_quantile(quantile: float, buckets: list, expected: float | None) -> None:
    result = histogram_quantile(quantile, buckets)
    assert result == (None if expected is None else pytest.approx(expected))


def _gateway_exposition() -> str:
    registry = CollectorRegistry()
    buckets = (0.25, 2.5, 5.0)
    ttft = Histogram(
        "fleetgate_ttft_seconds", "", ["route", "model"], buckets=buckets, registry=registry
    )
    tpot = Histogram(
        "fleetgate_tpot_seconds", "", ["route", "model"], buckets=(0.01, 0.1), registry=registry
    )
    requests = Counter(
        "fleetgate_requests", "", ["route", "model", "replica", "status"], registry=registry
    )
    repeat = Gauge("fleetgate_prefix_repeat_fraction", "", ["route"], registry=registry)
    busting = Gauge("fleetgate_cache_busting_layout", "", ["route"], registry=registry)
    slo = Gauge("fleetgate_route_slo_seconds", "", ["route", "slo"], registry=registry)
    slo.labels("rag", "ttft").set(2.0)  # rag declares a TTFT objective only
    # Refused before routing (a bad key): counted under "unrouted", which is not a route.
    requests.labels("unrouted", "", "none", "401").inc(3)
    # rag: 90 fast + 10 slow first tokens, split over two models (summed by route).
    for i in range(90):
        ttft.labels("rag", "llama" if i % 2 else "qwen").observe(0.2)
    for _ in range(10):
        ttft.labels("rag", "llama").observe(3.0)
    tpot.labels("rag", "llama").observe(0.05)
    requests.labels("rag", "llama", "r1", "200").inc(60)
    requests.labels("rag", "qwen", "r1", "200").inc(40)
    repeat.labels("rag").set(0.7)
    busting.labels("rag").set(0)
    busting.labels("chat").set(1)
    repeat.labels("chat").set(0.0)
    outcomes = Counter("fleetgate_slo_requests", "", ["route", "slo", "outcome"], registry=registry)
    outcomes.labels("rag", "ttft", "met").inc(90)
    outcomes.labels("rag", "ttft", "missed").inc(10)
    # Against the gateway's 100 ms default: rag declares no TPOT SLO.
    outcomes.labels("rag", "tpot", "met").inc(100)
    return generate_latest(registry).decode()


def test_gateway_metrics_per_route() -> None:
    routes = parse_gateway_metrics(_gateway_exposition())
    assert set(routes) == {"rag", "chat"}
    rag = routes["rag"]
    # Rank 95 of 100 lies halfway through the (2.5 s, 5 s] bucket's 10 observations.
    assert rag.ttft_p95_ms == pytest.approx(3750.0)
    assert rag.tpot_p95_ms == pytest.approx(10 + 90 * 0.95)
    assert rag.shared_prefix_fraction == 0.7
    assert rag.cache_busting_layout is False
    assert rag.fine_tuned_variants == 2
    assert (rag.ttft_slo_ms, rag.tpot_slo_ms) == (2000.0, None)
    assert (rag.ttft_slo_missed, rag.tpot_slo_missed) == (0.1, None)  # the declared one only
    chat = routes["chat"]
    assert chat.cache_busting_layout is True
    assert chat.ttft_p95_ms is None and chat.fine_tuned_variants is None


def test_gateway_fetch_appends_metrics_path() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, text=_gateway_exposition())

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        routes = fetch_gateway_metrics("http://gw:8000/", client)
        fetch_gateway_metrics("http://gw:8000/metrics", client)
    assert seen == ["http://gw:8000/metrics", "http://gw:8000/metrics"]
    assert "rag" in routes


def test_gateway_errors_name_the_url() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(503, text="down"))
    with httpx.Client(transport=transport) as client, pytest.raises(SourceError, match="gw:8000"):
        fetch_gateway_metrics("http://gw:8000", client)


def _vector(*series: tuple[dict, str]) -> dict:
    return {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [{"metric": m, "value": [1700000000.0, v]} for m, v in series],
        },
    }


PROMETHEUS_ANSWERS = {
    'fleetgate_slo_requests_total{slo="ttft",outcome="missed",': _vector(
        ({"route": "rag"}, "0.12")
    ),
    'fleetgate_slo_requests_total{slo="tpot",outcome="missed",': _vector(({"route": "rag"}, "0")),
    "fleetgate_flow_decisions_total": _vector(({}, "0.25")),
    "fleetgate_requests_total": _vector(({"route": "rag"}, "1"), ({"route": "unrouted"}, "1")),
    'fleetgate_route_slo_seconds{slo="ttft",': _vector(
        ({"route": "rag"}, "2000"), ({"route": "declared-but-idle"}, "800")
    ),
    'fleetgate_route_slo_seconds{slo="tpot",': _vector(),
    "fleetgate_ttft_seconds_bucket": _vector(
        ({"route": "rag"}, "2400"), ({"route": "idle"}, "NaN")
    ),
    "fleetgate_tpot_seconds_bucket": _vector(({"route": "rag"}, "38.5")),
    # A gauge keeps its value after the traffic stopped: no route of its own.
    "fleetgate_prefix_repeat_fraction": _vector(
        ({"route": "rag"}, "0.7"), ({"route": "gone"}, "1")
    ),
    "fleetgate_cache_busting_layout": _vector(({"route": "rag"}, "0")),
    "vllm:kv_cache_usage_perc": _vector(({}, "0.93")),
    "vllm:num_preemptions_total": _vector(({}, "2")),
    "vllm:num_requests_waiting": _vector(({}, "3.5")),
    "fleetgate_replica_seconds_total": _vector(({}, "0.4")),
}


def _prometheus(request: httpx.Request) -> httpx.Response:
    assert request.url.path == "/api/v1/query"
    promql = request.url.params["query"]
    assert "[30m]" in promql or "fleetgate_route_slo_seconds" in promql  # a gauge: no window
    for needle, answer in PROMETHEUS_ANSWERS.items():
        if needle in promql:
            return httpx.Response(200, json=answer)
    raise AssertionError(f"unexpected query {promql}")


def test_prometheus_per_route_and_fleet_signals() -> None:
    with httpx.Client(transport=httpx.MockTransport(_prometheus)) as client:
        routes = fetch_prometheus_metrics("http://prom:9090", client, window="30m")
    # "idle" had only a NaN percentile; "declared-but-idle" only its declared SLO.
    assert set(routes) == {"rag"}
    rag = routes["rag"]
    assert (rag.ttft_slo_ms, rag.tpot_slo_ms) == (2000.0, None)
    assert (rag.ttft_p95_ms, rag.tpot_p95_ms, rag.shared_prefix_fraction) == (2400, 38.5, 0.7)
    assert rag.cache_busting_layout is False
    assert rag.fine_tuned_variants == 1
    assert (rag.kv_cache_usage, rag.preemptions_per_min, rag.utilisation) == (0.93, 2.0, 0.4)
    assert rag.waiting_mean == 3.5
    # rag declares no TPOT SLO: the gateway counted its misses against its 100 ms default, not
    # the SLO triage may be given on the command line (the diff review).
    assert (rag.ttft_slo_missed, rag.tpot_slo_missed, rag.shed_share) == (0.12, None, 0.25)


def test_prometheus_query_errors_are_reported() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"status": "error", "error": "parse error"})

    with (
        httpx.Client(transport=httpx.MockTransport(handler)) as client,
        pytest.raises(SourceError, match="parse error"),
    ):
        fetch_prometheus_metrics("http://prom:9090", client)


def test_a_histogram_with_only_its_inf_bucket_has_no_quantile() -> None:
    """Nothing bounds the rank (Prometheus answers NaN): not a p95 of 0 ms."""
    inf = float("inf")
    assert histogram_quantile(0.95, [(inf, 10.0)]) is None
    assert histogram_quantile(0.95, [(0.1, 0.0), (inf, 10.0)]) == 0.1  # above the top bound


def test_prometheus_reads_queue_growth_as_advise_does() -> None:
    from planning.advise.prometheus_source import _queries

    advise_growth = _queries("30m", "pool")["waiting_growth_per_min"]

    def handler(request: httpx.Request) -> httpx.Response:
        promql = request.url.params["query"]
        if "fleetgate_ttft_seconds_bucket" in promql:
            return httpx.Response(200, json=_vector(({"route": "rag"}, "500")))
        if "deriv(vllm:num_requests_waiting{}[30m])" in promql:
            # The same figure as advise's query, over the fleet instead of by pool (and with
            # triage's empty --selector).
            assert promql.replace("{}", "") == advise_growth.replace(" by (pool) ", "")
            return httpx.Response(200, json=_vector(({}, "3")))
        if "vllm:num_requests_waiting" in promql:
            return httpx.Response(200, json=_vector(({}, "0.5")))
        if "vllm:kv_cache_usage_perc" in promql:
            return httpx.Response(200, json=_vector(({}, "0.95")))
        return httpx.Response(200, json=_vector())

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        routes = fetch_prometheus_metrics("http://prom:9090", client, window="30m")
    assert routes["rag"].waiting_growth_per_min == 3.0
    assert routes["rag"].waiting_mean == 0.5


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (401, "Unauthorized", "HTTP 401 Unauthorized (unauthorised: check the user and password"),
        (404, "404 page not found", "HTTP 404 Not Found (not found: is this a Prometheus base URL"),
        (400, '{"status": "error", "error": "bad window"}', "query failed (bad window)"),
    ],
)
def test_prometheus_errors_say_what_answered_and_never_the_password(
    status: int, body: str, says: str
) -> None:
    # A 401 read as "Expecting value: line 1 column 1", and every message printed the URL with
    # its basic-auth password (the Prometheus review).
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, text=body)

    with (
        httpx.Client(transport=httpx.MockTransport(handler)) as client,
        pytest.raises(SourceError) as raised,
    ):
        fetch_prometheus_metrics("http://sre:s3cret@prom:9090", client)
    assert says in str(raised.value)
    assert "s3cret" not in str(raised.value) and "sre:***@prom:9090" in str(raised.value)


def test_an_unreachable_prometheus_error_hides_the_password() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"cannot connect to {request.url}")

    with (
        httpx.Client(transport=httpx.MockTransport(handler)) as client,
        pytest.raises(SourceError) as raised,
    ):
        fetch_prometheus_metrics("http://sre:s3cret@prom:9090", client)
    assert "s3cret" not in str(raised.value)


def test_a_selector_scopes_every_series_triage_reads() -> None:
    # One Prometheus scraping staging and production mixed both fleets (the Prometheus review).
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.params["query"])
        return httpx.Response(200, json=_vector())

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        fetch_prometheus_metrics("http://prom:9090", client, "5m", 'namespace="prod"')
    selectors = sum(query.count("{") for query in seen)
    assert selectors and sum(query.count('namespace="prod"}') for query in seen) == selectors


def test_prometheus_without_engine_series_says_what_to_check() -> None:
    # With no vllm:* series, the KV rule said "needs kv_cache_usage ... from --prometheus":
    # the source already in use (the Prometheus review). A selector may be what drops them.
    from fleetgate.commands.triage import engine_series_note

    gateway_only = {"rag": RouteMetrics(ttft_p95_ms=700.0)}
    note = engine_series_note(gateway_only, 'job="fleetgate"')
    assert note is not None and "vllm:*" in note and '--selector job="fleetgate"' in note
    assert engine_series_note({"rag": RouteMetrics(kv_cache_usage=0.5)}, "") is None
