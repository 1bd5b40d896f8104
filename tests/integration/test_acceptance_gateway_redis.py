"""Acceptance: the gateway over a real Redis index fed by agents reading simulated replicas' KV
events (production wiring, one process): prefix hit rate against the ideal, a replica killed
mid-run, a Redis outage mid-run, and tenant isolation of cached prefixes.

Every number asserted here comes from the engines' own counters or from what the client saw.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from bench.local_redis import LocalRedisCluster, LocalRedisSentinel
from replica.sim.fleet import start_sim_fleet
from tests.integration.acceptance_support import (
    MODEL,
    ClientResult,
    PrefixCounters,
    RedisStack,
    TokenGate,
    chat_body,
    client_session,
    decisions,
    engine_prefix_counters,
    eventually,
    get_metric,
    hang_guard,
    kill_replica,
    post_and_read,
    redis_stack,
)
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

REPLICAS = 3
BLOCK_SIZE = 16
TOPICS = [
    "billing",
    "shipping",
    "privacy",
    "returns",
    "warranty",
    "payments",
    "accounts",
    "security",
    "pricing",
]
#: One long system prompt per topic: the shared prefixes of a RAG-style chatbot.
SYSTEM_PROMPTS = [
    " ".join(f"{topic} handbook rule {i} applies to every {topic} case." for i in range(30))
    for topic in TOPICS
]
#: Each replica's KV cache holds this many system prompts (plus room for unique tails): the
#: fleet's cache (3 x 3.5) holds all nine when a router partitions prompts over replicas; one
#: replica's holds 3.5/9 = 39 % of them, so a router that sends every prompt everywhere
#: (round-robin) can keep only about that share of the ideal hits (LRU, uniform popularity).
PROMPTS_PER_REPLICA_CACHE = 3.5


def _messages(topic: int, question: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM_PROMPTS[topic]},
        {"role": "user", "content": f"question {question}?"},
    ]


def _workload(requests: int, seed: int = 11) -> list[list[dict[str, str]]]:
    """Each request: a system prompt drawn uniformly at random, then a unique question."""
    rng = random.Random(seed)
    return [_messages(rng.randrange(len(SYSTEM_PROMPTS)), j) for j in range(requests)]


def _kv_blocks_per_replica() -> int:
    from routing.tokenize.word_hash import load_tokenizer

    tokens = len(load_tokenizer(None).encode_chat(_messages(0, 0)))
    blocks_per_prompt = -(-tokens // BLOCK_SIZE)
    # + 8 blocks for the running request's tail and recently finished requests' unique tails.
    return int(PROMPTS_PER_REPLICA_CACHE * blocks_per_prompt) + 8


async def _ideal_hit_rate(workload: list[list[dict[str, str]]]) -> PrefixCounters:
    """IDEAL: the engine hit rate (hits / queried prompt tokens, as the engine counts them: whole
    blocks, last prompt token always recomputed) of ONE replica whose cache never evicts,
    fed the same requests in the same order. No router can beat it: every cached prefix is
    everywhere."""
    async with (
        start_sim_fleet(
            1, model=MODEL, speed=1000.0, kv_events=None, kv_replay=None, block_size=BLOCK_SIZE
        ) as fleet,
        client_session() as http,
    ):
        for j, messages in enumerate(workload):
            result = await post_and_read(
                http, fleet.urls[0], "/v1/chat/completions", chat_body(messages), f"ideal-{j}"
            )
            assert result.ok, result
        counters = await engine_prefix_counters(http, fleet.urls)
        stats = fleet.replicas[0].replica.engine.stats()
        # Room for every token of every request (prompts and outputs): nothing was ever evicted.
        assert stats.num_blocks * BLOCK_SIZE > counters.queries + 2 * len(workload)
        return counters


async def _routed_hit_rate(
    redis_url: str,
    profile: str,
    workload: list[list[dict[str, str]]],
    index_url: str | None = None,
) -> PrefixCounters:
    overrides = {"num_gpu_blocks_override": _kv_blocks_per_replica(), "block_size": BLOCK_SIZE}
    async with (
        redis_stack(
            redis_url, REPLICAS, profile=profile, engine_overrides=overrides, index_url=index_url
        ) as stack,
        client_session() as http,
    ):
        for j, messages in enumerate(workload):
            result = await post_and_read(
                http, stack.url, "/v1/chat/completions", chat_body(messages), f"{profile}-{j}"
            )
            assert result.ok, result
        if index_url is not None:
            await _assert_index_lives_in(index_url, redis_url, stack.index_prefix)
        return await engine_prefix_counters(http, stack.fleet.urls)


async def _assert_index_lives_in(index_url: str, other_url: str, prefix: str) -> None:
    """The agents' snapshots are on the Cluster's primaries, none on the fleet store's server
    (the gateway's own guesses alone would also give prefix affinity: this shows whose index
    the decisions read)."""
    import redis.asyncio as aioredis

    from routing.index.redis_client import connect

    cluster, server = connect(index_url), aioredis.Redis.from_url(other_url)
    try:
        pattern = "{" + prefix + ":s*}:blk:*"
        on_cluster = [k async for k in cluster.scan_iter(match=pattern, count=1000)]
        on_server = [k async for k in server.scan_iter(match=pattern, count=1000)]
    finally:
        await cluster.aclose()
        await server.aclose()
    assert len(on_cluster) == REPLICAS and not on_server, (on_cluster, on_server)


async def test_shared_prefix_hit_rate_reaches_90_percent_of_ideal(redis_url: str) -> None:
    workload = _workload(108)
    async with hang_guard("the hit-rate runs", limit_s=100):
        ideal = await _ideal_hit_rate(workload)
        aware = await _routed_hit_rate(redis_url, "expected-ttft", workload)
        blind = await _routed_hit_rate(redis_url, "round-robin", workload)
    print(
        f"\nprefix hit rate (engine counters, hits/queried tokens) over {len(workload)} requests,"
        f" {len(SYSTEM_PROMPTS)} shared prefixes, {REPLICAS} replicas:"
        f"\n  ideal (1 replica, unbounded cache): {ideal.hit_rate:.3f}"
        f" ({ideal.hits:.0f}/{ideal.queries:.0f})"
        f"\n  expected-ttft: {aware.hit_rate:.3f} = {aware.hit_rate / ideal.hit_rate:.1%} of ideal"
        f"\n  round-robin:   {blind.hit_rate:.3f} = {blind.hit_rate / ideal.hit_rate:.1%} of ideal"
        f" (1/N = {1 / REPLICAS:.1%})"
    )
    assert aware.queries == blind.queries == ideal.queries  # the same prompt tokens everywhere
    assert aware.hit_rate >= 0.9 * ideal.hit_rate
    assert blind.hit_rate <= 0.6 * ideal.hit_rate


async def test_the_index_on_a_redis_cluster_keeps_the_hit_rate(
    redis_url: str, redis_cluster: LocalRedisCluster
) -> None:
    """Production wiring with the block index on a three-primary Redis Cluster (agents write
    it, the gateway mirrors it) and the fleet store on one server: the same bar as above."""
    workload = _workload(108)
    async with hang_guard("the hit-rate runs on a Cluster index", limit_s=100):
        ideal = await _ideal_hit_rate(workload)
        aware = await _routed_hit_rate(
            redis_url, "expected-ttft", workload, index_url=redis_cluster.url
        )
    print(
        f"\nprefix hit rate, index on a Redis Cluster: {aware.hit_rate:.3f} = "
        f"{aware.hit_rate / ideal.hit_rate:.1%} of ideal ({ideal.hit_rate:.3f})"
    )
    assert aware.queries == ideal.queries
    assert aware.hit_rate >= 0.9 * ideal.hit_rate


# --------------------------------------------------------------------------- a replica dies

#: (path, stream, the replica hands out its first tokens before it dies). Five kinds over three
#: replicas under round-robin: every replica holds one request of each kind.
_KINDS = [
    ("/v1/chat/completions", False, False),
    ("/v1/completions", False, False),
    ("/v1/completions", True, False),
    ("/v1/chat/completions", True, True),
    ("/v1/completions", True, True),
]


def _kind_body(j: int) -> tuple[str, dict[str, object]]:
    path, stream, _ = _KINDS[j % len(_KINDS)]
    text = f"request {j}: " + "an unrelated prompt about nothing in particular " * 4
    if path == "/v1/completions":
        body: dict[str, object] = {"model": MODEL, "prompt": text, "max_tokens": 4}
    else:
        body = chat_body([{"role": "user", "content": text}], max_tokens=4)
    if stream:
        body["stream"] = True
    return path, body


@pytest.mark.parametrize(
    "checked",
    [
        "non-streaming",
        "streaming-before-first-token",
    ],
)
async def test_killing_a_replica_loses_no_request_that_had_not_streamed(
    redis_url: str, checked: str
) -> None:
    requests = 15
    async with (
        redis_stack(redis_url, REPLICAS, profile="round-robin") as stack,
        client_session() as http,
    ):
        post_ids = {f"kill-{j}" for j in range(requests) if _KINDS[j % len(_KINDS)][2]}
        gates = [TokenGate(after_first=post_ids) for _ in stack.fleet.replicas]
        for gate, handle in zip(gates, stack.fleet.replicas, strict=True):
            gate.install(handle.replica)
        tasks: list[asyncio.Task[ClientResult]] = []
        try:
            for j in range(requests):
                path, body = _kind_body(j)
                tasks.append(
                    asyncio.create_task(post_and_read(http, stack.url, path, body, f"kill-{j}"))
                )
                # One at a time, each held before the next is sent: round-robin's order is exact.
                await eventually(
                    lambda n=j + 1: (
                        sum(len(g.held) for g in gates) == n or any(t.done() for t in tasks)
                    ),
                    f"request kill-{j} is held",
                    timeout_s=30,
                )
                finished = [t.result() for t in tasks if t.done()]
                assert not finished, f"answered before the replica died: {finished}"
            victim = stack.fleet.replicas[0]
            on_victim = set(gates[0].held)
            assert on_victim == {f"kill-{j}" for j in range(0, requests, REPLICAS)}

            await kill_replica(victim)
        finally:
            # Survivors go on (and a failed set-up does not leave handlers waiting at a gate).
            for gate in gates:
                gate.release.set()
        # The run goes on: later requests (round-robin tries the dead replica too) still succeed.
        later = []
        for j in range(requests, requests + 6):
            path, body = _kind_body(j)
            later.append(await post_and_read(http, stack.url, path, body, f"kill-{j}"))
        results = {r.request_id: r for r in await asyncio.gather(*tasks)}
        retries = await get_metric(http, stack.url, "fleetgate_upstream_retries_total")

    failed = [r for r in results.values() if not r.ok]
    streamed_then_failed = [r for r in failed if r.events_before_error > 0]
    not_streamed = {
        rid: r
        for rid, r in results.items()
        if rid in on_victim and rid not in post_ids and r.events_before_error == 0
    }
    print(
        f"\nkilled replica held {len(on_victim)} requests ({len(on_victim - post_ids)} before "
        f"their first token, {len(on_victim & post_ids)} mid-stream); client-visible failures: "
        f"{len(failed)} ({len(streamed_then_failed)} had already streamed); gateway retries: "
        f"{retries:.0f}; later requests ok: {sum(r.ok for r in later)}/{len(later)}"
        f"\n  failures: {[(r.request_id, r.error, r.events_before_error) for r in failed]}"
    )
    assert all(r.ok for r in later)
    assert all(results[rid].ok for rid in results if rid not in on_victim)
    # The requests that had streamed to the client when their replica died are lost (in-band
    # error): replaying them elsewhere would duplicate text the client already has.
    assert {r.request_id for r in streamed_then_failed} <= on_victim & post_ids
    if checked == "non-streaming":
        non_streaming = [rid for rid in on_victim if not _KINDS[int(rid[5:]) % len(_KINDS)][1]]
        assert len(non_streaming) == 2
        assert all(results[rid].ok for rid in non_streaming), results
    else:
        streams = [rid for rid in not_streamed if _KINDS[int(rid[5:]) % len(_KINDS)][1]]
        assert streams, not_streamed
        assert all(results[rid].ok for rid in streams), [results[rid] for rid in streams]
        # Overall: every client-visible failure had already streamed a byte.
        assert failed == streamed_then_failed


# --------------------------------------------------------------------------- Redis goes away


async def _send_topics(
    stack: RedisStack, http: aiohttp.ClientSession, topics: list[int], tag: str
) -> list[int]:
    """One request per entry (system prompt ``topics[i]``, unique question); all must succeed.
    Returns the engine's cached tokens of each."""
    cached = []
    for j, topic in enumerate(topics):
        result = await post_and_read(
            http, stack.url, "/v1/chat/completions", chat_body(_messages(topic, j)), f"{tag}-{j}"
        )
        assert result.ok, result
        assert result.cached_tokens is not None
        cached.append(result.cached_tokens)
    return cached


def _repeats(topics: list[int]) -> list[bool]:
    """Whether each request's system prompt was sent before (in this list)."""
    return [t in topics[:i] for i, t in enumerate(topics)]


async def test_redis_outage_degrades_to_load_only_with_zero_failures_then_recovers(
    redis_server: RedisServer,
) -> None:
    async with (
        redis_stack(redis_server.url, REPLICAS) as stack,
        client_session() as http,
    ):
        before = [0, 1, 2] * 3
        cached = await _send_topics(stack, http, before, "up")
        assert all(c > 0 for c, seen in zip(cached, _repeats(before), strict=True) if seen)
        assert await get_metric(http, stack.url, "fleetgate_degraded_decisions_total") == 0

        redis_server.stop()
        during = [3, 4, 5, 0, 1, 2] * 3
        # Concurrency as well as a sequence: nothing may fail while the index is gone.
        async with hang_guard("requests during the Redis outage"):
            outage = await asyncio.gather(
                *(
                    post_and_read(
                        http,
                        stack.url,
                        "/v1/chat/completions",
                        chat_body(_messages(t, j), stream=j % 2 == 0),
                        f"down-{j}",
                    )
                    for j, t in enumerate(during)
                )
            )
        failed = [r for r in outage if not r.ok]
        degraded = await get_metric(http, stack.url, "fleetgate_degraded_decisions_total")
        degraded_log = sum(d["degraded"] for d in await decisions(http, stack.url, len(during)))

        redis_server.start()  # same port, empty: the agents re-record their engines' blocks

        async def routing_on_the_index_again() -> bool:
            await _send_topics(stack, http, [0], "probe")
            (latest,) = await decisions(http, stack.url, 1)
            chosen = latest["explanations"][latest["replica"]]
            return not latest["degraded"] and chosen["matched_blocks"] > 0

        await eventually(routing_on_the_index_again, "decisions use the Redis index again")
        after = [6, 7, 8] * 3
        cached_after = await _send_topics(stack, http, after, "back")
        recent = await decisions(http, stack.url, len(after))

    print(
        f"\nRedis down: {len(during)} requests, {len(failed)} failed, degraded decisions "
        f"{degraded:.0f} (decision log: {degraded_log}/{len(during)});"
        f"\nRedis back: {sum(not d['degraded'] for d in recent)}/{len(after)} decisions "
        f"non-degraded, repeated prefixes cached: "
        f"{sum(c > 0 for c, s in zip(cached_after, _repeats(after), strict=True) if s)}"
        f"/{sum(_repeats(after))}"
    )
    assert failed == []
    assert degraded >= len(during) and degraded_log == len(during)
    assert not any(d["degraded"] for d in recent)
    # Prefix-aware again: every repeated system prompt lands where it is cached.
    assert all(c > 0 for c, seen in zip(cached_after, _repeats(after), strict=True) if seen)


async def _index_events(port: int, password: str | None, prefix: str) -> int:
    """Events in the index's shard streams on the server at ``port`` (not through Sentinel: the
    count of one server, whichever role it has)."""
    import redis.asyncio as aioredis

    server = aioredis.Redis(host="127.0.0.1", port=port, password=password)
    try:
        keys = [k async for k in server.scan_iter(match="{" + prefix + ":s*}:events")]
        return sum([await server.xlen(k) for k in keys])
    finally:
        await server.aclose()


async def test_a_sentinel_failover_loses_no_request_and_the_fleet_follows_the_new_primary() -> None:
    """Everything on Redis behind Sentinel (``redis+sentinel://``: index, fleet store, in-flight
    counts), then the primary SIGKILLed mid-traffic: nothing fails while the Sentinels promote
    a replica, and the agents and the gateway carry on with the promoted one."""
    sentinel = LocalRedisSentinel(password="fg-sentinel-pw").start()
    try:
        async with (
            redis_stack(sentinel.url, REPLICAS) as stack,
            client_session() as http,
        ):
            before = [0, 1, 2] * 3
            cached = await _send_topics(stack, http, before, "up")
            assert all(c > 0 for c, seen in zip(cached, _repeats(before), strict=True) if seen)
            old = sentinel.primary_port()

            during = [3, 4, 5, 0, 1, 2] * 3

            async def send_during() -> list[ClientResult]:
                return await asyncio.gather(
                    *(
                        post_and_read(
                            http,
                            stack.url,
                            "/v1/chat/completions",
                            chat_body(_messages(t, j), stream=j % 2 == 0),
                            f"failover-{j}",
                        )
                        for j, t in enumerate(during)
                    )
                )

            async with hang_guard("requests during the Sentinel failover"):
                promoted, outage = await asyncio.gather(
                    asyncio.to_thread(sentinel.kill_primary), send_during()
                )
            failed = [r for r in outage if not r.ok]
            events_then = await _index_events(promoted, sentinel.password, stack.index_prefix)

            async def routing_on_the_index_again() -> bool:
                await _send_topics(stack, http, [0], "probe")
                (latest,) = await decisions(http, stack.url, 1)
                chosen = latest["explanations"][latest["replica"]]
                return not latest["degraded"] and chosen["matched_blocks"] > 0

            await eventually(routing_on_the_index_again, "decisions use the index again")
            after = [6, 7, 8] * 3
            cached_after = await _send_topics(stack, http, after, "back")
            recent = await decisions(http, stack.url, len(after))
            events_now = await _index_events(promoted, sentinel.password, stack.index_prefix)
    finally:
        sentinel.stop()
    print(
        f"\nSentinel failover {old} -> {promoted}: {len(during)} requests during it, "
        f"{len(failed)} failed; index events on the promoted primary {events_then} -> "
        f"{events_now} after {len(after)} more requests"
    )
    assert promoted != old
    assert failed == []
    # The agents write the new prompts' blocks to the promoted primary, and the gateway reads
    # them: every repeated new system prompt lands where it is cached.
    assert events_now > events_then
    assert not any(d["degraded"] for d in recent)
    assert all(c > 0 for c, seen in zip(cached_after, _repeats(after), strict=True) if seen)


# --------------------------------------------------------------------------- tenant isolation


def _tenant_policy(redis_url: str) -> Callable[[str, str], str]:
    """Policy mode: tenants acme and globex (derived cache salts), agents' replicas discovered
    in Redis, the block index in Redis."""

    def sha(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    def policy(index_prefix: str, fleet_prefix: str) -> str:
        return f"""
version: 1
replica_pools:
  - name: pool-a
    discovery: {{redis_url: "{redis_url}", key_prefix: "{fleet_prefix}"}}
models:
  - name: {MODEL}
    pools: [pool-a]
tenants:
  - name: acme
    api_key_sha256: [{sha("acme-key")}]
  - name: globex
    api_key_sha256: [{sha("globex-key")}]
index:
  backend: redis
  redis_url: "{redis_url}"
  key_prefix: "{index_prefix}"
  lookup_timeout_ms: 500
routes:
  - name: main
    profile: expected-ttft
"""

    return policy


async def test_tenants_with_identical_prompts_never_share_cached_tokens(
    redis_url: str, tmp_path: Path
) -> None:
    # One replica: both tenants' requests reach the same engine, so only the salt separates them.
    async with (
        redis_stack(
            redis_url, 1, policy_yaml=_tenant_policy(redis_url), tmp_path=tmp_path
        ) as stack,
        client_session() as http,
    ):
        seen: dict[tuple[str, int, int], tuple[int | None, int, int]] = {}
        for topic in (0, 1):
            for tenant in ("acme", "globex"):
                for turn in (0, 1):
                    result = await post_and_read(
                        http,
                        stack.url,
                        "/v1/chat/completions",
                        chat_body(_messages(topic, 0)),
                        f"{tenant}-{topic}-{turn}",
                        headers={"Authorization": f"Bearer {tenant}-key"},
                    )
                    assert result.ok, result
                    (decision,) = await decisions(http, stack.url, 1)
                    assert decision["tenant"] == tenant
                    matched = max(e["matched_blocks"] for e in decision["explanations"].values())
                    seen[tenant, topic, turn] = (
                        result.cached_tokens,
                        matched,
                        decision["predicted_cached_tokens"],
                    )
    print("\n(tenant, prompt, turn): (engine cached tokens, index matched blocks, predicted)")
    for key, value in seen.items():
        print(f"  {key}: {value}")
    for topic in (0, 1):
        # acme warmed the prompt: its own repeat hits, in the engine and in the index.
        assert seen["acme", topic, 0] == (0, 0, 0)
        cached, matched, predicted = seen["acme", topic, 1]
        assert cached > 0 and matched > 0 and predicted == cached
        # globex's identical prompt: nothing cached in the engine, nothing predicted by the index.
        assert seen["globex", topic, 0] == (0, 0, 0)
        # ...and globex's own repeat hits: isolation, not a broken cache.
        cached, matched, predicted = seen["globex", topic, 1]
        assert cached > 0 and matched > 0 and predicted == cached
