"""A real Prometheus scraping fleetgate under load evaluates every dashboard query and rule.

Prometheus scrapes every second, with the alert rules loaded, while a few hundred requests
(streamed or not, several tenants' prefixes) go through the gateway. Then every Grafana panel
target and every recording rule is evaluated through the HTTP API: each must return data, ratios
(hit rates, goodput, KV usage) must lie in [0, 1], costs must be positive, and every rule must
evaluate without error; so must the queries prometheus-adapter serves the HPAs
(deploy/base/prometheus-adapter-rules.yaml). Two modes, as users start them:

- ``fleetgate up --sim 2 --adapters 2``: gateway, simulated replicas, their agents and the
  adapter registry; every panel must have data.
- the quick start, ``fleetgate serve --replica …`` in front of ``fleetgate sim --replicas 2``: no
  price, no SLO, no agents, no adapter catalog given; every panel but those that read only agent
  or adapter metrics must have data (cost and goodput from the documented defaults).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.integration.prometheus_support import (
    PanelQuery,
    PrometheusServer,
    ScrapeJob,
    adapter_queries,
    panel_queries,
    rules,
    values,
    write_rules_file,
)
from tests.support.polling import wait_until

MODEL = "sim-model"
ADAPTERS = ["demo-lora-0", "demo-lora-1"]
REQUESTS = 300
CONCURRENCY = 12
#: Tenants' shared system prompts: repeats make prefix-cache hits, so hit rates are not all 0.
SYSTEM_PROMPTS = [f"You are assistant {n}. " + "Answer briefly and politely. " * 30 for n in "ABC"]
#: Flow control is opt-in (``flow_control.enabled``, docs/flow-control.md) and off in both modes
#: here: its panels have no series until a policy turns it on.
FLOW_CONTROL_OFF = ("fleetgate_flow_",)
#: Metric families only agents and the adapter registry export: the quick start runs neither.
QUICK_START_ABSENT = ("fleetgate_agent_", "fleetgate_adapter_", *FLOW_CONTROL_OFF)
#: The namespace label the scrape configs add, as Kubernetes service discovery would.
NAMESPACE = "fleetgate"


@dataclass
class Process:
    """A ``fleetgate`` subprocess whose output is kept (and drained, so it never blocks)."""

    process: asyncio.subprocess.Process
    output: list[str] = field(default_factory=list)
    drain: asyncio.Task[None] | None = None

    def text(self) -> str:
        return "".join(self.output)

    async def read_until(self, pattern: str, timeout_s: float = 60) -> re.Match[str]:
        """Read lines until one matches ``pattern`` (then keep draining in the background)."""
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout_s):
            while True:
                line = (await self.process.stdout.readline()).decode()
                if not line:
                    raise AssertionError(f"exited before printing {pattern!r}:\n{self.text()}")
                self.output.append(line)
                if match := re.search(pattern, line):
                    return match

    def keep_draining(self) -> None:
        async def drain() -> None:
            assert self.process.stdout is not None
            while line := await self.process.stdout.readline():
                self.output.append(line.decode())

        self.drain = asyncio.create_task(drain())

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGINT)
            async with asyncio.timeout(30):
                await self.process.wait()
        if self.drain is not None:
            self.drain.cancel()


async def _fleetgate(*argv: str) -> Process:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fleetgate.cli",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return Process(process)


@dataclass
class Stack:
    """A running fleet: the gateway URL, what Prometheus scrapes, the models to request."""

    url: str
    jobs: list[ScrapeJob]
    models: list[str]
    #: Panel queries that may return nothing in this mode (prefixes of the only metrics they read).
    absent: tuple[str, ...] = ()


def _host(url: str) -> str:
    return url.removeprefix("http://").rstrip("/")


def _jobs(gateway: str, replicas: list[str], agents: list[str]) -> list[ScrapeJob]:
    # The labels the Kubernetes service discovery adds (deploy/base/servicemonitors.yaml): the
    # dashboard groups engines by pod.
    labels = {"namespace": NAMESPACE, "pod": "sim"}
    # The engines' pool, as the ServiceMonitor's relabelling adds it; both modes name it default.
    engine_labels = {**labels, "pool": "default"}
    jobs = [
        ScrapeJob("fleetgate-gateway", [_host(gateway)], {"namespace": NAMESPACE, "pod": "gw"}),
        ScrapeJob("vllm-engines", [_host(u) for u in replicas], engine_labels),
    ]
    if agents:
        jobs.append(ScrapeJob("fleetgate-agents", [_host(u) for u in agents], labels))
    return jobs


def _banner_targets(text: str, kind: str) -> list[str]:
    """Base URLs of the banner's ``kind:  URL/metrics`` lines (``replica`` or ``agent``)."""
    return re.findall(rf"^\s+{kind}:\s+(http://\S+)/metrics\s*$", text, re.MULTILINE)


@pytest.fixture
async def up_stack() -> AsyncIterator[Stack]:
    """``fleetgate up --sim 2 --adapters 2``, scraped where its banner says."""
    argv = ["up", "--sim", "2", "--port", "0", "--adapters", str(len(ADAPTERS)), "--model", MODEL]
    up = await _fleetgate(*argv)
    try:
        url = (await up.read_until(r"fleetgate is up: (http://127\.0\.0\.1:\d+)")).group(1)
        await up.read_until(r"^Press Ctrl-C", timeout_s=10)  # the banner's last line
        up.keep_draining()
        replicas = _banner_targets(up.text(), "replica")
        agents = _banner_targets(up.text(), "agent")
        assert len(replicas) == len(agents) == 2, up.text()
        yield Stack(url, _jobs(url, replicas, agents), [MODEL, *ADAPTERS], FLOW_CONTROL_OFF)
    finally:
        await up.stop()


@pytest.fixture
async def quick_start_stack() -> AsyncIterator[Stack]:
    """The quick start: ``fleetgate serve --replica URL --replica URL``, nothing else given."""
    sim = await _fleetgate("sim", "--replicas", "2", "--port", "0", "--model", MODEL)
    serve: Process | None = None
    try:
        replicas = [(await sim.read_until(r"replica \d: (http://\S+)")).group(1) for _ in "ab"]
        sim.keep_draining()
        serve = await _fleetgate(
            "serve", "--replica", replicas[0], "--replica", replicas[1], "--port", "0"
        )
        url = (await serve.read_until(r"listening on (http://127\.0\.0\.1:\d+)")).group(1)
        serve.keep_draining()
        yield Stack(url, _jobs(url, replicas, []), [MODEL], QUICK_START_ABSENT)
    finally:
        if serve is not None:
            await serve.stop()
        await sim.stop()


def _request(n: int, models: list[str], rng: random.Random) -> tuple[dict[str, Any], str]:
    """Request ``n`` of the load: its JSON body and the API key (tenant) it is sent with."""
    tenant = n % len(SYSTEM_PROMPTS)
    # One request in five names another model (an adapter), when the stack serves one.
    model = models[1 + n // 5 % (len(models) - 1)] if n % 5 == 0 and len(models) > 1 else MODEL
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


async def _load(stack: Stack) -> dict[int, int]:
    """``REQUESTS`` requests, ``CONCURRENCY`` at a time: status -> count."""
    rng = random.Random(17)
    bodies = [_request(n, stack.models, rng) for n in range(REQUESTS)]
    statuses: dict[int, int] = {}

    async def worker(session: aiohttp.ClientSession) -> None:
        while bodies:
            body, key = bodies.pop()
            headers = {"Authorization": f"Bearer {key}"}
            url = f"{stack.url}/v1/chat/completions"
            async with session.post(url, json=body, headers=headers) as response:
                await response.read()
                statuses[response.status] = statuses.get(response.status, 0) + 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(worker(session) for _ in range(CONCURRENCY)))
    return statuses


def _all_up(prometheus: PrometheusServer, count: int) -> bool:
    targets = prometheus.api("targets")["activeTargets"]
    return len(targets) == count and all(t["health"] == "up" for t in targets)


def _scraped_all(prometheus: PrometheusServer, answered: int) -> bool:
    """True once Prometheus has a scrape of the gateway taken after the last answer."""
    result = prometheus.query("sum(fleetgate_requests_total)")
    return bool(result) and values(result)[0] >= answered


def _rule_groups_evaluated(prometheus: PrometheusServer) -> bool:
    """True once every rule has been evaluated at least once (health is no longer unknown)."""
    groups = prometheus.api("rules")["groups"]
    return bool(groups) and all(r["health"] != "unknown" for g in groups for r in g["rules"])


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


def _may_be_absent(query: PanelQuery, absent: tuple[str, ...]) -> bool:
    """True if every metric ``query`` reads belongs to a component this mode does not run."""
    names = re.findall(r"\b(fleetgate_\w+|vllm:\w+)", query.expr)
    return bool(absent) and all(name.startswith(absent) for name in names)


def _problems(prometheus: PrometheusServer, stack: Stack) -> dict[str, str]:
    """Every panel target, recording rule and rule that does not answer as it should."""
    problems = {}
    for query in panel_queries():
        result = prometheus.query(query.expr)
        if not result and _may_be_absent(query, stack.absent):
            continue
        if problem := _check(query, result):
            problems[query.name] = f"{problem}: {query.expr}"
    for rule in rules():
        if "record" in rule and not prometheus.query(rule["record"]):
            problems[f"recording rule {rule['record']}"] = f"no data: {rule['expr']}"
    for name, queries in adapter_queries(NAMESPACE).items():
        for expr in queries:
            if not prometheus.query(expr):
                problems[f"HPA metric {name}"] = f"no data: {expr}"
    for group in prometheus.api("rules")["groups"]:
        for rule in group["rules"]:
            if rule["health"] != "ok":
                problems[f"rule {rule['name']}"] = f"{rule['health']}: {rule.get('lastError')}"
    return problems


async def _scrape_under_load(stack: Stack, tmp_path: Path) -> None:
    """Run Prometheus over ``stack`` during the load, then fail on any query without data."""
    with PrometheusServer(stack.jobs, [write_rules_file(tmp_path)]) as prometheus:
        targets = sum(len(job.targets) for job in stack.jobs)
        await wait_until(
            lambda: _all_up(prometheus, targets),
            f"Prometheus scrapes all {targets} targets: {[job.name for job in stack.jobs]}",
            timeout_s=20,
            interval_s=0.2,
        )
        statuses = await _load(stack)
        answered = sum(statuses.values())
        assert statuses.get(200, 0) == answered, f"statuses {statuses}"
        await wait_until(
            lambda: _scraped_all(prometheus, answered),
            f"Prometheus has scraped all {answered} answered requests",
            timeout_s=20,
            interval_s=0.2,
        )
        await wait_until(
            lambda: _rule_groups_evaluated(prometheus),
            "Prometheus has evaluated every rule",
            timeout_s=10,
            interval_s=0.2,
        )
        problems = _problems(prometheus, stack)
        assert not problems, "\n".join(f"{name}: {why}" for name, why in problems.items())
        _triage_reads(prometheus)


def _triage_reads(prometheus: PrometheusServer) -> None:
    """``fleetgate triage --prometheus``'s queries parse and answer against the real server,
    with and without a selector, and its coverage check sees data younger than an hour."""
    import httpx

    from planning.triage.prometheus_source import fetch_prometheus_metrics, window_coverage_s

    url = f"http://127.0.0.1:{prometheus.port}"
    with httpx.Client(timeout=10) as client:
        routes = fetch_prometheus_metrics(url, client, "5m")
        assert routes, "triage found no route with requests"
        assert all(m.ttft_p95_ms is not None for m in routes.values())
        # The exact miss share only against an SLO the route declares.
        assert all((m.ttft_slo_missed is None) == (m.ttft_slo_ms is None)
                   for m in routes.values())
        assert fetch_prometheus_metrics(url, client, "5m", 'job="no-such-job"') == {}
        covered = window_coverage_s(url, client, "1h")
        assert covered is not None and covered < 600  # this Prometheus started moments ago


async def test_fleetgate_up_every_panel_and_rule_returns_data(
    up_stack: Stack, tmp_path: Path
) -> None:
    await _scrape_under_load(up_stack, tmp_path)


async def test_quick_start_panels_return_data_with_the_default_price_and_slos(
    quick_start_stack: Stack, tmp_path: Path
) -> None:
    await _scrape_under_load(quick_start_stack, tmp_path)
