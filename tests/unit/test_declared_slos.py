"""The SLOs routing follows: those a tenant or route declares, never the metrics' defaults."""

from __future__ import annotations

import yaml

from gateway.policy_view import GatewayPolicy, from_policy
from gateway.request.route import declared_slos
from routing.config import parse_policy


def _view(tenants: list[dict[str, object]], routes: list[dict[str, object]]) -> GatewayPolicy:
    doc = {
        "version": 1,
        "replica_pools": [{"name": "p", "replicas": ["http://127.0.0.1:9"]}],
        "models": [{"name": "m", "pools": ["p"]}],
        "tenants": tenants,
        "routes": routes,
    }
    return from_policy(parse_policy(yaml.safe_dump(doc)))


def test_routing_follows_declared_slos_tenant_first() -> None:
    view = _view(
        [
            {"name": "plain"},
            {"name": "fast", "ttft_slo_ms": 500},
        ],
        [
            {
                "name": "chat",
                "match": {"tenant": "fast"},
                "slo": {"ttft_p95_ms": 800, "tpot_p95_ms": 20},
            },
            {"name": "bulk", "match": {"tenant": "plain"}},
        ],
    )
    chat, bulk = view.routes[0], view.routes[1]
    # The route's own figures, with the tenant's TTFT objective ahead of them.
    assert declared_slos(view, "fast", chat) == {"ttft_slo_ms": 500.0, "tpot_slo_ms": 20.0}
    # A route without an slo is measured against defaults (2,000 / 100 ms) for the metrics, but
    # those are not objectives anyone declared: routing keeps its own thresholds.
    assert (bulk.ttft_slo_ms, bulk.tpot_slo_ms) == (2000.0, 100.0)
    assert declared_slos(view, "plain", bulk) == {"ttft_slo_ms": None, "tpot_slo_ms": None}
    assert declared_slos(view, "fast", bulk) == {"ttft_slo_ms": 500.0, "tpot_slo_ms": None}
