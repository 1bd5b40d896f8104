"""Flow control in the gateway, on real sockets: shedding with Retry-After, critical never
refused, tenants dequeued by weight, a disconnected queued client never reaching the engine,
token budgets shared by two gateways through real Redis, and the official ``openai`` client.

The fleet is one upstream whose answers wait at a gate and whose engine reports nothing
running; the policy calls a replica full at one request waiting to start there
(``saturation_backlog_requests: 1``), so the fleet counts as saturated exactly while a request
is in flight (this gateway's in-flight count, beyond the zero the engine reports running):
admissions from the queue are serial and their order is the queue's, whatever the machine's
speed. Nothing here asserts a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web
from multidict import CIMultiDict

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.reload import reload_policy
from gateway.state import GATEWAY
from routing.flow_control import TokenBudgets
from routing.hashing import CHARS_PER_TOKEN
from tests.integration.test_gateway_support import FakeUpstream, serve
from tests.support.polling import wait_until


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _fleet(upstream_url: str) -> str:
    """The policy's fleet: one pool of one replica serving ``base-model``."""
    return f"""
version: 1
replica_pools:
  - name: pool-a
    replicas: [{upstream_url}]
models:
  - name: base-model
    pools: [pool-a]
"""


def _policy(upstream_url: str) -> str:
    return (
        _fleet(upstream_url)
        + f"""plugins:
  - type: expected-ttft
    name: ttft-serial
    parameters: {{drain_backlog: false}}
  - type: max-score
    name: best
profiles:
  - name: serial
    scorers: [{{ref: ttft-serial, weight: 1}}]
    picker: best
routes:
  - name: all
    profile: serial
flow_control:
  enabled: true
  saturation_backlog_requests: 1
  max_queue_wait_ms: 600000
tenants:
  - {{name: gold, api_key_sha256: [{_sha("gold")}], priority: critical}}
  - {{name: a, api_key_sha256: [{_sha("a")}], weight: 2}}
  - {{name: b, api_key_sha256: [{_sha("b")}], weight: 1}}
  - {{name: cheap, api_key_sha256: [{_sha("cheap")}], priority: sheddable, ttft_slo_ms: 0.001}}
  - {{name: picky, api_key_sha256: [{_sha("picky")}], allow_priority_header: true,
      ttft_slo_ms: 0.001}}
  - name: metered
    api_key_sha256: [{_sha("metered")}]
    token_budget: {{prompt_tokens_per_minute: 100}}
"""
    )


@asynccontextmanager
async def _gateways(
    tmp_path: Path, upstream: FakeUpstream, count: int = 1, redis_url: str | None = None
) -> AsyncIterator[list[tuple[str, object]]]:
    async with serve(upstream.app()) as upstream_url:
        path = tmp_path / "policy.yaml"
        path.write_text(_policy(upstream_url))
        served = []
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(count):
                app = create_app(GatewayConfig(policy_path=str(path), redis_url=redis_url))
                url = await stack.enter_async_context(serve(app, handler_cancellation=True))
                served.append((url, app))
            yield served


def contextlib_stack():
    import contextlib

    return contextlib.AsyncExitStack()


def _completion(tag: str) -> dict[str, object]:
    return {"model": "base-model", "prompt": f"request {tag}", "max_tokens": 3}


async def _post(
    http: aiohttp.ClientSession, url: str, key: str, tag: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, object], dict[str, str]]:
    async with http.post(
        f"{url}/v1/completions",
        json=_completion(tag),
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
    ) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


def _queued(app: object) -> int:
    flow = app[GATEWAY].flow  # type: ignore[index]
    return len(flow.controller.queue)


async def test_burst_sheds_sheddable_serves_critical_and_dequeues_by_weight(
    tmp_path: Path,
) -> None:
    upstream = FakeUpstream()
    upstream.header_gate = asyncio.Event()
    async with _gateways(tmp_path, upstream) as [(url, app)], aiohttp.ClientSession() as http:
        first = asyncio.create_task(_post(http, url, "a", "a-first"))
        await wait_until(lambda: upstream.attempts == 1, "the first request reached the engine")
        # Saturated now. Tenant a bursts 6 requests, then b sends 6: the queue holds 12.
        tasks = [asyncio.create_task(_post(http, url, "a", f"a-{i}")) for i in range(6)]
        await wait_until(lambda: _queued(app) == 6, "tenant a's burst is queued")
        tasks += [asyncio.create_task(_post(http, url, "b", f"b-{i}")) for i in range(6)]
        await wait_until(lambda: _queued(app) == 12, "tenant b's requests are queued")

        # Sheddable, predicted over its SLO: refused at once, with the retry hint.
        shed = [await _post(http, url, "cheap", f"cheap-{i}") for i in range(5)]
        for status, body, headers in shed:
            assert status == 429
            assert body["error"]["code"] == "rate_limit_exceeded"  # type: ignore[index]
            assert "predicted time to first token" in body["error"]["message"]  # type: ignore[index]
            assert int(headers["Retry-After"]) >= 1
        # A tenant allowed to choose its class asks for critical: it goes straight through.
        picky = asyncio.create_task(
            _post(http, url, "picky", "picky", {"x-fleetgate-priority": "critical"})
        )
        # Critical jumps the queue: all of them reach the engine while the queue still waits.
        critical = [asyncio.create_task(_post(http, url, "gold", f"gold-{i}")) for i in range(4)]
        await wait_until(lambda: upstream.attempts == 6, "critical requests reached the engine")
        assert _queued(app) == 12

        upstream.header_gate.set()
        results = await asyncio.gather(first, picky, *critical, *tasks)
        assert all(status == 200 for status, _, _ in results)

        order = [str(b["prompt"]).split()[-1] for b in upstream.received]
        dequeued = [tag for tag in order if tag[0] in "ab" and tag != "a-first"]
        first_six = Counter(tag[0] for tag in dequeued[:6])
        # Weights 2:1 give a 4 of the first 6 (FIFO would give it all 6, no fairness 3).
        assert 4 <= first_six["a"] <= 5, dequeued

        metrics = await (await http.get(f"{url}/metrics")).text()
        assert (
            'fleetgate_flow_decisions_total{decision="shed",reason="predicted_ttft_over_slo",'
            'request_class="sheddable",tenant="cheap"} 5.0' in metrics
        )
        assert 'fleetgate_flow_queue_length{request_class="standard"} 0.0' in metrics


async def test_a_header_from_a_tenant_not_allowed_to_set_it_is_ignored_and_bad_values_are_400(
    tmp_path: Path,
) -> None:
    upstream = FakeUpstream()
    upstream.header_gate = asyncio.Event()
    async with _gateways(tmp_path, upstream) as [(url, _)], aiohttp.ClientSession() as http:
        first = asyncio.create_task(_post(http, url, "a", "a-first"))
        await wait_until(lambda: upstream.attempts == 1, "the first request reached the engine")
        # cheap may not pick its class: still sheddable, still refused.
        status, _, _ = await _post(
            http, url, "cheap", "cheap", {"x-fleetgate-priority": "critical"}
        )
        assert status == 429
        status, body, _ = await _post(http, url, "picky", "p", {"x-fleetgate-priority": "vip"})
        assert status == 400
        assert "critical, standard, sheddable" in body["error"]["message"]  # type: ignore[index]
        twice = CIMultiDict(
            [("Authorization", "Bearer picky"), ("x-fleetgate-priority", "critical"),
             ("x-fleetgate-priority", "sheddable")]
        )
        # (Taken as critical, it would be admitted to the gated engine and wait there: bounded.)
        async with http.post(
            f"{url}/v1/completions", json=_completion("p2"), headers=twice,
            timeout=aiohttp.ClientTimeout(total=10),
        ) as r:
            assert r.status == 400 and "send it once" in (await r.json())["error"]["message"]
        # The ignored header is counted, so an SRE can see why a request kept its class.
        async with http.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
        assert 'fleetgate_flow_priority_header_ignored_total{tenant="cheap"} 1.0' in metrics
        assert 'fleetgate_flow_priority_header_ignored_total{tenant="picky"}' not in metrics
        upstream.header_gate.set()
        assert (await first)[0] == 200


async def test_a_queued_client_that_disconnects_never_reaches_the_engine(tmp_path: Path) -> None:
    upstream = FakeUpstream()
    upstream.header_gate = asyncio.Event()
    async with _gateways(tmp_path, upstream) as [(url, app)], aiohttp.ClientSession() as http:
        first = asyncio.create_task(_post(http, url, "a", "a-first"))
        await wait_until(lambda: upstream.attempts == 1, "the first request reached the engine")
        async with aiohttp.ClientSession() as leaving:
            gone = asyncio.create_task(_post(leaving, url, "b", "b-gone"))
            await wait_until(lambda: _queued(app) == 1, "the request is queued")
            gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        await wait_until(lambda: _queued(app) == 0, "the disconnected request left the queue")
        # Counted, so that queued = admitted + shed + abandoned.
        metrics = await (await http.get(f"{url}/metrics")).text()
        assert (
            'fleetgate_flow_decisions_total{decision="abandoned",reason="client_gone",'
            'request_class="standard",tenant="b"} 1.0' in metrics
        )

        async def counted_as_499() -> bool:
            text = await (await http.get(f"{url}/metrics")).text()
            return any(
                line.startswith("fleetgate_requests_total{")
                and 'replica="none"' in line
                and 'status="499"' in line
                and line.endswith(" 1.0")
                for line in text.splitlines()
            )

        # ... and in the request totals, as a client that leaves mid-answer is (499).
        await wait_until(counted_as_499, "the abandoned request is in fleetgate_requests_total")
        stays = asyncio.create_task(_post(http, url, "a", "a-stays"))
        await wait_until(lambda: _queued(app) == 1, "the next request is queued")
        upstream.header_gate.set()
        assert (await first)[0] == 200 and (await stays)[0] == 200
        assert upstream.attempts == 2
        assert [str(b["prompt"]) for b in upstream.received] == [
            "request a-first",
            "request a-stays",
        ]


@asynccontextmanager
async def _b_queued_behind_a(tmp_path: Path) -> AsyncIterator[tuple]:
    """One gateway whose engine holds tenant a's first request (saturated), tenant b's request
    queued behind it: (url, app, session, upstream, a's task, b's task)."""
    upstream = FakeUpstream()
    upstream.header_gate = asyncio.Event()
    async with _gateways(tmp_path, upstream) as [(url, app)], aiohttp.ClientSession() as http:
        first = asyncio.create_task(_post(http, url, "a", "a-first"))
        await wait_until(lambda: upstream.attempts == 1, "the first request reached the engine")
        queued = asyncio.create_task(_post(http, url, "b", "b-queued"))
        await wait_until(lambda: _queued(app) == 1, "b's request is queued")
        yield url, app, http, upstream, first, queued


async def test_a_key_revoked_while_its_request_queued_is_refused_when_released(
    tmp_path: Path,
) -> None:
    """The reload review: requests queued by flow control were never checked against a reload
    that removed their tenant; they were served with its salt, while its new requests got 401."""
    async with _b_queued_behind_a(tmp_path) as (url, app, http, upstream, first, queued):
        path = tmp_path / "policy.yaml"
        path.write_text(path.read_text().replace(f'{{name: b, api_key_sha256: [{_sha("b")}]',
                                                 f'{{name: b, api_key_sha256: [{_sha("b2")}]'))
        assert reload_policy(app[GATEWAY]).ok  # type: ignore[index]  # as SIGHUP does
        upstream.header_gate.set()
        status, body, _ = await queued
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert (await first)[0] == 200
        assert [str(b["prompt"]) for b in upstream.received] == ["request a-first"]
        assert (await _post(http, url, "b2", "b-rotated"))[0] == 200  # the new key works


async def test_a_tenant_removed_while_its_request_queued_is_refused_at_once(
    tmp_path: Path,
) -> None:
    # Its queued requests waited until their SLO ran out, then got a 429 saying to retry later
    # (the flow-control review): the reload now answers them with the 401 of an unknown key,
    # while the engine is still busy.
    async with _b_queued_behind_a(tmp_path) as (_, app, _http, upstream, first, queued):
        path = tmp_path / "policy.yaml"
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(line for line in lines if "{name: b," not in line))
        assert reload_policy(app[GATEWAY]).ok  # type: ignore[index]
        status, body, _ = await asyncio.wait_for(queued, 10)  # the engine still holds "a"
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert _queued(app) == 0
        upstream.header_gate.set()
        assert (await first)[0] == 200
        assert [str(b["prompt"]) for b in upstream.received] == ["request a-first"]


async def test_a_request_refused_after_its_queue_wait_gives_its_reserved_tokens_back(
    tmp_path: Path,
) -> None:
    """The flow-control review of session 46: the prompt tokens reserved for a request were
    given back only when flow control itself refused it; one admitted and then refused before
    it was sent (here a 401: its key was rotated while it queued) kept them charged."""
    upstream = FakeUpstream()
    upstream.header_gate = asyncio.Event()
    async with _gateways(tmp_path, upstream) as [(url, app)], aiohttp.ClientSession() as http:
        flow = app[GATEWAY].flow  # type: ignore[index]
        minute = 120.0  # a frozen window: one minute turning mid-test would start afresh
        flow.budgets = TokenBudgets(flow.budget_store, lambda: minute, "fleetgate:")
        key = f"fleetgate:budget:metered:prompt:{int(minute // 60)}"
        first = asyncio.create_task(_post(http, url, "a", "a-first"))
        await wait_until(lambda: upstream.attempts == 1, "the first request reached the engine")
        queued = asyncio.create_task(_post(http, url, "metered", "m-00"))
        await wait_until(lambda: _queued(app) == 1, "the metered request is queued")
        assert await flow.budget_store.used(key) == _prompt_tokens("m-00")
        path = tmp_path / "policy.yaml"
        path.write_text(path.read_text().replace(_sha("metered"), _sha("metered-rotated")))
        assert reload_policy(app[GATEWAY]).ok  # type: ignore[index]
        upstream.header_gate.set()
        status, body, _ = await queued
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert (await first)[0] == 200
        await wait_until(lambda: not app[GATEWAY].background, "the give-back ran")  # type: ignore[index]
        assert await flow.budget_store.used(key) == 0


async def test_an_arrival_that_read_the_policy_before_a_reload_does_not_bring_it_back(
    tmp_path: Path,
) -> None:
    """The flow-control review of session 46: an arrival read the policy, waited on its
    budget's round trip (Redis) while a reload added a tenant, and then put its older policy
    back into flow control, which refused the new tenant's queued request with a 401."""
    upstream = FakeUpstream()
    upstream.header_gate = asyncio.Event()
    async with _gateways(tmp_path, upstream) as [(url, app)], aiohttp.ClientSession() as http:
        flow = app[GATEWAY].flow  # type: ignore[index]
        store = flow.budgets.store
        entered, go_on = asyncio.Event(), asyncio.Event()
        reserve = store.reserve

        async def round_trip(*args: object) -> bool:  # a Redis round trip in progress
            entered.set()
            await go_on.wait()
            return await reserve(*args)

        store.reserve = round_trip
        first = asyncio.create_task(_post(http, url, "a", "a-first"))
        await wait_until(lambda: upstream.attempts == 1, "the first request reached the engine")
        metered = asyncio.create_task(_post(http, url, "metered", "m-00"))
        await asyncio.wait_for(entered.wait(), 10)
        path = tmp_path / "policy.yaml"
        newbie_line = f"  - {{name: newbie, api_key_sha256: [{_sha('newbie')}]}}\n"
        path.write_text(path.read_text() + newbie_line)
        assert reload_policy(app[GATEWAY]).ok  # type: ignore[index]
        newbie = asyncio.create_task(_post(http, url, "newbie", "n-0"))
        await wait_until(lambda: _queued(app) == 1, "the new tenant's request is queued")
        go_on.set()  # the arrival of the older policy goes on
        await wait_until(lambda: newbie.done() or _queued(app) == 2, "the arrival is queued")
        assert not newbie.done(), newbie.result()  # refused: the older policy came back
        upstream.header_gate.set()
        assert [r[0] for r in await asyncio.gather(first, metered, newbie)] == [200, 200, 200]


async def test_requests_released_by_a_reload_that_turns_flow_control_off_keep_their_wait(
    tmp_path: Path,
) -> None:
    """The flow-control review of session 46: the queue-wait histogram took the release's one
    verdict (0 s waited) for every request a reload let go."""
    async with _b_queued_behind_a(tmp_path) as (url, app, http, upstream, first, queued):
        gate = app[GATEWAY].flow  # type: ignore[index]
        queued_at = gate.controller.now()
        await wait_until(lambda: gate.controller.now() - queued_at >= 0.3, "b waited 0.3 s")
        path = tmp_path / "policy.yaml"
        path.write_text(path.read_text().replace("  enabled: true", "  enabled: false"))
        assert reload_policy(app[GATEWAY]).ok  # type: ignore[index]
        await wait_until(lambda: upstream.attempts == 2, "b was released to the engine")
        upstream.header_gate.set()
        assert (await queued)[0] == 200 and (await first)[0] == 200
        metrics = await (await http.get(f"{url}/metrics")).text()
        waited = next(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith('fleetgate_flow_queue_wait_seconds_sum{request_class="standard"}')
        )
        assert waited >= 0.3


async def test_a_queued_overflow_request_is_counted_once_when_it_is_sent(tmp_path: Path) -> None:
    """The flow-control review of session 46: the queue's pump routes its head again on every
    pass (every 20 ms), and each pass counted it in ``fleetgate_overflow_decisions_total``,
    which counts requests (as the simulator does)."""
    upstream = FakeUpstream()
    upstream.header_gate = asyncio.Event()
    async with serve(upstream.app()) as one, serve(upstream.app()) as two:
        path = tmp_path / "policy.yaml"
        # A TTFT SLO no replica can meet: overflow (which takes two replicas or more: with one,
        # nowhere is better), at every decision (no cap on overflow's share of them).
        path.write_text(
            f"""version: 1
replica_pools:
  - name: pool-a
    replicas: [{one}, {two}]
models:
  - name: base-model
    pools: [pool-a]
plugins:
  - type: fleet-cost
    name: cost
    parameters: {{overflow_max_share: 1.0}}
  - type: max-score
    name: best
profiles:
  - name: uncapped
    scorers: [{{ref: cost, weight: 1}}]
    picker: best
routes:
  - name: all
    profile: uncapped
flow_control:
  enabled: true
  saturation_backlog_requests: 1
  max_queue_wait_ms: 600000
tenants:
  - {{name: a, api_key_sha256: [{_sha("a")}]}}
  - {{name: late, api_key_sha256: [{_sha("late")}], ttft_slo_ms: 0.001}}
"""
        )
        app = create_app(GatewayConfig(policy_path=str(path)))
        async with (
            serve(app, handler_cancellation=True) as url,
            aiohttp.ClientSession() as http,
        ):

            async def metric(prefix: str) -> float:
                text = await (await http.get(f"{url}/metrics")).text()
                return sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith(prefix)
                )

            held = [asyncio.create_task(_post(http, url, "a", f"a-{i}")) for i in range(2)]
            await wait_until(lambda: upstream.attempts == 2, "both replicas hold a request")
            late = asyncio.create_task(_post(http, url, "late", "late-0"))
            await wait_until(lambda: _queued(app) == 1, "the late request is queued")
            decisions = "fleetgate_routing_decision_seconds_count"
            for _ in range(200):  # the pump routes it again on its passes
                if await metric(decisions) >= 8:
                    break
                await asyncio.sleep(0.02)
            assert await metric(decisions) >= 8
            upstream.header_gate.set()
            assert [(await t)[0] for t in [*held, late]] == [200, 200, 200]
            assert await metric("fleetgate_overflow_decisions_total") == 1


async def test_a_prompt_no_replicas_context_holds_is_not_shed_but_sent_to_its_refusal(
    tmp_path: Path,
) -> None:
    """The simulate review of session 46: under overload a sheddable request too long for every
    replica's context got a 429 (retry later: for ever), where the engine refuses it at once
    (vLLM's 400, which says why)."""
    upstream = FakeUpstream()
    upstream.header_gate = asyncio.Event()
    async with _gateways(tmp_path, upstream) as [(url, app)], aiohttp.ClientSession() as http:
        first = asyncio.create_task(_post(http, url, "a", "a-first"))
        await wait_until(lambda: upstream.attempts == 1, "the first request reached the engine")
        await wait_until(
            lambda: all(s.max_model_len for s in app[GATEWAY].registry.all()),  # type: ignore[index]
            "the replica's context length is known",
        )
        status, _, _ = await _post(http, url, "cheap", "c-short")
        assert status == 429  # a sheddable request is shed here...
        # ...but not one over the context, counted (token ids; text mode's estimate from
        # characters is not trusted for it: a padded prompt would skip flow control).
        too_many = [7] * upstream.max_model_len

        async def post(prompt: object) -> int:
            async with http.post(
                f"{url}/v1/completions",
                json={"model": "base-model", "prompt": prompt, "max_tokens": 3},
                headers={"Authorization": "Bearer cheap"},
            ) as resp:
                await resp.read()
                return resp.status

        assert await post("x" * (CHARS_PER_TOKEN * upstream.max_model_len)) == 429

        async def too_long() -> int:
            return await post(too_many)

        sent = asyncio.create_task(too_long())
        await wait_until(
            lambda: sent.done() or upstream.attempts == 2, "the long request reached the engine"
        )
        assert not sent.done(), sent.result()  # answered by the gateway itself: a 429
        upstream.header_gate.set()
        assert await sent == 200  # this fake engine takes any length
        assert (await first)[0] == 200


async def test_token_budgets_hold_across_two_gateways_sharing_redis(
    tmp_path: Path, redis_url: str
) -> None:
    # The engine counts the prompt as the gateway does: the reservation stands as made (a
    # count that differed would be settled after each answer, test_flow_gate.py).
    upstream = FakeUpstream(prompt_tokens=_prompt_tokens("m-00"))
    async with (
        _gateways(tmp_path, upstream, count=2, redis_url=redis_url) as served,
        aiohttp.ClientSession() as http,
    ):
        # One frozen minute for both gateways (a window turning mid-test would refill it); each
        # test run uses its own minute so a rerun on the same Redis starts from an empty budget.
        minute = 60.0 * (hash(str(tmp_path)) % 1_000_000)
        for _, app in served:
            flow = app[GATEWAY].flow  # type: ignore[index]
            flow.budgets = TokenBudgets(flow.budget_store, lambda: minute, "fleetgate:")
        statuses = []
        for i in range(40):
            url = served[i % 2][0]
            status, body, headers = await _post(http, url, "metered", f"m-{i:02d}")
            statuses.append(status)
            if status == 429:
                assert body["error"]["code"] == "rate_limit_exceeded"  # type: ignore[index]
                assert "Token budget exceeded" in body["error"]["message"]  # type: ignore[index]
                assert "Retry-After" in headers
        admitted = statuses.count(200)
        per_request = _prompt_tokens("m-00")
        # 100 prompt tokens a minute, shared: both gateways together admit what one would.
        assert admitted == 100 // per_request, (admitted, per_request)
        assert statuses[admitted:] == [429] * (40 - admitted)
        assert upstream.attempts == admitted
        # A prompt over the whole minute's budget is the client's to fix: a 400, not a shed
        # (counted as one, it fed the "fleet saturated" alert).
        async with http.post(
            f"{served[0][0]}/v1/completions",
            json={"model": "base-model", "prompt": "word " * 200, "max_tokens": 3},
            headers={"Authorization": "Bearer metered"},
        ) as resp:
            assert resp.status == 400
            assert "whole prompt budget" in (await resp.json())["error"]["message"]
        sheds = 0.0
        for url, _ in served:
            metrics = await (await http.get(f"{url}/metrics")).text()
            sheds += sum(
                float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith("fleetgate_flow_decisions_total{")
                and 'decision="shed"' in line
                and 'reason="token_budget"' in line
            )
        assert sheds == 40 - admitted
        # Each refusal is in the decision log, never sent: a client's "my request got a 429"
        # can be looked up by its request id.
        refused = [
            record for _, app in served
            for record in app[GATEWAY].decisions  # type: ignore[index]
            if record.status == 429
        ]
        assert len(refused) == 40 - admitted
        assert {(r.error, r.served_by, r.tenant) for r in refused} == {
            ("rate_limit_exceeded", None, "metered")
        }
        assert refused[0].as_json()["error"] == "rate_limit_exceeded"


def _prompt_tokens(tag: str) -> int:
    """Prompt tokens the gateway counts for ``_completion(tag)`` (text mode, no tokenizer)."""
    return -(-len(f"request {tag}") // CHARS_PER_TOKEN)


async def test_the_openai_client_gets_a_rate_limit_error_with_the_retry_hint(
    tmp_path: Path,
) -> None:
    upstream = FakeUpstream()
    upstream.header_gate = asyncio.Event()
    async with _gateways(tmp_path, upstream) as [(url, _)], aiohttp.ClientSession() as http:
        first = asyncio.create_task(_post(http, url, "a", "a-first"))
        await wait_until(lambda: upstream.attempts == 1, "the first request reached the engine")
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="cheap", max_retries=0)
        with pytest.raises(openai.RateLimitError) as caught:
            await client.completions.create(model="base-model", prompt="hello", max_tokens=3)
        error = caught.value
        assert error.status_code == 429
        assert error.code == "rate_limit_exceeded"
        assert int(error.response.headers["retry-after"]) >= 1
        await client.close()
        upstream.header_gate.set()
        assert (await first)[0] == 200


def _paced_policy(upstream_url: str) -> str:
    """One replica; only its decode pace can make it full (nothing ever waits on the engine)."""
    return (
        _fleet(upstream_url)
        + f"""routes:
  - name: all
    slo: {{ttft_p95_ms: 60000, tpot_p95_ms: 50}}
flow_control:
  enabled: true
  saturation_backlog_requests: 100
  max_queue_wait_ms: 600000
tenants:
  - {{name: gold, api_key_sha256: [{_sha("gold")}], priority: critical}}
  - {{name: a, api_key_sha256: [{_sha("a")}]}}
"""
    )


async def test_an_engine_whose_decodes_run_slower_than_the_tpot_slo_allows_holds_requests(
    tmp_path: Path,
) -> None:
    upstream = FakeUpstream()
    upstream.itl_s = 0.090  # 90 ms between tokens: over 0.8 x the route's 50 ms TPOT SLO
    async with serve(upstream.app()) as upstream_url:
        path = tmp_path / "policy.yaml"
        path.write_text(_paced_policy(upstream_url))
        app = create_app(GatewayConfig(policy_path=str(path), health_interval_s=0.05))
        async with serve(app, handler_cancellation=True) as url, aiohttp.ClientSession() as http:
            registry = app[GATEWAY].registry

            def pace() -> float | None:
                state = registry.get(next(iter(s.replica_id for s in registry.all())))
                return state.decode_itl_ms if state is not None else None

            await wait_until(lambda: (pace() or 0.0) > 80.0, "the gateway read the slow pace")
            metrics = await (await http.get(f"{url}/metrics")).text()
            paced = [
                line
                for line in metrics.splitlines()
                if line.startswith("fleetgate_replica_decode_itl_seconds{")
            ]
            assert len(paced) == 1 and float(paced[0].rsplit(" ", 1)[1]) > 0.08, paced
            held = asyncio.create_task(_post(http, url, "a", "a-held"))
            await wait_until(lambda: _queued(app) == 1, "the standard request is held")
            # Critical traffic is never held, whatever the pace.
            status, _, _ = await _post(http, url, "gold", "gold")
            assert status == 200
            assert _queued(app) == 1 and upstream.attempts == 1

            upstream.itl_s = 0.010  # the decodes speed up: the held request goes through
            status, _, _ = await held
            assert status == 200
            assert [str(b["prompt"]).split()[-1] for b in upstream.received] == [
                "gold",
                "a-held",
            ]
            metrics = await (await http.get(f"{url}/metrics")).text()
            assert (
                'fleetgate_flow_decisions_total{decision="queue",reason="saturated",'
                'request_class="standard",tenant="a"} 1.0' in metrics
            )


async def test_a_request_that_misses_its_tpot_tightens_the_bound_others_are_held_by(
    tmp_path: Path,
) -> None:
    upstream = FakeUpstream()
    async with serve(upstream.app()) as upstream_url:
        path = tmp_path / "policy.yaml"
        path.write_text(_paced_policy(upstream_url))
        app = create_app(GatewayConfig(policy_path=str(path)))
        async with serve(app, handler_cancellation=True) as url, aiohttp.ClientSession() as http:
            gw = app[GATEWAY]  # type: ignore[index]
            controller = gw.flow.controller

            async def stalled_stream(key: str) -> None:
                """A stream whose second token comes 250 ms after its first: three tokens, a
                TPOT of at least 125 ms against the route's 50 ms (a slower machine only adds)."""
                upstream.stream_gate = asyncio.Event()
                attempts = upstream.attempts
                async with http.post(
                    f"{url}/v1/completions",
                    json={**_completion(key), "stream": True},
                    headers={"Authorization": f"Bearer {key}"},
                ) as resp:
                    assert resp.status == 200
                    await wait_until(lambda: upstream.attempts > attempts, f"{key} streams")
                    await asyncio.sleep(0.25)
                    upstream.stream_gate.set()
                    await resp.read()
                # The handler reports the finish before it lets go of the request.
                await wait_until(lambda: gw.active_requests == 0, f"{key} finished")

            assert controller.itl_fraction == pytest.approx(0.8)
            await stalled_stream("a")  # a standard request that misses lowers it a step
            assert controller.itl_fraction == pytest.approx(0.78)
            await stalled_stream("gold")  # and so does a critical one
            assert controller.itl_fraction == pytest.approx(0.76)
            metrics = await (await http.get(f"{url}/metrics")).text()
            assert "fleetgate_flow_itl_bound_ratio 0.76" in metrics


async def test_a_critical_request_in_flight_is_protected_until_it_ends(tmp_path: Path) -> None:
    """``protect_critical_decodes``: the gateway books each admitted critical request, with its
    ``max_tokens``, as a protected decode on its replica, and forgets it when it ends."""
    upstream = FakeUpstream()
    upstream.header_gate = asyncio.Event()
    async with serve(upstream.app()) as upstream_url:
        path = tmp_path / "policy.yaml"
        policy = _policy(upstream_url).replace(
            "  max_queue_wait_ms: 600000\n",
            "  max_queue_wait_ms: 600000\n  protect_critical_decodes: true\n",
        )
        assert "protect_critical_decodes: true" in policy
        path.write_text(policy)
        app = create_app(GatewayConfig(policy_path=str(path)))
        async with serve(app, handler_cancellation=True) as url, aiohttp.ClientSession() as http:
            gold = asyncio.create_task(_post(http, url, "gold", "gold"))
            await wait_until(lambda: upstream.attempts == 1, "the critical request is in flight")
            guard = app[GATEWAY].flow.controller.guard  # type: ignore[index]
            assert len(guard) == 1  # max_tokens 3: 2 x the TPOT SLO of stall it can absorb
            upstream.header_gate.set()
            status, _, _ = await gold
            assert status == 200
            await wait_until(lambda: len(guard) == 0, "its decode is no longer protected")


def _two_replica_policy(slow_url: str, roomy_url: str, steer: bool, calm: bool = True) -> str:
    """Two replicas; routing prefers the first (emptier KV cache) at equal expected TTFT."""
    return f"""
version: 1
replica_pools:
  - name: pool-a
    replicas: [{slow_url}, {roomy_url}]
models:
  - name: base-model
    pools: [pool-a]
plugins:
  - type: expected-ttft
    name: ttft
  - type: kv-pressure
    name: kv
  - type: max-score
    name: best
profiles:
  - name: paced
    scorers: [{{ref: ttft, weight: 1}}, {{ref: kv, weight: 1}}]
    picker: best
routes:
  - name: all
    profile: paced
    slo: {{ttft_p95_ms: 60000, tpot_p95_ms: 50}}
flow_control:
  enabled: true
  steer_critical: {"true" if steer else "false"}
  steer_when_calm: {"true" if calm else "false"}
tenants:
  - {{name: gold, api_key_sha256: [{_sha("gold")}], priority: critical}}
  - {{name: silver, api_key_sha256: [{_sha("silver")}]}}
"""


@dataclass
class _TwoReplicas:
    slow: FakeUpstream
    roomy: FakeUpstream
    app: web.Application
    url: str
    http: aiohttp.ClientSession
    roomy_url: str


@asynccontextmanager
async def _slow_and_roomy(
    tmp_path: Path, steer: bool = True, calm: bool = True
) -> AsyncIterator[_TwoReplicas]:
    """A gateway in front of two fake engines: one decoding at 90 ms a token (over a 50 ms TPOT
    SLO's bound), one at 10 ms with room; yielded once the gateway has read both."""
    slow, roomy = FakeUpstream(), FakeUpstream()
    slow.itl_s, slow.kv_usage = 0.090, 0.0
    roomy.itl_s, roomy.kv_usage = 0.010, 0.8  # under saturation_kv_usage (0.92): room
    async with serve(slow.app()) as slow_url, serve(roomy.app()) as roomy_url:
        path = tmp_path / "policy.yaml"
        path.write_text(_two_replica_policy(slow_url, roomy_url, steer, calm))
        app = create_app(GatewayConfig(policy_path=str(path), health_interval_s=0.05))
        async with serve(app, handler_cancellation=True) as url, aiohttp.ClientSession() as http:
            registry = app[GATEWAY].registry

            def polled() -> bool:
                states = {s.url.rstrip("/"): s for s in registry.all()}
                a, b = states.get(slow_url.rstrip("/")), states.get(roomy_url.rstrip("/"))
                return (
                    a is not None
                    and b is not None
                    and (a.decode_itl_ms or 0.0) > 80.0
                    and 0.0 < (b.decode_itl_ms or 0.0) < 20.0
                    and b.kv_usage == pytest.approx(0.8)
                )

            await wait_until(polled, "the gateway read both replicas' pace and KV usage")
            yield _TwoReplicas(slow, roomy, app, url, http, roomy_url)


@pytest.mark.parametrize(("steer", "steering_fails"), [(True, False), (False, False), (True, True)])
async def test_a_critical_request_on_a_replica_decoding_too_slowly_is_steered_to_one_with_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steer: bool, steering_fails: bool
) -> None:
    """Routing prefers the slow replica (its KV cache is emptier; the expected TTFT is the same
    on both), whose decodes run at 90 ms a token against the route's 50 ms TPOT SLO. With
    ``steer_critical`` (the default) the critical request is routed again among the replicas
    with room and goes to the other one; without it, or when routing again fails, it goes
    where routing first sent it."""
    if steering_fails:
        from gateway.request import handler

        async def failing(gw: object, routed: object, only: object = None) -> object:
            raise RuntimeError("routing again failed")

        monkeypatch.setattr(handler, "repick", failing)
    async with _slow_and_roomy(tmp_path, steer) as fleet:
        status, _, _ = await _post(fleet.http, fleet.url, "gold", "gold")
        assert status == 200
        steered = steer and not steering_fails
        assert (fleet.slow.attempts, fleet.roomy.attempts) == ((0, 1) if steered else (1, 0))
        metrics = await (await fleet.http.get(f"{fleet.url}/metrics")).text()
        assert (
            'fleetgate_flow_steered_total{request_class="critical",tenant="gold"} 1.0' in metrics
        ) is steered
        assert (
            'fleetgate_flow_decisions_total{decision="admit",reason="critical",'
            'request_class="critical",tenant="gold"} 1.0' in metrics
        )


@pytest.mark.parametrize("calm", [True, False])
async def test_a_standard_request_that_would_wait_on_a_calm_fleet_goes_to_a_replica_with_room(
    tmp_path: Path, calm: bool
) -> None:
    """Routing prefers the slow replica (90 ms a token against a 50 ms TPOT SLO), and with one
    of the two replicas full that way a standard request would be held. Nothing has been held
    before (a calm fleet), so with ``steer_when_calm`` (the default) it is routed again among
    the replicas with room and served at once by the other; without it, it waits in the
    gateway queue (and, its client gone, reaches no engine)."""
    async with _slow_and_roomy(tmp_path, calm=calm) as fleet:
        if calm:
            status, _, _ = await _post(fleet.http, fleet.url, "silver", "silver")
            assert status == 200
            assert (fleet.slow.attempts, fleet.roomy.attempts) == (0, 1)
            metrics = await (await fleet.http.get(f"{fleet.url}/metrics")).text()
            assert (
                'fleetgate_flow_steered_total{request_class="standard",tenant="silver"} 1.0'
                in metrics
            )
            assert (
                'fleetgate_flow_decisions_total{decision="admit",reason="not_saturated",'
                'request_class="standard",tenant="silver"} 1.0' in metrics
            )
            return
        await _held_then_gone(fleet, "the standard request is held")
        assert (fleet.slow.attempts, fleet.roomy.attempts) == (0, 0)


async def _held_then_gone(fleet: _TwoReplicas, held: str) -> None:
    """A silver request waits in the gateway queue, then its client gives up: it leaves the
    queue without reaching an engine."""
    request = asyncio.create_task(_post(fleet.http, fleet.url, "silver", "silver"))
    await wait_until(lambda: _queued(fleet.app) == 1, held)
    request.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await request
    await wait_until(lambda: _queued(fleet.app) == 0, "it left the queue with its client")


async def test_a_steered_request_that_is_held_anyway_is_not_counted_as_steered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fleetgate_flow_steered_total`` counts requests sent where they were steered: one that
    admission holds after the move (here forced, as a saturated fleet would) is routed afresh
    from the queue, and was counted as moved although it never went there."""
    from routing.flow_control import Decision, FleetEstimate, FlowRequest, Verdict

    async with _slow_and_roomy(tmp_path) as fleet:
        controller = fleet.app[GATEWAY].flow.controller
        admit = controller.admit
        held: list[object] = []

        def hold_the_first(request: FlowRequest, estimate: FleetEstimate) -> Verdict:
            if held:
                return admit(request, estimate)
            held.append(estimate.chosen_replica)
            controller.queue.push(request, estimate.predicted_ttft_ms)
            return Verdict(Decision.QUEUE, "saturated")

        monkeypatch.setattr(controller, "admit", hold_the_first)
        # From the queue, routing's choice is the slow replica again, where it would wait out
        # its SLO (a minute): its client gives up first.
        await _held_then_gone(fleet, "the steered request is held")
        roomy = next(
            s.replica_id
            for s in fleet.app[GATEWAY].registry.all()
            if s.url.rstrip("/") == fleet.roomy_url.rstrip("/")
        )
        assert held == [roomy]  # steered to the roomy replica, then held: it went nowhere
        assert (fleet.slow.attempts, fleet.roomy.attempts) == (0, 0)
        metrics = await (await fleet.http.get(f"{fleet.url}/metrics")).text()
        assert "fleetgate_flow_steered_total{" not in metrics


async def test_a_queue_head_held_for_its_replicas_backlog_goes_to_an_idle_replica(
    tmp_path: Path,
) -> None:
    """Routing prefers the first replica (its KV cache is emptier), where two requests already
    wait to start. A standard request arriving while both replicas are backlogged waits in the
    gateway queue. Once the second replica runs nothing and has nothing waiting, the head is
    not released onto the first (the flood a live review found) nor held for it while the
    other sits idle (the next review): it is routed again among the idle replicas and served
    there."""
    busy, spare = FakeUpstream(), FakeUpstream()
    # Loads small enough that max-score's bounded-load guard keeps the busy one eligible.
    busy.kv_usage, busy.waiting, busy.running = 0.0, 2, 1
    spare.kv_usage, spare.waiting, spare.running = 0.8, 2, 1
    async with serve(busy.app()) as busy_url, serve(spare.app()) as spare_url:
        path = tmp_path / "policy.yaml"
        path.write_text(
            # Critical and calm steering off: this is neither.
            _two_replica_policy(busy_url, spare_url, steer=False, calm=False).replace(
                "scorers: [{ref: ttft, weight: 1}, {ref: kv, weight: 1}]",
                "scorers: [{ref: ttft, weight: 0.001}, {ref: kv, weight: 1}]",
            )
        )
        app = create_app(GatewayConfig(policy_path=str(path), health_interval_s=0.05))
        async with serve(app, handler_cancellation=True) as url, aiohttp.ClientSession() as http:
            registry = app[GATEWAY].registry

            def polled(spare_waiting: int) -> bool:
                states = {s.url.rstrip("/"): s for s in registry.all()}
                a, b = states.get(busy_url.rstrip("/")), states.get(spare_url.rstrip("/"))
                return (
                    a is not None and b is not None and a.waiting == 2
                    and b.waiting == spare_waiting and b.kv_usage == pytest.approx(0.8)
                )

            await wait_until(lambda: polled(2), "the gateway read both replicas' queues")
            held = asyncio.create_task(_post(http, url, "silver", "silver"))
            await wait_until(lambda: _queued(app) == 1, "the standard request is held")
            spare.waiting, spare.running = 0, 0
            status, _, _ = await held
            assert status == 200
            assert (busy.attempts, spare.attempts) == (0, 1)
            metrics = await (await http.get(f"{url}/metrics")).text()
            assert (
                'fleetgate_flow_steered_total{request_class="standard",tenant="silver"} 1.0'
                in metrics
            )


class _HeldUpstream:
    """An engine that reports nothing running and holds each answer until it is released one by
    one; it records how many answers were in progress when each request arrived."""

    def __init__(self) -> None:
        self.release: dict[str, asyncio.Event] = {}
        self.arrived: list[tuple[str, int]] = []
        self.in_progress = 0

    def app(self) -> web.Application:
        async def complete(request: web.Request) -> web.Response:
            tag = str((await request.json())["prompt"]).split()[-1]
            self.arrived.append((tag, self.in_progress))
            self.in_progress += 1
            try:
                await self.release.setdefault(tag, asyncio.Event()).wait()
            finally:
                self.in_progress -= 1
            return web.json_response(
                {
                    "id": "cmpl-held",
                    "object": "text_completion",
                    "model": "base-model",
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
                }
            )

        async def models(_: web.Request) -> web.Response:
            return web.json_response(
                {"object": "list", "data": [{"id": "base-model", "max_model_len": 4096}]}
            )

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

        app = web.Application()
        app.router.add_get("/health", lambda _: web.Response())
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/completions", complete)
        return app


async def test_one_freed_slot_releases_one_queued_request_not_the_whole_queue(
    tmp_path: Path,
) -> None:
    # The pump judged every queued request on the same reading of the fleet: the first one
    # released was not in flight yet when the next was judged, so one finished request let the
    # whole queue into the engine (and past it, priorities and weights stopped mattering).
    upstream = _HeldUpstream()
    async with serve(upstream.app()) as upstream_url:
        path = tmp_path / "policy.yaml"
        path.write_text(_policy(upstream_url))
        app = create_app(GatewayConfig(policy_path=str(path)))
        async with (
            serve(app, handler_cancellation=True) as url,
            aiohttp.ClientSession() as http,
        ):
            first = asyncio.create_task(_post(http, url, "a", "first"))
            await wait_until(lambda: len(upstream.arrived) == 1, "the first request is sent")
            queued = [asyncio.create_task(_post(http, url, "a", f"q{i}")) for i in range(4)]
            await wait_until(lambda: _queued(app) == 4, "the burst is queued")
            order = ["first", "q0", "q1", "q2", "q3"]
            for done, following in itertools.pairwise(order):
                upstream.release.setdefault(done, asyncio.Event()).set()
                await wait_until(
                    lambda following=following: any(t == following for t, _ in upstream.arrived),
                    f"{following} is released once {done} has ended",
                )
            upstream.release.setdefault("q3", asyncio.Event()).set()
            results = await asyncio.gather(first, *queued)
    assert [status for status, _, _ in results] == [200] * 5
    # Each one reached the engine alone: none while another was still being answered.
    assert upstream.arrived == [(tag, 0) for tag in order]
    # Each handler told the pump when it sent its request: the pump never waited out its bound.
    assert app[GATEWAY].flow.release_timeouts == 0


async def test_arrivals_checking_their_budget_at_once_are_judged_on_each_other(
    tmp_path: Path, redis_url: str
) -> None:
    # Each arrival was judged on the replica figures of its own routing decision: one admitted
    # while another awaited its budget check in Redis was not in them, and a burst of such
    # arrivals overfilled the engines past the saturation bound.
    upstream = _HeldUpstream()
    async with serve(upstream.app()) as upstream_url:
        path = tmp_path / "policy.yaml"
        path.write_text(_policy(upstream_url))
        app = create_app(GatewayConfig(policy_path=str(path), redis_url=redis_url))
        async with (
            serve(app, handler_cancellation=True) as url,
            aiohttp.ClientSession() as http,
        ):
            burst = [asyncio.create_task(_post(http, url, "metered", f"m{i}")) for i in range(4)]
            await wait_until(
                lambda: len(upstream.arrived) + _queued(app) == 4, "every arrival is judged"
            )
            # The replica is full at one request waiting: one goes, the others queue.
            assert len(upstream.arrived) == 1 and _queued(app) == 3
            for tag in ("m0", "m1", "m2", "m3"):
                upstream.release.setdefault(tag, asyncio.Event()).set()
            results = await asyncio.gather(*burst)
    assert sorted(status for status, _, _ in results) == [200] * 4
