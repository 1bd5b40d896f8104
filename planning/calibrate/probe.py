"""The engine client calibration uses: timed streaming completions and /metrics counters.

Only what vLLM itself speaks: ``POST /v1/completions`` with token-id prompts (so the prompt's
length is exact whatever the tokenizer), ``stream: true`` (the client sees every token arrive),
``ignore_eos`` (every request makes exactly ``max_tokens`` tokens), and the Prometheus text of
``/metrics`` for the prefix-cache counters, the inter-token latency histogram (the engine's own
clock for decode steps) and the cache configuration.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

__all__ = ["CacheInfo", "EngineProbe", "HistogramTotals", "ProbeError", "TimedCompletion"]

#: vLLM's inter-token latency histogram: one observation per token after a request's first,
#: stamped by the engine core when the step that made it finished.
ITL_HISTOGRAM = "vllm:inter_token_latency_seconds"


class ProbeError(RuntimeError):
    """The engine answered something calibration cannot use."""


@dataclass(frozen=True, slots=True)
class TimedCompletion:
    """One streamed completion as the client saw it (seconds on the client's monotonic clock)."""

    sent_s: float
    #: Arrival of each streamed chunk that carried tokens (a slow reader may get several
    #: tokens in one chunk, so there can be fewer chunks than tokens).
    token_s: list[float]
    #: Tokens the completion produced (``max_tokens``: the request ignores EOS).
    tokens: int

    @property
    def ttft_s(self) -> float:
        """Time to the first token."""
        return self.token_s[0] - self.sent_s

    @property
    def e2e_s(self) -> float:
        """Time to the last token."""
        return self.token_s[-1] - self.sent_s

    @property
    def mean_itl_s(self) -> float:
        """Mean gap between tokens after the first (nan with fewer than two tokens)."""
        if self.tokens < 2:
            return float("nan")
        return (self.token_s[-1] - self.token_s[0]) / (self.tokens - 1)


@dataclass(frozen=True, slots=True)
class CacheInfo:
    """What ``vllm:cache_config_info`` says about the KV cache."""

    block_size: int
    num_gpu_blocks: int


@dataclass(frozen=True, slots=True)
class HistogramTotals:
    """A histogram's ``_sum`` and ``_count`` (all label sets) at one reading."""

    total_s: float
    count: float

    def since(self, earlier: HistogramTotals) -> HistogramTotals:
        """What was observed between ``earlier`` and this reading."""
        return HistogramTotals(self.total_s - earlier.total_s, self.count - earlier.count)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_total(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in Prometheus text (all label sets)."""
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) == name:
            total += float(match.group(3))
    return total


def metric_labels(text: str, name: str) -> dict[str, str] | None:
    """The labels of the first sample of ``name``, or None if it is absent."""
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) == name:
            return dict(_LABEL.findall(match.group(2) or ""))
    return None


class EngineProbe:
    """Talks to one engine: ``engine_url`` serves the OpenAI API, ``metrics_url`` its metrics."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        engine_url: str,
        metrics_url: str | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        base = engine_url.rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.metrics_url = metrics_url or f"{self.base}/metrics"
        self.session = session
        self.clock = clock

    async def model(self) -> tuple[str, int | None]:
        """The first served model's name and its ``max_model_len`` (None if not reported)."""
        async with self.session.get(f"{self.base}/v1/models") as response:
            if response.status != 200:
                raise ProbeError(f"GET {self.base}/v1/models answered {response.status}")
            body = await response.json()
        models = body.get("data") or []
        if not models:
            raise ProbeError(f"{self.base}/v1/models lists no model")
        first = models[0]
        max_len = first.get("max_model_len")
        return str(first["id"]), int(max_len) if isinstance(max_len, int) else None

    async def metrics(self) -> str:
        """The Prometheus text of the engine's metrics."""
        async with self.session.get(self.metrics_url) as response:
            if response.status != 200:
                raise ProbeError(f"GET {self.metrics_url} answered {response.status}")
            return await response.text()

    async def prefix_hits(self) -> float:
        """``vllm:prefix_cache_hits_total`` (tokens)."""
        return metric_total(await self.metrics(), "vllm:prefix_cache_hits_total")

    async def itl_totals(self) -> HistogramTotals | None:
        """The inter-token latency histogram's totals; None if the engine exports none."""
        text = await self.metrics()
        if metric_labels(text, f"{ITL_HISTOGRAM}_count") is None:
            return None
        return HistogramTotals(
            metric_total(text, f"{ITL_HISTOGRAM}_sum"), metric_total(text, f"{ITL_HISTOGRAM}_count")
        )

    async def cache_info(self) -> CacheInfo:
        """Block size and block count from ``vllm:cache_config_info``."""
        labels = metric_labels(await self.metrics(), "vllm:cache_config_info")
        if labels is None:
            raise ProbeError(f"{self.metrics_url} has no vllm:cache_config_info")
        try:
            return CacheInfo(int(labels["block_size"]), int(labels["num_gpu_blocks"]))
        except (KeyError, ValueError) as exc:
            raise ProbeError(f"vllm:cache_config_info: unreadable labels {labels}") from exc

    async def load_adapter(self, name: str, path: str) -> float:
        """``POST /v1/load_lora_adapter``; returns the seconds until the engine answered."""
        sent = self.clock()
        body = {"lora_name": name, "lora_path": path}
        async with self.session.post(f"{self.base}/v1/load_lora_adapter", json=body) as response:
            text = await response.text()
            if response.status != 200:
                raise ProbeError(
                    f"POST /v1/load_lora_adapter ({name} from {path}) answered {response.status}: "
                    f"{text[:300]}. Start vLLM with --enable-lora (and --max-lora-rank for the "
                    "adapter) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
                )
        return self.clock() - sent

    async def unload_adapter(self, name: str) -> bool:
        """``POST /v1/unload_lora_adapter``; False if the engine did not have it loaded."""
        body = {"lora_name": name}
        async with self.session.post(f"{self.base}/v1/unload_lora_adapter", json=body) as response:
            await response.read()
            return response.status == 200

    async def complete(self, model: str, prompt: list[int], max_tokens: int) -> TimedCompletion:
        """Stream one completion of ``prompt`` (token ids); exactly ``max_tokens`` tokens."""
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        sent = self.clock()
        token_s: list[float] = []
        async with self.session.post(f"{self.base}/v1/completions", json=body) as response:
            if response.status != 200:
                text = await response.text()
                raise ProbeError(f"POST /v1/completions answered {response.status}: {text[:300]}")
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                now = self.clock()
                chunk = json.loads(payload)
                if chunk.get("choices"):
                    token_s.append(now)
        if not token_s:
            raise ProbeError("a streamed completion carried no token")
        return TimedCompletion(sent, token_s, max_tokens)
