"""The gateway end to end on the session's two REAL vLLM CPU engines (see docs/e2e.md).

Production wiring (``e2e_support.gateway_stack``): a ``ReplicaAgent`` per engine feeds a Redis
block index and fleet store from the engine's KV events and metrics; the gateway app in policy
mode discovers the replicas there, tokenizes with the model's own tokenizer and chat template, and
manages the LoRA adapters; clients are the official ``openai`` SDK. Every number asserted comes
from the engines (their ``/metrics`` counters, ``usage.prompt_tokens_details.cached_tokens``,
``/v1/models``) or from what the client saw; the gateway's own records are only compared to them.

The engines run with a 112-block KV cache each (``KV_BLOCKS_PER_ENGINE``): the shared-prefix
workload's eight 24-block prefixes fit in the fleet when a router partitions them (4 per engine),
but not in one engine, so routing decides the hit rate. The failover test kills and restarts an
engine and therefore runs last.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import signal
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from replica.launcher import VllmEngine
from replica.tiny_model import TinyModel
from routing.contracts import IndexUnavailable
from routing.hashing import chain_seed, hash_token_blocks
from routing.index import RedisBlockIndex
from routing.policies.registry import DEFAULT_PROFILE
from routing.tokenize.local import LocalTokenizer
from routing.types import BlockHash, ReplicaId
from tests.e2e.conftest import ENGINE_START_TIMEOUT_S, KV_BLOCKS_PER_ENGINE
from tests.e2e.e2e_support import (
    ADMIN,
    BLOCK_SIZE,
    RR_HEADER,
    SERVED_MODEL,
    E2EResults,
    Stack,
    api_key,
    delta,
    engine_adapters,
    eventually,
    gateway_stack,
    replica_id,
)
from tests.support.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

_ids = iter(range(1_000_000))


def rid(tag: str) -> str:
    return f"e2e-{tag}-{next(_ids)}-{time.time_ns()}"


@pytest.fixture(scope="module")
def tokenizer(tiny_model: TinyModel) -> LocalTokenizer:
    return LocalTokenizer(tiny_model.model_dir)


@pytest.fixture
async def stack(
    redis_url: str, vllm_engines: list[VllmEngine], tiny_model: TinyModel, tmp_path: Path
):  # type: ignore[no-untyped-def]
    async with gateway_stack(redis_url, vllm_engines, tiny_model, tmp_path) as s:
        yield s


async def complete(
    stack: Stack,
    prompt: str,
    tenant: str = "alpha",
    model: str = SERVED_MODEL,
    headers: dict[str, str] | None = None,
    max_tokens: int = 1,
    **extra: Any,
) -> tuple[str, int, int]:
    """One /v1/completions through the gateway: (request id, prompt tokens, cached tokens)."""
    request_id = extra.pop("request_id", None) or rid("c")
    resp = await stack.client(tenant).completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_headers={"X-Request-Id": request_id, **(headers or {})},
        extra_body=extra or None,
    )
    assert resp.usage is not None
    details = resp.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None, resp.usage
    return request_id, resp.usage.prompt_tokens, details.cached_tokens


async def chat(
    stack: Stack, messages: list[dict[str, str]], tenant: str = "alpha"
) -> tuple[str, int, int]:
    request_id = rid("chat")
    resp = await stack.client(tenant).chat.completions.create(
        model=SERVED_MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=1,
        temperature=0,
        extra_headers={"X-Request-Id": request_id},
    )
    assert resp.usage is not None
    details = resp.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None, resp.usage
    return request_id, resp.usage.prompt_tokens, details.cached_tokens


async def tokens_of(tokenizer: LocalTokenizer, prompt: str) -> list[int]:
    return list((await tokenizer.tokenize_completion(SERVED_MODEL, prompt)).token_ids or [])


async def padded_text(tokenizer: LocalTokenizer, head: str, sentence: str, blocks: int) -> str:
    """``head`` + sentences, cut at a word so the text has ``blocks`` full blocks and at most
    12 tokens more: a short unique suffix then never completes a block of its own."""
    target = blocks * BLOCK_SIZE
    text, i = head, 0
    while len(await tokens_of(tokenizer, text)) < target:
        text += " " + sentence.format(i=i)
        i += 1
    while len(await tokens_of(tokenizer, text)) > target + 12:
        text = text.rsplit(" ", 1)[0]
    while len(await tokens_of(tokenizer, text)) < target:
        text += " ok"
    assert target <= len(await tokens_of(tokenizer, text)) <= target + 12
    return text


def ideal_cached(token_lists: Sequence[list[int]]) -> list[int]:
    """IDEAL: the cached tokens ONE engine whose cache never evicts would report for each request
    of the sequence, in order: the longest run of leading full blocks seen in any earlier
    request, at most ``(len - 1) // block`` blocks (vLLM always recomputes the last token)."""
    seen: set[int] = set()
    out = []
    for tokens in token_lists:
        chain = hash_token_blocks(tokens, BLOCK_SIZE, chain_seed(SERVED_MODEL))
        cap = (len(tokens) - 1) // BLOCK_SIZE
        hit = 0
        while hit < min(cap, len(chain)) and chain[hit] in seen:
            hit += 1
        out.append(hit * BLOCK_SIZE)
        seen.update(chain)
    return out


# --------------------------------------------------------------------------- 1. prefix routing

PREFIXES = 8
#: Tokens each first-round request generates (see run_workload).
FIRST_ROUND_TOKENS = 48
PREFIX_BLOCKS = 24
SEQUENTIAL = 40
TOPICS = [
    "billing", "shipping", "privacy", "returns", "warranty", "payments", "accounts", "pricing"
]


async def shared_prefix_workload(
    tokenizer: LocalTokenizer, nonce: str
) -> tuple[list[str], list[list[int]], list[int]]:
    """Eight 24-block prefixes; a first round with each once (clients arriving together), then
    40 requests on random prefixes, all with unique short suffixes. Returns (prompts, their
    tokens, prefix of each)."""
    prefixes = [
        await padded_text(
            tokenizer,
            f"{topic} handbook {nonce}.",
            f"{topic} rule {{i}} says each {topic} case is checked twice.",
            PREFIX_BLOCKS,
        )
        for topic in TOPICS[:PREFIXES]
    ]
    rng = random.Random(7)
    order = list(range(PREFIXES)) + [rng.randrange(PREFIXES) for _ in range(SEQUENTIAL)]
    prompts, token_lists = [], []
    for j, p in enumerate(order):
        prompt = prefixes[p] + f" Q{j}?"
        tokens = await tokens_of(tokenizer, prompt)
        prefix_tokens = await tokens_of(tokenizer, prefixes[p])
        assert tokens[: len(prefix_tokens)] == prefix_tokens, "suffix changed the prefix tokens"
        # No block beyond the prefix's is ever completed (prompt + 1 generated token).
        assert (len(tokens) + 1) // BLOCK_SIZE == PREFIX_BLOCKS, len(tokens)
        prompts.append(prompt)
        token_lists.append(tokens)
    return prompts, token_lists, order


def in_flight_or_done(stack: Stack, task: asyncio.Task[Any], request_id: str) -> bool:
    """The gateway is trying ``request_id`` on a replica (so counts it in flight), or it ended."""
    return task.done() or stack.gw.registry.attempts.replica_of(request_id) is not None


def registry_view(stack: Stack) -> dict[str, tuple[int, int, int, int, float, float]]:
    """Per replica, what the gateway's registry holds now: (running gauge, waiting gauge,
    in flight, ended since the reading, the reading's age in ms, KV usage gauge)."""
    now = time.time()
    out = {}
    for state in stack.gw.registry.all():
        out[state.replica_id] = (
            state.running,
            state.waiting,
            state.inflight_requests,
            state.finished_since_read,
            round((now - state.metrics_read_at) * 1000),
            round(state.kv_usage, 3),
        )
    return out


async def run_workload(
    stack: Stack,
    prompts: list[str],
    tenant: str,
    headers: dict[str, str] | None,
    views: list[dict[str, tuple[int, int, int, int, float, float]]] | None = None,
) -> tuple[Any, list[str]]:
    before = await stack.engine_counters()
    # First round: clients a few ms apart, each arriving while the previous ones are in flight.
    # (Not one gather: the gateway counts a request in flight only after its awaited speculative
    # index insert, so requests decided in the same instant do not see each other's load.)
    # Each generates FIRST_ROUND_TOKENS, so it is still decoding when the next one is routed
    # whatever the engines' speed: with one token, a request on the faster engine had ended
    # before the next decision, the slower engine still had one running, and the faster took
    # five or six of the eight prefixes (more than its cache holds). The extra tokens complete
    # at most two blocks per request that no later prompt shares (8 of an engine's 112 if it
    # takes four): hits are counted on prompts.
    ids, tasks = [], []
    for prompt in prompts[:PREFIXES]:
        request_id = rid("first")
        task = asyncio.create_task(
            complete(
                stack,
                prompt,
                tenant,
                headers=headers,
                request_id=request_id,
                max_tokens=FIRST_ROUND_TOKENS,
                ignore_eos=True,
            )
        )
        # Polled every 5 ms, not 50: the round must fit in the first requests' generation.
        await wait_until(
            lambda t=task, r=request_id: in_flight_or_done(stack, t, r),
            "request in flight",
            timeout_s=30,
            interval_s=0.005,
        )
        if views is not None:  # as the next decision will see it (less what happens meanwhile)
            views.append(registry_view(stack))
        ids.append(request_id)
        tasks.append(task)
    # The engines' figures read now, mid-round, as a health poll may read them: each engine
    # runs its share of the round, and its KV gauge is near full (four 26-block requests in
    # 112 blocks). Those requests end long before the next poll; the later ones must still find
    # their prefixes where the round put them (``ReplicaState.kv_usage_now``).
    await stack.gw.registry.poll_once(stack.gw.http())
    if views is not None:
        views.append(registry_view(stack))
    await asyncio.gather(*tasks)
    if views is not None:
        views.append(registry_view(stack))
    for prompt in prompts[PREFIXES:]:
        ids.append((await complete(stack, prompt, tenant, headers=headers))[0])
    if views is not None:
        views.append(registry_view(stack))
    return delta(await stack.engine_counters(), before), ids


def moved_decisions(
    decisions: dict[str, Any], order: list[int], request_ids: list[str]
) -> list[tuple[str, dict[str, tuple[float, ...]]]]:
    """The later decisions that did not go where their prefix's first request went, with the
    terms that decided them: what a failure of the hit-rate check needs to be read."""
    first = {order[j]: decisions[request_ids[j]]["served_by"] for j in range(PREFIXES)}
    moved = []
    for p, request_id in zip(order[PREFIXES:], request_ids[PREFIXES:], strict=True):
        decision = decisions[request_id]
        if decision["served_by"] == first[p]:
            continue
        per_replica = {}
        for replica, explanation in decision["explanations"].items():
            t = explanation["terms"]
            per_replica[replica] = tuple(
                round(t.get(name, -1), 1)
                for name in (
                    "uncached_tokens", "queue_wait_ms", "prefill_ms", "prefill_tokens_per_s",
                    "kv_penalty_ms", "stale_penalty_ms", "fleet_cost_ms",
                )
            )
        moved.append((decision["served_by"], per_replica))
    return moved


async def test_prefix_aware_routing_reaches_90_percent_of_ideal_on_vllm_counters(
    stack: Stack, tokenizer: LocalTokenizer, e2e_results: E2EResults
) -> None:
    prompts, token_lists, order = await shared_prefix_workload(tokenizer, f"n{time.time_ns()}")
    ideal_hits = sum(ideal_cached(token_lists))
    queried = sum(len(t) for t in token_lists)
    ideal = ideal_hits / queried
    # Same prompts, two tenants (two cache salts): the runs share no cached block.
    views: list[dict[str, tuple[int, int, int, int, float, float]]] = []
    aware, aware_ids = await run_workload(stack, prompts, "alpha", None, views)
    blind, _ = await run_workload(stack, prompts, "gamma", RR_HEADER)
    decisions = await stack.decisions()
    placement: dict[int, Counter[str]] = {}
    for p, request_id in zip(order, aware_ids, strict=True):
        placement.setdefault(p, Counter())[decisions[request_id]["served_by"]] += 1
    per_replica = Counter(c.most_common(1)[0][0] for c in placement.values())
    lines = [
        f"workload: {PREFIXES} prefixes of {PREFIX_BLOCKS} blocks x unique suffixes, "
        f"{len(prompts)} requests ({PREFIXES} first requests a few ms apart, each generating "
        f"{FIRST_ROUND_TOKENS} tokens while the later ones arrive, then {SEQUENTIAL} "
        f"sequential on random prefixes), {queried} prompt tokens; engines' caches "
        f"{KV_BLOCKS_PER_ENGINE} blocks each",
        "",
        "| run | hits / queried tokens (vLLM counters) | hit rate | of ideal |",
        "|---|---|---|---|",
        f"| ideal (one engine, cache never evicts) | {ideal_hits} / {queried} | {ideal:.3f} "
        "| 100% |",
        f"| {DEFAULT_PROFILE} (gateway default) | {aware.hits:.0f} / {aware.queries:.0f} "
        f"| {aware.hit_rate:.3f} | {aware.hit_rate / ideal:.1%} |",
        f"| round-robin (gateway) | {blind.hits:.0f} / {blind.queries:.0f} "
        f"| {blind.hit_rate:.3f} | {blind.hit_rate / ideal:.1%} (1/N = 50%) |",
        "",
        f"{DEFAULT_PROFILE} placed the prefixes {dict(sorted(per_replica.items()))} "
        f"(prefix -> replicas used: "
        f"{ {p: dict(c) for p, c in sorted(placement.items())} })",
    ]
    first_round = [decisions[r] for r in aware_ids[:PREFIXES]]
    lines.append(
        "first-round decisions (replica; per replica: queue wait, externality, eviction and "
        "total cost ms; degraded): "
        + str([
            (
                d["served_by"],
                {
                    k: tuple(
                        round(e["terms"].get(name, -1))
                        for name in (
                            "queue_wait_ms", "externality_ms", "eviction_ms", "fleet_cost_ms"
                        )
                    )
                    for k, e in d["explanations"].items()
                },
                d["degraded"],
            )
            for d in first_round
        ])
    )
    lines.append(
        "registry after each first-round dispatch, after a poll of the engines mid-round, when "
        "the round ended and after the last request (running, waiting, in flight, ended since "
        f"the reading, reading age ms, KV usage): {views}"
    )
    lines.append(
        "later decisions sent away from their prefix's first-round replica (replica; per "
        "replica: uncached tokens, queue wait, prefill ms, speed tokens/s, kv and stale "
        f"penalties ms, cost ms): {moved_decisions(decisions, order, aware_ids)}"
    )
    degraded = sum(decisions[r]["degraded"] for r in aware_ids)
    lines.append(f"degraded decisions (index unavailable): {degraded}")
    e2e_results.record("1. Prefix-aware routing: engine hit rate vs ideal", *lines)
    # The engines counted exactly the prompts' tokens: nothing else ran, nothing was missed.
    assert aware.queries == blind.queries == queried
    assert aware.hit_rate >= 0.9 * ideal
    assert blind.hit_rate <= 0.75 * ideal


# --------------------------------------------------------------------------- 2. predictions


async def test_predicted_cached_tokens_equal_vllm_cached_tokens(
    stack: Stack, tokenizer: LocalTokenizer, e2e_results: E2EResults
) -> None:
    nonce = f"p{time.time_ns()}"
    prefixes = [
        await padded_text(
            tokenizer, f"doc {k} {nonce}.", f"section {{i}} of doc {k} lists facts.", blocks
        )
        for k, blocks in enumerate((3, 5, 7))
    ]
    systems = [
        await padded_text(
            tokenizer, f"You are agent {k} {nonce}.", f"Policy {{i}} for agent {k} holds.", blocks
        )
        for k, blocks in enumerate((2, 4, 6))
    ]
    # A prompt of exactly 4 full blocks, sent repeatedly: vLLM recomputes its last block.
    aligned = await padded_text(tokenizer, f"aligned {nonce}.", "word {i} again.", 4)
    while len(await tokens_of(tokenizer, aligned)) % BLOCK_SIZE:
        aligned = aligned.rsplit(" ", 1)[0]
    rng = random.Random(3)
    rows: dict[str, list[tuple[str, int, int]]] = {"completions": [], "chat": []}
    for j in range(30):
        prompt = prefixes[rng.randrange(3)] + f" item {j}?"
        rows["completions"].append(await complete(stack, prompt, "beta"))
        messages = [
            {"role": "system", "content": systems[rng.randrange(3)]},
            {"role": "user", "content": f"question {j}?"},
        ]
        rows["chat"].append(await chat(stack, messages, "beta"))
    aligned_rows = [await complete(stack, aligned, "beta") for _ in range(3)]
    decisions = await stack.decisions()
    lines = ["| endpoint | requests | predicted == cached_tokens | cached tokens (engine) |",
             "|---|---|---|---|"]
    accuracy = {}
    mismatches = []
    for endpoint, found in rows.items():
        equal = 0
        for request_id, _, cached in found:
            predicted = decisions[request_id]["predicted_cached_tokens"]
            equal += predicted == cached
            if predicted != cached:
                mismatches.append((endpoint, request_id, predicted, cached))
        accuracy[endpoint] = equal / len(found)
        lines.append(
            f"| /v1/{endpoint.replace('chat', 'chat/completions')} | {len(found)} | "
            f"{equal} ({accuracy[endpoint]:.1%}) | {sum(r[2] for r in found)} |"
        )
    aligned_seen = [
        (decisions[r]["predicted_cached_tokens"], cached, n) for r, n, cached in aligned_rows
    ]
    exact = await stack.gateway_metric("fleetgate_cache_prediction_total", outcome="exact")
    all_predictions = await stack.gateway_metric("fleetgate_cache_prediction_total")
    lines += [
        "",
        f"gateway's own `fleetgate_cache_prediction_total`: exact (within a block) "
        f"{exact:.0f} / {all_predictions:.0f}",
        f"block-aligned prompt (predicted, engine cached, prompt tokens) x3: {aligned_seen}",
        f"mismatches (endpoint, request, predicted, engine cached): {mismatches}",
        "agents' epoch retirements during the test (resync = an index write failed): "
        + str([
            {
                reason: a.metrics.value("fleetgate_agent_epoch_retirements_total", reason=reason)
                for reason in ("resync", "gap", "restart", "cleared")
            }
            for a in stack.agents
        ]),
    ]
    e2e_results.record("2. Prediction accuracy: predicted vs engine cached tokens", *lines)
    # Repeated prefixes did hit (a prediction of 0 == 0 everywhere would prove nothing).
    assert all(sum(r[2] for r in found) > 0 for found in rows.values())
    assert accuracy["completions"] >= 0.95 and accuracy["chat"] >= 0.95, mismatches
    assert all(p == c for p, c, _ in aligned_seen), aligned_seen


# --------------------------------------------------------------------------- 3. tenants


async def test_tenants_share_no_cached_prefix(
    stack: Stack, e2e_results: E2EResults
) -> None:
    nonce = f"t{time.time_ns()}"
    checked = []
    for k in range(3):
        prompt = f"tenant probe {k} {nonce}: " + "the same words from two customers " * 12
        # alpha warms the prompt on BOTH engines (round-robin route), so wherever beta's
        # request lands, alpha's blocks are there.
        warm = [await complete(stack, prompt, "alpha", headers=RR_HEADER) for _ in range(2)]
        decisions = await stack.decisions()
        assert {decisions[w[0]]["served_by"] for w in warm} == {replica_id(0), replica_id(1)}
        before = await stack.engine_counters()
        beta_first = await complete(stack, prompt, "beta")
        cross = delta(await stack.engine_counters(), before)
        beta_again = await complete(stack, prompt, "beta")
        alpha_again = await complete(stack, prompt, "alpha")
        decisions = await stack.decisions()
        checked.append(
            {
                "prompt_tokens": beta_first[1],
                "beta_first_cached": beta_first[2],
                "cross_tenant_hits": cross.hits,
                "beta_first_on": decisions[beta_first[0]]["served_by"],
                "beta_first_predicted": decisions[beta_first[0]]["predicted_cached_tokens"],
                "beta_repeat_cached": beta_again[2],
                "alpha_repeat_cached": alpha_again[2],
            }
        )
    e2e_results.record(
        "3. Tenant isolation",
        "Same prompt, tenants alpha then beta (alpha's blocks on both engines first):",
        "",
        *(f"- {c}" for c in checked),
        "",
        f"cross-tenant hits (vLLM counters, beta's first requests): "
        f"{sum(c['cross_tenant_hits'] for c in checked):.0f}",
    )
    for c in checked:
        assert c["beta_first_cached"] == 0 and c["cross_tenant_hits"] == 0, c
        assert c["beta_first_predicted"] == 0, c
        # Isolation, not a broken cache: each tenant's own repeat hits.
        assert c["beta_repeat_cached"] > 0 and c["alpha_repeat_cached"] > 0, c


# --------------------------------------------------------------------------- 4. adapters


async def admin_adapters(stack: Stack) -> dict[str, list[str]]:
    resp = await stack.http.get(f"{stack.url}/admin/adapters", headers=ADMIN)
    assert resp.status_code == 200, resp.text
    return {a["name"]: a["loaded_on"] for a in resp.json()["adapters"]}


async def lora_info(http: httpx.AsyncClient, engine: VllmEngine) -> str:
    """The current ``vllm:lora_requests_info`` sample (the one with the largest value)."""
    text = (await http.get(f"{engine.url}/metrics")).text
    samples = [
        line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")
    ]
    return max(samples, key=lambda s: float(s.rsplit(" ", 1)[1])) if samples else ""


async def test_adapters_route_to_where_they_are_loaded_and_load_at_runtime(
    stack: Stack, e2e_results: E2EResults
) -> None:
    http = stack.http
    # A clean slate: earlier tests may have loaded adapters on the engines.
    for engine in stack.engines:
        for name in await engine_adapters(http, engine):
            resp = await http.post(
                f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": name}
            )
            assert resp.status_code == 200, resp.text

    async def nothing_loaded() -> bool:
        return not any((await admin_adapters(stack)).values())

    await eventually(nothing_loaded, "the gateway sees no adapter loaded")
    # tiny-lora-0 is put on r1 behind the gateway's back (an operator, another gateway).
    source = (await admin_adapters_sources(stack))["tiny-lora-0"]
    resp = await http.post(
        f"{stack.engines[1].url}/v1/load_lora_adapter",
        json={"lora_name": "tiny-lora-0", "lora_path": source},
    )
    assert resp.status_code == 200, resp.text

    async def seen_on_r1() -> bool:
        return (await admin_adapters(stack))["tiny-lora-0"] == [replica_id(1)]

    await eventually(seen_on_r1, "the gateway sees tiny-lora-0 on r1")
    nonce = f"a{time.time_ns()}"
    first = [
        await complete(stack, f"adapter probe {j} {nonce} " + "words " * 20, model="tiny-lora-0")
        for j in range(4)
    ]
    decisions = await stack.decisions()
    first_on = [decisions[r[0]]["served_by"] for r in first]

    # Issue 6: three adapters over two replicas, loaded at runtime by the gateway's registry.
    names = ["tiny-lora-0", "tiny-lora-1", "tiny-lora-2"]
    served: dict[str, list[str]] = {n: [] for n in names}
    ids = []
    for j in range(12):
        name = names[j % 3]
        request_id, _, _ = await complete(
            stack, f"multi adapter {j} {nonce} " + "tokens " * 20, model=name
        )
        ids.append((name, request_id))
    decisions = await stack.decisions()
    for name, request_id in ids:
        served[name].append(decisions[request_id]["served_by"])
    on_engine = {
        replica_id(i): await engine_adapters(http, engine) for i, engine in enumerate(stack.engines)
    }
    loads = {
        n: await stack.gateway_metric("fleetgate_adapter_loads_total", adapter=n, outcome="ok")
        for n in names
    }
    infos = [await lora_info(http, engine) for engine in stack.engines]
    e2e_results.record(
        "4. Adapter placement (max-loras 2, three adapters, two replicas)",
        f"- tiny-lora-0 loaded on {replica_id(1)} directly on the engine; 4 requests served by "
        f"{first_on}",
        f"- then 12 requests (tiny-lora-0/1/2 interleaved) served by: {served}",
        f"- engines' /v1/models adapters afterwards: "
        f"{ {k: sorted(v) for k, v in on_engine.items()} }",
        f"- gateway runtime loads (`fleetgate_adapter_loads_total{{outcome=\"ok\"}}`): {loads}",
        f"- gateway placement (/admin/adapters loaded_on): {await admin_adapters(stack)}",
        *(f"- {replica_id(i)} `{info}`" for i, info in enumerate(infos)),
    )
    assert first_on == [replica_id(1)] * 4
    assert "tiny-lora-0" not in on_engine[replica_id(0)]  # never loaded where not needed
    for name in names:
        # Each adapter's requests all land on one replica, and the engine there has it loaded.
        assert len(set(served[name])) == 1, served
        assert name in on_engine[served[name][0]], (name, on_engine)
    assert loads == {"tiny-lora-0": 0, "tiny-lora-1": 1, "tiny-lora-2": 1}
    assert all('max_lora="2"' in info for info in infos), infos


async def admin_adapters_sources(stack: Stack) -> dict[str, str]:
    resp = await stack.http.get(f"{stack.url}/admin/adapters", headers=ADMIN)
    return {a["name"]: a["source"] for a in resp.json()["adapters"]}


# --------------------------------------------------------------------------- 5. failover


async def _match_patiently(index: RedisBlockIndex, chain: list[BlockHash]) -> dict[ReplicaId, int]:
    """``index.match`` for the test's own look: with both cores busy generating, one Redis read
    can exceed the index's 1 s timeout; that is the test's measurement failing, not the system."""
    for attempt in range(5):
        try:
            return await index.match(chain)
        except IndexUnavailable:
            if attempt == 4:
                raise
            await asyncio.sleep(0.2)
    raise AssertionError("unreachable")


# The test restarts an engine, which may take up to ENGINE_START_TIMEOUT_S by itself: the
# test's own budget must hold that restart plus the failover around it.
@pytest.mark.timeout(ENGINE_START_TIMEOUT_S + 300)
async def test_killed_engine_fails_over_then_restart_gets_a_new_epoch(
    stack: Stack, tokenizer: LocalTokenizer, e2e_results: E2EResults
) -> None:
    nonce = f"k{time.time_ns()}"
    prefix = await padded_text(
        tokenizer, f"failover {nonce}.", "line {i} of the failover prompt.", 6
    )
    await complete(stack, prefix + " first?")  # the prefix is cached (and indexed) somewhere
    salt = stack.gw.policy.tenants_by_key_sha256[
        hashlib.sha256(api_key("alpha").encode()).hexdigest()
    ].cache_salt

    # Requests in flight when an engine dies: long generations, not streamed. The victim is
    # the engine that runs one of them (and holds its prompt's blocks). Their chains are
    # computed first: nothing slow between sighting and kill.
    flight_ids = [rid("long") for _ in range(3)]
    seed = chain_seed(SERVED_MODEL, None, salt)
    flight_chains = [
        hash_token_blocks(await tokens_of(tokenizer, prefix + f" long {j}?"), BLOCK_SIZE, seed)
        for j in range(len(flight_ids))
    ]
    # The victim is frozen by the gateway's own dispatch of the first long request: the
    # attempt is registered, then (before the request's bytes leave) its engine gets SIGSTOP.
    # The request is in flight on the victim by construction, whatever the machine's load: a
    # poll from the test could be starved while both engines generate on both cores, and the
    # request end unseen (it did, twice).
    attempts = stack.gw.registry.attempts
    dispatch = attempts.begin
    running_on: list[str] = []

    def begin_and_freeze(request_id, replica, *args, **kwargs):  # type: ignore[no-untyped-def]
        attempt = dispatch(request_id, replica, *args, **kwargs)
        if request_id in flight_ids and not running_on:
            running_on.append(replica)
            stack.engines[stack.engine_index(replica)].send_signal(signal.SIGSTOP)
        return attempt

    attempts.begin = begin_and_freeze  # type: ignore[method-assign]
    in_flight = [
        asyncio.create_task(
            complete(
                stack, prefix + f" long {j}?", max_tokens=800, ignore_eos=True, request_id=r
            )
        )
        for j, r in enumerate(flight_ids)
    ]
    stack.tasks.extend(in_flight)
    try:
        await eventually(
            lambda: bool(running_on), "the gateway sends a long request to a replica", 60
        )
    finally:
        attempts.begin = dispatch  # type: ignore[method-assign]
    victim_id = ReplicaId(running_on[0])
    victim_i = stack.engine_index(victim_id)
    victim = stack.engines[victim_i]
    # Frozen at dispatch (above): its request cannot finish, however long the index check below
    # takes on a busy machine. Without the freeze, a slow Redis round trip let the request end
    # before the kill, and nothing was left to fail over (no retry counted).
    # The long prompts share all but their last words: whichever of them runs on the victim,
    # the first one's prefix blocks are indexed there (the gateway's speculative entry, then
    # the engine's events). What the index says of it right now:
    chain = flight_chains[0]
    indexed: list[int] = []

    async def chain_indexed_on_victim() -> bool:
        indexed.append((await _match_patiently(stack.index, chain)).get(victim_id, 0))
        return indexed[-1] > 0

    # A Redis round trip or two: the generation it overlaps lasts seconds.
    await eventually(chain_indexed_on_victim, "the long request's chain is indexed on the victim")
    indexed_before = indexed[-1]
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    await asyncio.to_thread(victim.stop, 5.0)  # reap the group

    # The long requests first: nothing else runs, so every retry counted now is one of theirs.
    flight = await asyncio.gather(*in_flight, return_exceptions=True)
    flight_failed = [f for f in flight if isinstance(f, BaseException)]
    flight_retries = await stack.gateway_metric("fleetgate_upstream_retries_total")
    decided = await stack.decisions()
    flight_routes = [
        (decided[r]["replica"], decided[r]["served_by"]) for r in flight_ids if r in decided
    ]
    results: list[tuple[float, bool, str]] = []
    noticed_at: float | None = None
    j = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            request_id, _, _ = await complete(stack, prefix + f" after {j}?")
            served = (await stack.decisions())[request_id]["served_by"]
            results.append((time.monotonic() - killed_at, True, served))
        except Exception as exc:  # a failed request is a finding, recorded and asserted below
            results.append((time.monotonic() - killed_at, False, repr(exc)))
        j += 1
        view = await stack.replicas_view()
        if noticed_at is None and (
            victim_id not in view
            or not view[victim_id].get("healthy", True)
            or view[victim_id].get("circuit") == "open"
        ):
            noticed_at = time.monotonic() - killed_at
        if noticed_at is not None and sum(r[0] > noticed_at for r in results) >= 10:
            break
    failed = [r for r in results if not r[1]]
    after_notice = [r for r in results if noticed_at is not None and r[0] > noticed_at]

    # Restart on the same ports: a new process, a new epoch, none of the old blocks.
    agent = stack.agents[victim_i]
    old_epoch = agent.applier.epoch
    restart_started = time.monotonic()
    await asyncio.to_thread(victim.start)
    await asyncio.to_thread(victim.wait_healthy, ENGINE_START_TIMEOUT_S)
    restart_s = time.monotonic() - restart_started
    await eventually(lambda: agent.engine_up, "the agent sees the engine back")
    await eventually(
        lambda: stack.routable([victim_id]), "the gateway routes to the restarted replica"
    )
    new_epoch = agent.applier.epoch
    stale = (await stack.index.match(chain)).get(victim_id, 0)

    # Hits return on the restarted engine: new prefixes, each sent twice.
    before = await stack.engine_counters()
    tries = 0

    async def restarted_engine_hits() -> bool:
        nonlocal tries
        tries += 1
        text = f"after restart {tries} {nonce} " + "fresh shared words " * 20
        await complete(stack, text + " a?")
        await complete(stack, text + " b?")
        return (await stack.engine_counters())[victim_i].hits > before[victim_i].hits

    await eventually(restarted_engine_hits, "the restarted engine reports prefix hits", 60)
    e2e_results.record(
        "5. Killing and restarting an engine",
        f"- victim {victim_id} (SIGKILL of its process group) while 3 long non-streamed "
        f"requests ran: {len(flight) - len(flight_failed)}/{len(flight)} succeeded; "
        f"(decided for, served by): {flight_routes}; gateway retries before the first byte "
        f"(`fleetgate_upstream_retries_total`): {flight_retries:.0f}",
        f"- gateway marked the victim down at most {noticed_at:.2f} s after the kill"
        if noticed_at is not None
        else "- gateway never marked the victim down",
        f"- {len(results)} sequential requests after the kill: {len(failed)} failed; "
        f"{len(after_notice)} after the gateway noticed, served by "
        f"{dict(Counter(r[2] for r in after_notice))}",
        f"- restart: healthy after {restart_s:.0f} s; epoch {old_epoch} -> {new_epoch}; "
        f"blocks of the running prompt indexed on it before the kill: {indexed_before}, "
        f"after the restart: {stale}",
        f"- hits on the restarted engine after {tries} new prefix pair(s)",
    )
    assert flight_failed == [], flight_failed
    # At least one was running on the victim (checked before the kill): it was retried.
    assert flight_retries >= 1, flight_routes
    assert failed == [], failed
    assert noticed_at is not None
    assert all(r[2] == replica_id(1 - victim_i) for r in after_notice), after_notice
    assert new_epoch != old_epoch
    assert indexed_before > 0 and stale == 0
