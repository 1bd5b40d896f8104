"""Send a trace's requests on its schedule, bounded in concurrency, and collect the results."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from bench.replay.client import RequestResult, stream_completion
from bench.replay.prompts import PromptText
from bench.replay.server_metrics import CacheCounters, scrape_all
from routing.redis_clients import redacted
from traces.format import TraceRecord

__all__ = ["ReplayConfig", "ReplayResult", "replay", "replay_async"]


@dataclass(frozen=True)
class ReplayConfig:
    """Where to send the trace and how."""

    url: str
    model: str
    api_key: str | None = None
    trace_block_size: int = 512
    #: Multiplies every trace timestamp: 0.5 replays twice as fast, 0 sends everything at once.
    time_scale: float = 1.0
    concurrency: int = 64
    limit: int | None = None
    metrics_urls: tuple[str, ...] = ()
    #: Ask the engine to generate exactly ``output_length`` tokens (vLLM's ``ignore_eos``).
    ignore_eos: bool = True
    request_timeout_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.time_scale >= 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"time_scale: must be >= 0 (got {self.time_scale!r})")
        if self.concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1 (got {self.concurrency})")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit: must be >= 1 (got {self.limit})")

    @property
    def completions_url(self) -> str:
        """``…/v1/completions`` whether ``url`` ends in ``/v1`` or not."""
        base = self.url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        return base + "/completions"


@dataclass
class ReplayResult:
    """Everything a replay measured."""

    results: list[RequestResult]
    wall_s: float
    #: Per metrics URL: counter deltas over the replay, or why they could not be read.
    server_cache: dict[str, CacheCounters | str] = field(default_factory=dict)
    #: The signal that stopped the replay early (``SIGINT``, ``SIGTERM``); ``results`` then hold
    #: the requests that had finished, of ``planned``.
    interrupted: str | None = None
    #: Requests the replay was to send.
    planned: int = 0


def _body(config: ReplayConfig, record: TraceRecord, prompt: str) -> dict[str, object]:
    body: dict[str, object] = {
        # vLLM names a LoRA adapter in ``model``; the trace's adapter wins over --model.
        "model": record.adapter or config.model,
        "prompt": prompt,
        "max_tokens": record.output_length,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


class EndpointProblem(ValueError):
    """The endpoint cannot serve the replay at all: unreachable, or not serving the model."""


async def _preflight(
    session: aiohttp.ClientSession, config: ReplayConfig, headers: Mapping[str, str]
) -> None:
    """Ask ``…/v1/models`` once before sending the trace: a dead URL or a wrong model failed
    every request of it, the whole trace's length later (the CLI review). An endpoint without
    the listing (a bare engine behind another path) is replayed anyway."""
    models_url = config.completions_url.removesuffix("/completions") + "/models"
    try:
        async with session.get(
            models_url, headers=headers, timeout=aiohttp.ClientTimeout(total=10)
        ) as resp:
            if resp.status != 200:
                return
            listing = await resp.json(content_type=None)
    except (aiohttp.ClientConnectionError, TimeoutError) as exc:
        message = f"cannot reach {models_url}: {exc}"
        raise EndpointProblem(message.replace(models_url, redacted(models_url))) from exc
    except (aiohttp.ClientError, ValueError):
        return  # answered, but not with a listing: let the requests tell
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return
    served = sorted(str(m.get("id")) for m in data if isinstance(m, dict))
    if config.model not in served:
        raise EndpointProblem(
            f"{redacted(models_url)} does not serve the model {config.model!r}; it serves: "
            f"{', '.join(served) or 'none'} (pass one with --model)"
        )


def _stop_on_signals(stopped: list[str]) -> Callable[[], None]:
    """Make SIGINT and SIGTERM cancel the running replay (the first one's name goes into
    ``stopped``), so that what finished is still reported; returns the undo."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def stop(name: str) -> None:
        if stopped:  # a second signal: whatever hangs the stop, the user wants out now
            sys.stderr.write(f"stopped at once ({name} again): nothing reported\n")
            os._exit(130 if name == "SIGINT" else 143)
        stopped.append(name)
        task.cancel()

    installed = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(signum, stop, signum.name)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            continue
        installed.append(signum)

    def undo() -> None:
        for signum in installed:
            loop.remove_signal_handler(signum)

    return undo


async def _run(
    config: ReplayConfig,
    records: Sequence[TraceRecord],
    on_done: Callable[[], None] | None,
    handle_signals: bool = False,
) -> ReplayResult:
    stopped: list[str] = []
    progress = _Progress()
    undo = _stop_on_signals(stopped) if handle_signals else None
    try:
        return await _replay(config, records, on_done, progress)
    except asyncio.CancelledError:
        if not stopped:
            raise  # cancelled by the caller, not by a signal
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()  # handled: what finished is reported
        # Whatever the phase (the models check, the requests, the counters read after them):
        # the replicas' counters are not read again (the user wants out).
        end = progress.end if progress.end is not None else time.monotonic()
        wall_s = end - progress.start if progress.start is not None else 0.0
        results = sorted(progress.finished, key=lambda r: r.index)
        return ReplayResult(results, wall_s, {}, stopped[0], len(records))
    finally:
        if undo is not None:
            undo()


@dataclass
class _Progress:
    """What a replay has done so far, kept where a stop signal can still report it."""

    finished: list[RequestResult] = field(default_factory=list)
    #: When the first request was due (monotonic); None before the requests began.
    start: float | None = None
    #: When the last request ended (a stop while the counters are read after is not run time).
    end: float | None = None


async def _replay(
    config: ReplayConfig,
    records: Sequence[TraceRecord],
    on_done: Callable[[], None] | None,
    progress: _Progress,
) -> ReplayResult:
    texts = PromptText(config.trace_block_size, config.seed)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    gate = asyncio.Semaphore(config.concurrency)
    connector = aiohttp.TCPConnector(limit=config.concurrency + len(config.metrics_urls) + 1)
    async with aiohttp.ClientSession(connector=connector) as session:
        await _preflight(session, config, headers)
        before = await scrape_all(session, config.metrics_urls)
        start = progress.start = time.monotonic()
        origin_ms = records[0].timestamp if records else 0
        finished = progress.finished

        async def one(index: int, record: TraceRecord) -> RequestResult:
            due = start + (record.timestamp - origin_ms) / 1000.0 * config.time_scale
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                # Prompt text is made here, not up front: a long trace's prompts would not fit.
                prompt = texts.prompt(record.hash_ids, record.input_length)
                result = RequestResult(index, start_lag_s=max(0.0, time.monotonic() - due))
                try:
                    await stream_completion(
                        session,
                        config.completions_url,
                        _body(config, record, prompt),
                        headers,
                        result,
                        config.request_timeout_s,
                    )
                except Exception as exc:  # one request's failure (a defect here), not the replay's
                    result.error = f"{type(exc).__name__}: {exc}"
            finished.append(result)
            if on_done is not None:
                on_done()
            return result

        await asyncio.gather(*(one(i, r) for i, r in enumerate(records)))
        progress.end = time.monotonic()
        wall_s = progress.end - start
        after = await scrape_all(session, config.metrics_urls)
    server_cache: dict[str, CacheCounters | str] = {}
    for url, first, last in zip(config.metrics_urls, before, after, strict=True):
        if isinstance(first, CacheCounters) and isinstance(last, CacheCounters):
            server_cache[url] = last - first
        else:
            server_cache[url] = first if isinstance(first, str) else str(last)
    results = sorted(finished, key=lambda r: r.index)
    return ReplayResult(results, wall_s, server_cache, None, len(records))


def replay(
    config: ReplayConfig, records: Sequence[TraceRecord], *, progress: bool = False
) -> ReplayResult:
    """Replay ``records`` (the first ``config.limit``) against ``config.url``; blocks until done."""
    chosen = list(records[: config.limit] if config.limit is not None else records)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(chosen), unit="req", leave=False)
    try:
        return asyncio.run(
            _run(config, chosen, bar.update if bar is not None else None, handle_signals=True)
        )
    finally:
        if bar is not None:
            bar.close()


async def replay_async(config: ReplayConfig, records: Sequence[TraceRecord]) -> ReplayResult:
    """``replay`` for callers already inside an event loop (tests, embedding)."""
    chosen = list(records[: config.limit] if config.limit is not None else records)
    return await _run(config, chosen, None)
