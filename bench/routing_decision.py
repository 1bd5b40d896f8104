"""Benchmark: how long one routing decision takes (index lookup + policy engine).

For a 6,000-token prompt over 16 and 64 replicas, against a prefilled block index (in-memory, and
Redis: ``REDIS_URL`` or a private ``redis-server``), it times ≥ 2,000 decisions of the
``expected-ttft`` policy and reports p50/p99 of:

* hashing the prompt into its block chain (reported separately: the gateway does it once per
  request whatever the policy);
* the index lookup alone (from the decision's ``timings_ms``);
* the whole decision (index lookup + filters + scorers + picker), measured around ``route``;
* a ``round-robin`` decision on the same replicas, interleaved in the same loop, as a baseline: the
  machine is shared and noisy, so the ratio to the baseline is steadier than absolute figures.

Run from the repository root::

    .venv/bin/python -m bench.routing_decision

and it rewrites ``docs/benchmarks/routing-decision.md``. Targets: decision p99 ≤ 1 ms with the
in-memory index, ≤ 2 ms with Redis on the same host.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import random
import shlex
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import redis.asyncio as aioredis

from bench._bench_common import write_page
from gateway.inflight import MemoryInflight
from gateway.replicas import ReplicaRegistry
from routing.contracts import BlockIndex, RoutingRequest
from routing.engine import RoutingEngine
from routing.hashing import chain_seed, hash_token_blocks
from routing.index import MemoryBlockIndex, MirrorBlockIndex, RedisBlockIndex
from routing.policies.registry import DEFAULT_PROFILE, builtin_profile
from routing.prune import Pruning
from routing.state import ReplicaState
from routing.types import Epoch, ReplicaId

MODEL = "bench-model"
TARGET_P99_MS = {"memory": 1.0, "redis": 2.0, "mirror": 1.0}
#: TTL of the speculative write that follows each decision (as the gateway's).
SPECULATIVE_TTL_S = 10.0
DEFAULT_OUTPUT = Path("docs/benchmarks/routing-decision.md")


@dataclass(frozen=True)
class Workload:
    """The shape of the benchmark: prompt size, fleet sizes, index fill."""

    prompt_tokens: int
    block_size: int
    system_prompts: int
    system_prompt_tokens: int
    prefill_chains: int
    decisions: int
    warmup: int
    seed: int


@dataclass(frozen=True)
class Row:
    """One (backend, replica count) result, in milliseconds."""

    backend: str
    replicas: int
    decisions: int
    index_entries: int
    hashing: tuple[float, float]
    index: tuple[float, float]
    decision: tuple[float, float]
    #: Decision minus index lookup, per decision: what the policy engine itself costs.
    engine: tuple[float, float]
    baseline: tuple[float, float]
    degraded: int
    #: Mean number of replicas the index matched per decision, and their mean depth in blocks.
    matched_replicas: float
    matched_blocks: float
    #: Mean number of replicas the policy scored per decision (all, unless the engine pruned).
    scored_replicas: float = 0.0
    #: The gateway's own work before each decision: bringing the in-flight counts into the
    #: replica registry (``refresh_inflight``) and taking the fleet it routes on (``routable``).
    registry: tuple[float, float] = (0.0, 0.0)
    #: Redis only: the server's own time per match script call (``INFO commandstats``), ms.
    server_ms: float | None = None
    #: Redis and mirror, with ``--speculative-writes``: the server's time per routed request,
    #: all commands it caused (lookup, speculative write, the mirror's stream reads), ms.
    server_ms_per_request: float | None = None

    @property
    def target_ms(self) -> float:
        return TARGET_P99_MS[self.backend]

    @property
    def meets_target(self) -> bool:
        return self.decision[1] <= self.target_ms


def percentiles(samples_ms: Sequence[float]) -> tuple[float, float]:
    """(p50, p99) of ``samples_ms``."""
    p50, p99 = np.percentile(np.asarray(samples_ms, dtype=float), [50, 99])
    return float(p50), float(p99)


def make_replicas(count: int, rng: random.Random) -> list[ReplicaState]:
    """A fleet with varied, realistic load so no policy branch is trivially short."""
    return [
        ReplicaState(
            replica_id=ReplicaId(f"pool-a/replica-{i}"),
            url=f"http://10.0.0.{i}:8000",
            models=frozenset({MODEL}),
            running=rng.randint(0, 24),
            waiting=rng.randint(0, 4),
            kv_usage=rng.uniform(0.2, 0.95),
            inflight_requests=rng.randint(0, 24),
            inflight_prefill_tokens=rng.randint(0, 20_000),
            loaded_adapters=frozenset({"tenant-a-lora"}) if i % 4 == 0 else frozenset(),
            max_loras=4,
        )
        for i in range(count)
    ]


class Prompts:
    """Token prompts: one of a few long system prompts followed by a fresh user turn."""

    def __init__(self, workload: Workload, rng: np.random.Generator) -> None:
        self._w = workload
        self._rng = rng
        self.system = [
            rng.integers(0, 150_000, workload.system_prompt_tokens, dtype=np.uint32)
            for _ in range(workload.system_prompts)
        ]

    def prompt(self) -> np.ndarray:
        """A ``prompt_tokens``-long prompt sharing a random system prompt."""
        w = self._w
        system = self.system[int(self._rng.integers(len(self.system)))]
        tail = self._rng.integers(0, 150_000, w.prompt_tokens - len(system), dtype=np.uint32)
        return np.concatenate([system, tail])

    def token_list(self) -> list[int]:
        """A prompt as the gateway's tokenizer hands it over: a list of Python ints."""
        return self.prompt().tolist()


async def prefill(
    index: BlockIndex, replicas: Sequence[ReplicaState], prompts: Prompts, w: Workload, seed: int
) -> None:
    """Fill the index with ``prefill_chains`` full prompts, each held by one to three replicas."""
    rng = random.Random(seed)
    for replica in replicas:
        await index.set_epoch(replica.replica_id, Epoch(1))
    for _ in range(w.prefill_chains):
        chain = hash_token_blocks(prompts.prompt(), w.block_size, seed)
        for replica in rng.sample(list(replicas), rng.randint(1, 3)):
            await index.record(replica.replica_id, Epoch(1), chain)


async def measure(
    backend: str,
    index: BlockIndex,
    replicas: Sequence[ReplicaState],
    prompts: Prompts,
    w: Workload,
    redis_client: aioredis.Redis | None = None,
    speculative_writes: bool = False,
    policy: str = DEFAULT_PROFILE,
    pruning: Pruning | None = Pruning(),  # noqa: B008 - frozen
) -> Row:
    """Time ``w.decisions`` decisions of ``policy``, each followed by a round-robin baseline."""
    seed = chain_seed(MODEL, None, "tenant-salt")
    await prefill(index, replicas, prompts, w, seed)
    if isinstance(index, MirrorBlockIndex):
        await index.sync(timeout_s=60.0)  # the mirror has applied its own prefill's echo
    stats = await index.stats()
    profiles = {policy: builtin_profile(policy)}
    profiles["round-robin"] = builtin_profile("round-robin")
    engine = RoutingEngine(index, profiles, index_timeout_s=0.5, pruning=pruning)
    token_lists = [prompts.token_list() for _ in range(64)]  # reused: building them is not timed
    # The replicas as the gateway holds them: its registry, fed by its in-flight tracker, hands
    # the engine a Fleet whose queue figures are arrays kept in step (routing/fleet.py). Each
    # decision sends a request to the chosen replica and ends the oldest one in flight, so the
    # counts move as in a gateway at a steady load.
    registry = ReplicaRegistry()
    inflight = MemoryInflight()
    in_flight: deque[tuple[ReplicaId, float]] = deque()
    for replica in replicas:
        registry.upsert(replica)
        for _ in range(replica.inflight_requests):
            inflight.start(replica.replica_id, 0)
            in_flight.append((replica.replica_id, time.time()))
    registry.refresh_inflight(inflight)
    registry_ms: list[float] = []

    hashing: list[float] = []
    index_ms: list[float] = []
    engine_ms: list[float] = []
    decision: list[float] = []
    baseline: list[float] = []
    degraded = 0
    matched_replicas: list[int] = []
    matched_blocks: list[int] = []
    scored: list[int] = []
    clock = time.perf_counter
    gc.collect()
    for i in range(w.warmup + w.decisions):
        tokens = token_lists[i % len(token_lists)]
        start = clock()
        chain = hash_token_blocks(tokens, w.block_size, seed)
        hashed = clock()
        start_registry = clock()
        registry.refresh_inflight(inflight)
        fleet = registry.routable()
        registry_done = clock()
        request = RoutingRequest(
            request_id=f"bench-{i}",
            model=MODEL,
            adapter=None,
            tenant="bench",
            route="bench",
            prompt_tokens=len(tokens),
            chain=chain,
            block_size=w.block_size,
        )
        start_decision = clock()
        result = await engine.route(request, fleet, policy)
        decided = clock()
        plain = RoutingRequest(
            request_id=f"rr-{i}", model=MODEL, adapter=None, tenant="bench", route="bench",
            prompt_tokens=len(tokens), chain=chain, block_size=w.block_size,
        )
        start_baseline = clock()
        await engine.route(plain, fleet, "round-robin")
        done = clock()
        inflight.start(result.replica, 0)
        in_flight.append((result.replica, time.time()))
        if in_flight:
            ended, sent_at = in_flight.popleft()
            inflight.finish(ended, 0, sent_at)
        if speculative_writes:
            # What the gateway does next (in the background, untimed here): the chosen replica
            # is about to hold the prompt's chain, a guess with a TTL.
            await index.record(result.replica, Epoch(1), chain, ttl_s=SPECULATIVE_TTL_S)
        if i < w.warmup:
            if i == w.warmup - 1 and redis_client is not None:
                await redis_client.config_resetstat()  # count the timed lookups only
            continue
        lookup_ms = result.timings_ms.get("index", 0.0)
        hashing.append((hashed - start) * 1000)
        registry_ms.append((registry_done - start_registry) * 1000)
        decision.append((decided - start_decision) * 1000)
        engine_ms.append((decided - start_decision) * 1000 - lookup_ms)
        baseline.append((done - start_baseline) * 1000)
        index_ms.append(lookup_ms)
        degraded += result.degraded
        matches = request.prefix_matches or {}
        matched_replicas.append(len(matches))
        matched_blocks.extend(matches.values())
        scored.append(1 + len(result.fallbacks))  # the picker orders every scored replica
    server_ms = None
    server_ms_per_request = None
    if redis_client is not None:
        if isinstance(index, MirrorBlockIndex):
            await index.sync(timeout_s=60.0)  # its stream reads of the run count too
        commandstats = await redis_client.info("commandstats")
        scripts = commandstats.get("cmdstat_evalsha", {})
        if scripts.get("calls") and not speculative_writes:
            server_ms = scripts["usec"] / scripts["calls"] / 1000
        # Every command the routed requests caused; not the benchmark's own INFO / CONFIG, nor
        # the sync's XREVRANGE probes.
        own = {"cmdstat_info", "cmdstat_config", "cmdstat_xrevrange"}
        caused_usec = sum(
            stats_of["usec"] for name, stats_of in commandstats.items() if name not in own
        )
        server_ms_per_request = caused_usec / w.decisions / 1000
    return Row(
        server_ms=server_ms,
        server_ms_per_request=server_ms_per_request,
        backend=backend,
        replicas=len(replicas),
        decisions=w.decisions,
        index_entries=stats.entries,
        hashing=percentiles(hashing),
        index=percentiles(index_ms),
        decision=percentiles(decision),
        engine=percentiles(engine_ms),
        baseline=percentiles(baseline),
        degraded=degraded,
        matched_replicas=float(np.mean(matched_replicas)),
        matched_blocks=float(np.mean(matched_blocks)) if matched_blocks else 0.0,
        scored_replicas=float(np.mean(scored)),
        registry=percentiles(registry_ms),
    )


@asynccontextmanager
async def redis_index(url: str) -> AsyncIterator[tuple[RedisBlockIndex, aioredis.Redis]]:
    """A ``RedisBlockIndex`` under a key prefix of its own (and its client), deleted afterwards."""
    prefix = f"bench-{uuid.uuid4().hex[:12]}"
    client = aioredis.Redis.from_url(url, decode_responses=True)
    # Generous: a timed-out prefill write would end the run (the shared machine stalls).
    index = RedisBlockIndex(client, key_prefix=prefix, timeout_s=5.0)
    try:
        yield index, client
    finally:
        keys = [key async for key in client.scan_iter(match=f"{{{prefix}}}:*", count=1000)]
        for start in range(0, len(keys), 1000):
            await client.delete(*keys[start : start + 1000])
        await client.aclose()


@asynccontextmanager
async def mirror_index(url: str) -> AsyncIterator[tuple[MirrorBlockIndex, aioredis.Redis]]:
    """A started ``MirrorBlockIndex`` under a key prefix of its own, deleted afterwards."""
    prefix = f"bench-{uuid.uuid4().hex[:12]}"
    client = aioredis.Redis.from_url(url, decode_responses=True)
    index = MirrorBlockIndex(url, key_prefix=prefix, timeout_s=5.0, bootstrap_timeout_s=60.0)
    await index.start()
    try:
        yield index, client
    finally:
        await index.close()
        keys = [key async for key in client.scan_iter(match=f"{{{prefix}*", count=1000)]
        for start in range(0, len(keys), 1000):
            await client.delete(*keys[start : start + 1000])
        await client.aclose()


async def run_all(args: argparse.Namespace, redis_url: str | None) -> list[Row]:
    w = Workload(
        prompt_tokens=args.prompt_tokens,
        block_size=args.block_size,
        system_prompts=args.system_prompts,
        system_prompt_tokens=args.system_prompt_tokens,
        prefill_chains=args.prefill_chains,
        decisions=args.decisions,
        warmup=args.warmup,
        seed=args.seed,
    )
    rows: list[Row] = []
    for count in args.replicas:
        for backend in args.backends:
            rng = random.Random(f"{args.seed}-{count}")
            prompts = Prompts(w, np.random.default_rng(args.seed))
            replicas = make_replicas(count, rng)
            writes = args.speculative_writes
            options = {
                "policy": args.policy,
                "pruning": None if args.no_prune else Pruning(),
            }
            if backend == "memory":
                rows.append(
                    await measure(
                        backend, MemoryBlockIndex(), replicas, prompts, w, None, writes, **options
                    )
                )
            elif backend == "mirror":
                assert redis_url is not None
                async with mirror_index(redis_url) as (index, client):
                    rows.append(
                        await measure(
                            backend, index, replicas, prompts, w, client, writes, **options
                        )
                    )
            else:
                assert redis_url is not None
                async with redis_index(redis_url) as (index, client):
                    rows.append(
                        await measure(
                            backend, index, replicas, prompts, w, client, writes, **options
                        )
                    )
            print(format_row(rows[-1]), file=sys.stderr)
    return rows


def format_row(row: Row) -> str:
    """One markdown table row."""
    ratio = row.decision[0] / row.baseline[0] if row.baseline[0] > 0 else float("nan")

    def pair(values: tuple[float, float]) -> str:
        return f"{values[0]:.3f} / {values[1]:.3f}"

    verdict = "yes" if row.meets_target else "**no**"
    per_request = (
        "—" if row.server_ms_per_request is None else f"{row.server_ms_per_request:.3f}"
    )
    return (
        f"| {row.backend} | {row.replicas} | {row.index_entries:,} | {pair(row.hashing)} | "
        f"{pair(row.registry)} | {pair(row.index)} | {pair(row.engine)} | {pair(row.decision)} | "
        f"{pair(row.baseline)} | {ratio:.1f}x | "
        f"≤ {row.target_ms:g} ms: {verdict} | {per_request} |"
    )


def render(rows: Sequence[Row], args: argparse.Namespace, command: str, redis_note: str) -> str:
    """The markdown report."""
    lines = [
        "# Routing decision time",
        "",
        "How long the gateway takes to choose a replica for one request: the block-index lookup",
        f"plus the policy engine (filters, scorers, picker), for the `{args.policy}` policy"
        + (
            ", every candidate scored (`--no-prune`)."
            if args.no_prune
            else f"; past {Pruning().above} candidates the engine scores only the "
            f"{Pruning().least_loaded} least loaded of each prefix-depth / adapter group "
            "(routing/prune.py)."
        ),
        "Prompt hashing is reported separately (it happens once per request whatever the policy),",
        "and so is *registry*: the gateway's own work before each decision, bringing its in-flight",
        "counts into the replica registry and taking the fleet the engine routes on",
        "(`ReplicaRegistry.refresh_inflight` + `routable`; each decision sends a request to the",
        "chosen replica and ends the oldest one in flight).",
        "",
        "Generated by `bench/routing_decision.py`; rerun it to refresh this page:",
        "",
        "```",
        command,
        "```",
        "",
        f"- Date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}. The CPUs may be shared with other work, so absolute",
        "  numbers are noisy; the ratio to the round-robin baseline, measured in the same loop,",
        "  is steadier.",
        f"- Redis: {redis_note}",
        f"- Workload: {args.prompt_tokens}-token prompts = {args.system_prompt_tokens}-token "
        f"system prompt (one of {args.system_prompts}) + fresh user turn; block size "
        f"{args.block_size} ({args.prompt_tokens // args.block_size} blocks per chain); index "
        f"prefilled with {args.prefill_chains} such chains, each held by 1–3 replicas; "
        f"{args.decisions} timed decisions after {args.warmup} warm-up ones.",
        "- Targets: decision p99 ≤ 1 ms with the in-memory index, ≤ 2 ms with Redis.",
        "",
        "All times in ms, p50 / p99. *Decision* = index lookup + engine, timed around",
        "`RoutingEngine.route`; *index lookup* is `BlockIndex.match` alone (the decision's",
        "`timings_ms['index']`); *engine* is decision minus lookup (filters, scorers, picker,",
        "explanations); *round-robin* is the baseline decision (no index lookup) on the same",
        "replicas; *ratio* = decision p50 / round-robin p50.",
        "",
        "| index | replicas | index blocks | hashing | registry | index lookup | engine "
        "| decision | round-robin | ratio | target (decision p99) | Redis ms / routed request |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(format_row(row) for row in rows),
        "",
    ]
    degraded = sum(row.degraded for row in rows)
    if degraded:
        lines += [f"Warning: {degraded} decisions were degraded (index unavailable).", ""]
    lines += ["## Where the time goes", ""]
    for row in rows:
        share = row.index[0] / row.decision[0] if row.decision[0] > 0 else 0.0
        lines.append(
            f"- {row.backend}, {row.replicas} replicas: the index lookup is {share:.0%} of the "
            f"decision at p50; the engine alone takes {row.engine[0]:.3f} ms p50 / "
            f"{row.engine[1]:.3f} ms p99. The index matched {row.matched_replicas:.1f} replicas "
            f"per decision, {row.matched_blocks:.0f} blocks deep on average; the policy scored "
            f"{row.scored_replicas:.1f} replicas per decision."
            + (
                f" Redis itself spent {row.server_ms:.3f} ms per lookup script (mean, "
                "`INFO commandstats`); the rest of the lookup is the round trip and the client."
                if row.server_ms is not None
                else ""
            )
        )
    lines.append("")
    missed = [row for row in rows if not row.meets_target]
    if missed:
        lines += [
            "Rows marked **no** missed the p99 target in this run. Where the lookup dominates,",
            "the cost is the index walking the matched blocks: O(matched blocks), one bitmask",
            "AND per block whatever the number of replicas holding it (with Redis, plus the",
            "round trip and the block keys built in the script); where the round-robin column",
            "is also far above its usual level, the machine was busy during the run.",
            "",
        ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.routing_decision", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--decisions", type=int, default=2_000, help="timed decisions per row")
    parser.add_argument("--warmup", type=int, default=200, help="untimed decisions first")
    parser.add_argument(
        "--replicas", type=int, nargs="+", default=[16, 64], help="fleet sizes to measure"
    )
    parser.add_argument(
        "--backends", nargs="+", choices=["memory", "redis", "mirror"],
        default=["memory", "redis"],
    )
    parser.add_argument(
        "--speculative-writes",
        action="store_true",
        help="after each decision, write the speculative entry the gateway writes (untimed), "
        "and report Redis server time per routed request over all commands",
    )
    parser.add_argument(
        "--policy",
        default=DEFAULT_PROFILE,
        help=f"built-in routing profile to time (default: {DEFAULT_PROFILE}, the gateway's)",
    )
    parser.add_argument(
        "--no-prune",
        action="store_true",
        help="score every candidate (the engine otherwise prunes past "
        f"{Pruning().above}: routing/prune.py)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=6_000)
    parser.add_argument("--system-prompt-tokens", type=int, default=4_000)
    parser.add_argument("--system-prompts", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--prefill-chains", type=int, default=1_000, help="prompts recorded in the index first"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Refuse settings that would make the benchmark meaningless, naming the setting."""
    if args.decisions < 1 or args.warmup < 0:
        raise SystemExit("--decisions must be >= 1 and --warmup >= 0")
    if any(n < 1 for n in args.replicas):
        raise SystemExit(f"--replicas must be positive (got {args.replicas})")
    if args.block_size < 1 or args.prompt_tokens < args.block_size:
        raise SystemExit("--prompt-tokens must be at least one --block-size (and that >= 1)")
    if not 0 < args.system_prompt_tokens < args.prompt_tokens:
        raise SystemExit(
            f"--system-prompt-tokens ({args.system_prompt_tokens}) must be between 1 and "
            f"--prompt-tokens ({args.prompt_tokens}) - 1"
        )
    if args.system_prompts < 1 or args.prefill_chains < 0:
        raise SystemExit("--system-prompts must be >= 1 and --prefill-chains >= 0")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    command = shlex.join([".venv/bin/python", "-m", "bench.routing_decision", *(argv or [])])
    if argv is None:
        command = shlex.join([".venv/bin/python", "-m", "bench.routing_decision", *sys.argv[1:]])
    server = None
    redis_url = None
    redis_note = "not measured"
    if "redis" in args.backends or "mirror" in args.backends:
        redis_url = os.environ.get("REDIS_URL")
        if redis_url:
            redis_note = "`REDIS_URL` (same host assumed)"
        else:
            # Same helper the tests use: a private redis-server on a free local port.
            from bench.local_redis import RedisServer

            server = RedisServer().start()
            redis_url = server.url
            redis_note = "private local `redis-server` (loopback TCP)"
    try:
        rows = asyncio.run(run_all(args, redis_url))
    finally:
        if server is not None:
            server.stop()
    report = render(rows, args, command, redis_note)
    if args.no_write:
        print(report)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        write_page(args.output, report)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
