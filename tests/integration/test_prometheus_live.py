"""A real Prometheus scraping ``fleetgate up --sim 2`` under load evaluates every dashboard query.

Prometheus scrapes the gateway (its own and the adapter registry's metrics, plus the embedded
agents') and each simulated replica's vLLM-shaped ``/metrics`` every second, with the alert rules
loaded, while a few hundred requests (streamed or not, several tenants' prefixes, base model and
LoRA adapters) go through the gateway. Then every Grafana panel target and every recording rule
is evaluated through the HTTP API: each must return data, hit rates must lie in [0, 1], costs
must be positive, and every rule must evaluate without error.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from tests.integration.prometheus_support import (
    PanelQuery,
    PrometheusServer,
    ScrapeJob,
    panel_queries,
    rules,
    values,
    write_rules_file,
)
from tests.support.polling import wait_until

ADMIN_KEY = "prometheus-live-test"
MODEL = "sim-model"
ADAPTERS = ["demo-lora-0", "demo-lora-1"]
REQUESTS = 300
CONCURRENCY = 12
#: Tenants' shared system prompts: repeats make prefix-cache hits, so hit rates are not all 0.
SYSTEM_PROMPTS = [f"You are assistant {n}. " + "Answer briefly and politely. " * 30 for n in "ABC"]


@dataclass
class Stack:
    """A running ``fleetgate up``: the gateway URL and what Prometheus should scrape."""

    url: str
    replica_urls: list[str]
    agent_urls: list[str]
    output: list[str]


async def _start_up(output: list[str]) -> tuple[asyncio.subprocess.Process, str]:
    argv = ["up", "--sim", "2", "--port", "0", "--admin-key", ADMIN_KEY]
    argv += ["--adapters", str(len(ADAPTERS)), "--model", MODEL]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    async with asyncio.timeout(60):
        while True:
            line = (await process.stdout.readline()).decode()
            if not line:
                raise AssertionError("fleetgate up exited before it was up:\n" + "".join(output))
            output.append(line)
            if match := re.search(r"fleetgate is up: (http://127\.0\.0\.1:\d+)", line):
                return process, match.group(1)


async def _read_banner(process: asyncio.subprocess.Process, output: list[str]) -> None:
    """Read the banner up to its last line, which names the scrape targets before it."""
    assert process.stdout is not None
    async with asyncio.timeout(10):
        while not output[-1].startswith("Press Ctrl-C"):
            line = (await process.stdout.readline()).decode()
            if not line:
                raise AssertionError("fleetgate up exited:\n" + "".join(output))
            output.append(line)


def _targets(output: list[str], kind: str) -> list[str]:
    """The ``kind:  URL/metrics`` banner lines' base URLs (``replica`` or ``agent``)."""
    pattern = re.compile(rf"^\s+{kind}:\s+(http://\S+)/metrics$")
    return [m.group(1) for line in output if (m := pattern.match(line.rstrip()))]


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    output: list[str] = []
    process, url = await _start_up(output)
    await _read_banner(process, output)

    async def keep_reading() -> None:  # a full pipe would block the server
        assert process.stdout is not None
        while line := await process.stdout.readline():
            output.append(line.decode())

    drain = asyncio.create_task(keep_reading())
    try:
        replicas, agents = _targets(output, "replica"), _targets(output, "agent")
        assert len(replicas) == len(agents) == 2, "".join(output)
        yield Stack(url, replicas, agents, output)
    finally:
        process.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            await process.wait()
        drain.cancel()


def _host(url: str) -> str:
    return url.removeprefix("http://").rstrip("/")


def _scrape_jobs(stack: Stack) -> list[ScrapeJob]:
    # The labels the Kubernetes service discovery adds (deploy/base/servicemonitors.yaml): the
    # dashboard groups engines by pod.
    return [
        ScrapeJob("fleetgate-gateway", [_host(stack.url)], {"namespace": "fleetgate", "pod": "gw"}),
        ScrapeJob(
            "vllm-engines",
            [_host(u) for u in stack.replica_urls],
            {"namespace": "fleetgate", "pod": "sim"},
        ),
        ScrapeJob(
            "fleetgate-agents",
            [_host(u) for u in stack.agent_urls],
            {"namespace": "fleetgate", "pod": "sim"},
        ),
    ]


def _request(n: int, rng: random.Random) -> tuple[dict[str, Any], str]:
    """Request ``n`` of the load: its JSON body and the API key (tenant) it is sent with."""
    tenant = n % len(SYSTEM_PROMPTS)
    model = ADAPTERS[n % len(ADAPTERS)] if n % 5 == 0 else MODEL
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPTS[tenant]},
            {"role": "user", "content": f"Question {rng.randrange(40)}: what is {n}?"},
        ],
        "max_tokens": rng.randint(4, 24),
        "stream": n % 2 == 0,
    }
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return body, f"tenant-{tenant}"


async def _send(session: aiohttp.ClientSession, url: str, n: int, rng: random.Random) -> int:
    body, key = _request(n, rng)
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        await response.read()
        return response.status


async def _load(url: str) -> dict[int, int]:
    """``REQUESTS`` requests, ``CONCURRENCY`` at a time: status -> count."""
    rng = random.Random(17)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for n in range(REQUESTS):
        queue.put_nowait(n)
    statuses: dict[int, int] = {}

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            status = await _send(session, url, queue.get_nowait(), rng)
            statuses[status] = statuses.get(status, 0) + 1

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(CONCURRENCY)))
    return statuses


def _all_up(prometheus: PrometheusServer, count: int) -> bool:
    targets = prometheus.api("targets")["activeTargets"]
    return len(targets) == count and all(t["health"] == "up" for t in targets)


def _scraped_all(prometheus: PrometheusServer, answered: int) -> bool:
    """True once Prometheus has a scrape of the gateway taken after the last answer."""
    result = prometheus.query("sum(fleetgate_requests_total)")
    return bool(result) and values(result)[0] >= answered


def _check(query: PanelQuery, result: list[dict[str, Any]]) -> str | None:
    """What is wrong with a panel's answer, or None."""
    if not result:
        return "no data"
    samples = values(result)
    if query.unit == "percentunit" and not all(0.0 <= v <= 1.0 for v in samples):
        return f"a ratio outside [0, 1]: {samples}"
    if query.unit == "currencyUSD" and not all(v > 0 for v in samples):
        return f"a cost that is not positive: {samples}"
    return None


async def test_every_panel_and_rule_returns_data(stack: Stack, tmp_path: Any) -> None:
    rule_file = write_rules_file(tmp_path)
    with PrometheusServer(_scrape_jobs(stack), [rule_file]) as prometheus:
        await wait_until(
            lambda: _all_up(prometheus, 5),
            "Prometheus scrapes the gateway, both simulated replicas and both agents",
            timeout_s=20,
            interval_s=0.2,
        )
        statuses = await _load(stack.url)
        answered = sum(statuses.values())
        assert statuses.get(200, 0) == answered, f"statuses {statuses}"
        await wait_until(
            lambda: _scraped_all(prometheus, answered),
            f"Prometheus has scraped all {answered} answered requests",
            timeout_s=20,
            interval_s=0.2,
        )
        problems = {}
        for query in panel_queries():
            problem = _check(query, prometheus.query(query.expr))
            if problem:
                problems[query.name] = f"{problem}: {query.expr}"
        for rule in rules():
            if "record" in rule and not prometheus.query(rule["record"]):
                problems[f"recording rule {rule['record']}"] = f"no data: {rule['expr']}"
        await wait_until(
            lambda: _rule_groups_evaluated(prometheus),
            "Prometheus has evaluated every rule group",
            timeout_s=10,
            interval_s=0.2,
        )
        problems.update(_rule_errors(prometheus))
        assert not problems, "\n".join(f"{name}: {why}" for name, why in problems.items())


def _rule_groups_evaluated(prometheus: PrometheusServer) -> bool:
    """True once every rule has been evaluated at least once (health is no longer unknown)."""
    groups = prometheus.api("rules")["groups"]
    return bool(groups) and all(r["health"] != "unknown" for g in groups for r in g["rules"])


def _rule_errors(prometheus: PrometheusServer) -> dict[str, str]:
    """Rules Prometheus failed to evaluate, by name, with its error."""
    out = {}
    for group in prometheus.api("rules")["groups"]:
        for rule in group["rules"]:
            if rule["health"] != "ok":
                out[f"rule {rule['name']}"] = f"{rule['health']}: {rule.get('lastError')}"
    return out
