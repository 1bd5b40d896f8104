"""The replicas' own prefix-cache counters, read from their Prometheus ``/metrics``.

Only two counters matter here, summed over every label set (a replica exports one per model or
engine): ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``, both in tokens.
Their deltas over a replay give the server-side prefix hit rate, independent of what the client
believes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

__all__ = ["CacheCounters", "parse_cache_counters", "scrape_all"]

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"


@dataclass(frozen=True)
class CacheCounters:
    """Prefix-cache counters of one replica at one moment (tokens)."""

    queries: float
    hits: float

    def __sub__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(self.queries - other.queries, self.hits - other.hits)


def parse_cache_counters(text: str) -> CacheCounters:
    """Sum the two counters over all label sets in a Prometheus text exposition."""
    totals = {QUERIES: 0.0, HITS: 0.0}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name in totals:
            # The value follows the label set (or the name); a timestamp may follow it.
            rest = line[line.rfind("}") + 1 :] if "{" in line else line[name_end:]
            fields = rest.split()
            if fields:
                totals[name] += float(fields[0])
    return CacheCounters(totals[QUERIES], totals[HITS])


async def scrape_all(
    session: aiohttp.ClientSession, urls: Sequence[str], timeout_s: float = 10.0
) -> list[CacheCounters | str]:
    """Each URL's counters, or an error message for a URL that could not be read."""
    results: list[CacheCounters | str] = []
    for url in urls:
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with session.get(url, timeout=timeout) as response:
                if response.status != 200:
                    results.append(f"HTTP {response.status}")
                    continue
                results.append(parse_cache_counters(await response.text()))
        except (aiohttp.ClientError, TimeoutError) as exc:
            results.append(f"{type(exc).__name__}: {exc}")
    return results
