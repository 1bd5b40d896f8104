"""The built-in ``/dashboard`` in a real headless Chromium, against ``fleetgate up``'s stack.

Real traffic goes through a gateway with two simulated replicas and two demo adapters; then the
page is loaded with the admin key (as a URL fragment) and must render every panel, show the same
request count, prefix hit rate and TTFT p95 as ``/metrics`` (and a cost between two scrapes of
it) and the engines' own prefix hit rate for the pool, list both replicas with the adapters they
loaded and the last routing decisions, and log no console error. A screenshot is written to the
test's directory, and to ``$FLEETGATE_DASHBOARD_SCREENSHOT`` when set.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from fleetgate.commands.up import banner
from fleetgate.embedded import embedded_stack
from gateway.dashboard.histograms import histogram_quantile, in_first_bucket
from tests.support.chromium import headless_page
from tests.support.polling import wait_until

ADMIN_KEY = "dashboard-test-admin-key"
REQUESTS = 60
SYSTEM_PROMPTS = [f"You are assistant {n}. " + "Answer briefly and politely. " * 30 for n in "ABC"]
ROUTE = "default"
#: What the page shows per route, read from each number cell's raw ``data-value``.
READ_ROUTE = """(() => {
  const row = document.querySelector('#routes tr[data-route="%s"]');
  if (!row) return null;
  const out = {};
  for (const td of row.querySelectorAll("td[data-field]")) {
    out[td.dataset.field] = td.dataset.value === undefined ? null : Number(td.dataset.value);
    out["text:" + td.dataset.field] = td.textContent;
  }
  return out;
})()"""
READ_PAGE = """(() => ({
  ready: document.body.dataset.ready,
  replicas: [...document.querySelectorAll("#replicas tbody tr[data-replica]")].map((tr) =>
    [tr.dataset.replica, tr.children[2].textContent, tr.children[8].textContent]),
  pools: [...document.querySelectorAll("#pools tbody tr[data-pool]")].map((tr) => tr.dataset.pool),
  poolHitRate: Number(document.querySelector(
    '#pools tr[data-pool="default"] td[data-field="prefix_hit_rate"]').dataset.value),
  decisions: document.querySelectorAll("#decisions tbody tr td.cand").length,
  tiles: document.querySelectorAll("#tiles .tile").length,
  loginShown: getComputedStyle(document.getElementById("login")).display !== "none",
  status: document.getElementById("status").textContent,
  pageErrors: window.__dashboardErrors,
}))()"""


async def _send_traffic(http: aiohttp.ClientSession, url: str, models: list[str]) -> None:
    rng = random.Random(21)
    for n in range(REQUESTS):
        model = models[1 + n % (len(models) - 1)] if n % 5 == 0 else models[0]
        body: dict[str, Any] = {
            "model": model,
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPTS[n % len(SYSTEM_PROMPTS)]},
                {"role": "user", "content": f"Question {rng.randrange(40)}: what is {n}?"},
            ],
            "max_tokens": rng.randint(4, 16),
            "stream": n % 2 == 0,
        }
        async with http.post(f"{url}/v1/chat/completions", json=body) as response:
            await response.read()
            assert response.status == 200, await response.text()


async def _engine_hit_rate(http: aiohttp.ClientSession, replica_urls: list[str]) -> float:
    """The engines' own prefix-cache hit rate, summed over replicas: hits / queries (tokens)."""
    totals = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    for url in replica_urls:
        async with http.get(f"{url}/metrics") as response:
            text = await response.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
    return totals["vllm:prefix_cache_hits_total"] / totals["vllm:prefix_cache_queries_total"]


def _ttft_p95(text_buckets: dict[float, float]) -> tuple[float | None, bool]:
    """The p95 the page must show, and whether only as an upper bound: in the first bucket it
    is that bucket's bound (interpolating from 0 would make a figure up)."""
    buckets = sorted(text_buckets.items())
    if in_first_bucket(0.95, buckets):
        return buckets[0][0], True
    return histogram_quantile(0.95, buckets), False


async def _route_ttft_buckets(http: aiohttp.ClientSession, url: str) -> dict[float, float]:
    """``sum by (le) (fleetgate_ttft_seconds_bucket{route})`` from ``/metrics``."""
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "fleetgate_ttft_seconds_bucket" and sample.labels["route"] == ROUTE:
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return buckets


async def _metrics(http: aiohttp.ClientSession, url: str) -> dict[str, dict[str, float]]:
    """``/metrics``: sample name -> route -> value summed over the other labels."""
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            route = sample.labels.get("route")
            if route is not None:
                by_route = out.setdefault(sample.name, {})
                by_route[route] = by_route.get(route, 0.0) + sample.value
    return out


async def test_dashboard_renders_in_chromium_and_matches_metrics(tmp_path: Path) -> None:
    async with (
        embedded_stack(2, sim_speed=200.0, admin_key=ADMIN_KEY, adapters=2) as stack,
        aiohttp.ClientSession() as http,
    ):
        await _send_traffic(http, stack.url, [stack.model, *stack.adapters])
        async with http.get(f"{stack.url}/dashboard/data") as response:
            assert response.status == 401, "the page's data needs the admin key"
        metrics_before = await _metrics(http, stack.url)
        requests_total = metrics_before["fleetgate_requests_total"][ROUTE]
        assert requests_total == REQUESTS

        async with headless_page() as page:
            await page.navigate(f"{stack.url}/dashboard#key={ADMIN_KEY}")

            async def shows_all_requests() -> bool:
                row = await page.evaluate(READ_ROUTE % ROUTE)
                return bool(row) and row["requests_total"] == requests_total

            await wait_until(
                shows_all_requests,
                f"the page's {ROUTE} row shows {requests_total:.0f} requests",
                timeout_s=30,
                interval_s=0.2,
            )
            row = await page.evaluate(READ_ROUTE % ROUTE)
            shown = await page.evaluate(READ_PAGE)
            # Read /metrics again after the page: the window gauges are recomputed per scrape.
            metrics = await _metrics(http, stack.url)
            engine_hit_rate = await _engine_hit_rate(http, stack.replica_urls)
            ttft_buckets = await _route_ttft_buckets(http, stack.url)
            # Let one more poll land so a late console error from it would be seen.
            before = await page.evaluate("document.body.dataset.generatedAt")
            await wait_until(
                lambda: _refreshed(page, before), "the page polled its data again", timeout_s=15
            )
            png = await page.screenshot(tmp_path / "dashboard.png", width=1500)
            if target := os.environ.get("FLEETGATE_DASHBOARD_SCREENSHOT"):
                Path(target).write_bytes(png)
            problems = list(page.problems)

    assert row["prefix_hit_rate"] == metrics["fleetgate_prefix_hit_rate"][ROUTE]
    assert 0 < row["prefix_hit_rate"] < 1, "shared system prompts must hit the prefix cache"
    # Cost charges the pool's idle time too, so it grows while the fleet idles: the page's value,
    # computed between the two scrapes, lies between them.
    cost = "fleetgate_cost_per_1m_tokens_usd"
    assert 0 < metrics_before[cost][ROUTE] <= row[cost.removeprefix("fleetgate_")]
    assert row[cost.removeprefix("fleetgate_")] <= metrics[cost][ROUTE]
    p95, at_most = _ttft_p95(ttft_buckets)
    assert row["ttft_p95"] == p95
    assert row["text:ttft_p95"].startswith("\u2264") == at_most, row["text:ttft_p95"]
    assert shown["poolHitRate"] == engine_hit_rate
    assert row["goodput"] is not None and 0 <= row["goodput"] <= 1
    for timer in ("queue", "ttft", "itl", "tpot"):
        assert row[f"{timer}_p50"] <= row[f"{timer}_p95"] <= row[f"{timer}_p99"], timer
    assert shown["ready"] == "1" and shown["status"].startswith("live"), shown
    assert not shown["loginShown"], "the key in the fragment must open the page"
    assert sorted(r[0] for r in shown["replicas"]) == ["sim/0", "sim/1"], shown
    assert all(r[1] == "healthy" for r in shown["replicas"]), shown
    loaded = " ".join(r[2] for r in shown["replicas"])
    assert all(adapter in loaded for adapter in stack.adapters), shown["replicas"]
    assert shown["pools"] == ["default"]
    assert shown["decisions"] > 0 and shown["tiles"] == 5
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    assert not shown["pageErrors"] and not problems, (shown["pageErrors"], problems)


async def _refreshed(page: Any, before: str) -> bool:
    return await page.evaluate("document.body.dataset.generatedAt") != before


async def test_dashboard_is_open_without_an_admin_key_and_guarded_with_one() -> None:
    async with aiohttp.ClientSession() as http:
        async with embedded_stack(1, sim_speed=200.0, admin_key=ADMIN_KEY) as stack:
            # `fleetgate up` prints the page's URL with the key as a fragment (never sent).
            assert f"{stack.url}/dashboard#key={ADMIN_KEY}" in banner(stack, ADMIN_KEY)
            async with http.get(f"{stack.url}/dashboard") as response:
                page = await response.text()
                assert response.status == 200 and "<title>fleetgate dashboard" in page
                assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
            wrong = {"Authorization": "Bearer not-the-key"}
            async with http.get(f"{stack.url}/dashboard/data", headers=wrong) as response:
                assert response.status == 401
                assert (await response.json())["error"]["code"] == "invalid_api_key"
        async with (
            embedded_stack(1, sim_speed=200.0, admin_key=None) as stack,
            http.get(f"{stack.url}/dashboard/data") as response,
        ):
            assert response.status == 200
            assert [r["replica"] for r in (await response.json())["replicas"]] == ["sim/0"]



async def test_dashboard_shows_a_cache_busting_layout_warning() -> None:
    """A per-request stamp before the shared system prompt: the page warns, as /metrics flags."""
    shared = SYSTEM_PROMPTS[0]
    async with (
        embedded_stack(2, sim_speed=200.0, admin_key=ADMIN_KEY) as stack,
        aiohttp.ClientSession() as http,
    ):
        for n in range(24):
            system = f"request {n} at 2026-11-29T12:{n:02d}:00Z. {shared}"
            body = {
                "model": stack.model,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": "hi"},
                ],
                "max_tokens": 4,
            }
            async with http.post(f"{stack.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
        metrics = await _metrics(http, stack.url)
        assert metrics["fleetgate_cache_busting_layout"][ROUTE] == 1.0
        async with headless_page() as page:
            await page.navigate(f"{stack.url}/dashboard#key={ADMIN_KEY}")

            async def warned() -> bool:
                items = await page.evaluate(
                    '[...document.querySelectorAll("#warnings li")].map((li) => li.textContent)'
                )
                return any(item.startswith(f"route {ROUTE}:") for item in items or [])

            await wait_until(warned, "the page lists the route's layout warning", timeout_s=30)
            marked = await page.evaluate(
                f'document.querySelector(\'#routes tr[data-route="{ROUTE}"]\').textContent'
            )
            problems = list(page.problems)
    assert "⚠ layout" in marked
    assert not problems, problems
