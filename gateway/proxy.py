"""Sending a routed request to a replica and relaying the answer, streaming or not.

``send`` takes the request's ``ForwardPlan`` (``gateway/request/forward.py``) and reports every
attempt to its ``AttemptHooks`` (the request's ``AttemptRecorder``), whose ``outcome`` it fills.

Retries go to the decision's fallbacks only when a replica could not be reached at all (no byte
reached the client yet). Once the stream has started, a failure ends the stream: replaying a
generation elsewhere would duplicate tokens the client already has. A client that disconnects
cancels the handler; leaving the ``async with`` closes the upstream connection, so the engine
aborts the request instead of generating for nobody.

Before a replica is sent the request, ``AttemptHooks.prepare`` puts in place what the request
needs there (its LoRA adapter, loaded and held); a replica that cannot take it raises
``ReplicaUnsuitable`` and the next candidate is tried. An upstream 404 for a model the gateway
believed loaded (``AttemptHooks.model_missing``) is retried once on the same replica, which loads
it again first: nothing reached the client yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from aiohttp import web
from yarl import URL

from gateway import errors
from gateway.attempts import AttemptsInFlight
from gateway.breaker import CircuitBreaker
from gateway.errors import GatewayError
from gateway.request.record import AdapterLoad
from gateway.request_body import engine_request_id
from gateway.stream_end import CHAT_STREAM_END, StreamEnd
from gateway.tracing import upstream_trace_headers
from gateway.upstream_client import (
    UpstreamConnectError,
    UpstreamPayloadError,
    UpstreamPool,
    UpstreamResponse,
)
from routing.state import ReplicaState
from routing.types import ReplicaId

log = logging.getLogger(__name__)

# Failures before the response headers: the replica streamed nothing (safe to retry elsewhere).
# UpstreamConnectError and UpstreamDisconnected are ConnectionErrors.
_RETRYABLE = (ConnectionError,)

#: Answers that say the replica, not the request, failed: retried on a fallback while one is
#: left. All but 503 (overloaded, or shutting down: busy, not broken) also count against the
#: replica's circuit breaker.
_SERVER_ERRORS = frozenset({500, 502, 503, 504})
_BROKEN = _SERVER_ERRORS - {503}
# Hop-by-hop and length headers that must not be copied from the upstream response.
_DROP_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "content-encoding",
    "date",
    "server",
    "x-request-id",
}


class ReplicaUnsuitable(Exception):
    """This replica cannot take the request now (e.g. no LoRA slot); try the next candidate.

    ``reason`` labels ``fleetgate_upstream_retries``; ``error`` is what the client gets if no
    candidate is left.
    """

    def __init__(self, reason: str, error: GatewayError, unreachable: bool = False) -> None:
        super().__init__(error.message)
        self.reason = reason
        self.error = error
        #: The replica could not be reached (connection refused): down, as a refused request
        #: would say, so its circuit counts it and the answer is the fleet's, not ``error``.
        self.unreachable = unreachable


@dataclass(frozen=True, slots=True)
class ForwardPlan:
    """Everything ``send`` needs for one request, fixed before the first attempt.

    Built by ``gateway/request/forward.plan_forward`` from the request's ``RouteDecision``.
    """

    request_id: str
    #: The route's name: the label of the retry metrics.
    route: str
    #: The replica's path (``RequestKind.upstream_path``).
    upstream_path: str
    #: The JSON body to send, as is.
    payload: bytes
    #: The client asked for a stream.
    stream: bool
    #: Drop the usage-only stream chunk: the gateway asked for it, the client did not.
    hide_usage_chunk: bool
    #: The chosen replica, then its fallbacks, best first.
    candidates: tuple[ReplicaId, ...]
    #: Attempts at most (the first plus ``max_retries`` before the first byte).
    max_attempts: int
    #: Bound on each wait for the replica (the first byte, then each next chunk).
    read_timeout_s: float
    #: Bound on a streaming client leaving its answer unread (``client_stall_timeout_s``).
    client_stall_s: float | None = None
    #: Bytes any of which mark the first stream event that carries output
    #: (``RequestKind.first_token_marker``): the time to first token ends there. None: at the
    #: first event.
    first_token_marker: tuple[bytes, ...] | None = None
    #: The event that tells the client its started stream failed (``RequestKind.stream_error``);
    #: None: the OpenAI envelope as one ``data:`` event.
    stream_error: Callable[[GatewayError, bytes], bytes] | None = None
    #: How a complete stream ends (``RequestKind.stream_end``): one that ends otherwise was cut.
    stream_end: StreamEnd = CHAT_STREAM_END
    #: The gateway's own error as this API's clients parse it (``RequestKind.error_response``);
    #: None: the OpenAI envelope.
    error_response: Callable[[GatewayError, str], web.Response] | None = None


class ReplicaDirectory(Protocol):
    """The replicas ``send`` may try, each one's circuit breaker, and the attempts under way."""

    #: Where each attempt is registered while it waits, so that a replica marked down can
    #: abort the ones it holds (``gateway/attempts.py``).
    attempts: AttemptsInFlight

    def get(self, replica: ReplicaId) -> ReplicaState | None: ...

    def breaker(self, replica: ReplicaId) -> CircuitBreaker: ...


class AttemptHooks(Protocol):
    """Bookkeeping for the replica being tried (in-flight counts, replica time, calibration)."""

    #: What happened upstream; ``send`` fills it in as the attempts go.
    outcome: UpstreamOutcome

    def prepare(
        self, replica: ReplicaState, last_resort: bool
    ) -> AbstractAsyncContextManager[object]:
        """Held around one attempt; may raise ``ReplicaUnsuitable`` on entry.

        ``last_resort``: no other candidate is left after this one.
        """

    async def model_missing(self, replica: ReplicaId) -> bool:
        """The replica answered 404: True if the model should be there (retry once)."""

    def retrying(self, reason: str) -> None:
        """The next candidate is tried because of ``reason`` (a low-cardinality label)."""

    def started(self, replica: ReplicaId) -> None:
        """The request is being sent to ``replica``."""

    async def answering(self, replica: ReplicaId) -> None:
        """``replica`` answered 200 and its answer is about to be relayed: the last moment to
        record where the request was served before the client can read it (and follow up)."""

    def first_byte(self, replica: ReplicaId) -> None:
        """The first token arrived: the engine has prefilled the prompt."""

    def ended(self, replica: ReplicaId) -> None:
        """The attempt is over (answered, failed, or the client left)."""


@dataclass
class UpstreamOutcome:
    """What happened upstream, for metrics, index feedback and calibration."""

    replica: ReplicaId | None = None
    status: int = 0
    ttft_s: float | None = None
    #: Gaps between a stream's output events after the first, seconds: a read that brought k
    #: of them (a gateway that reads less often than the engine writes) adds k gaps of 1/k of
    #: the time since the previous one, so the gaps sum to the decode time and number one per
    #: event.
    gaps_s: list[float] = field(default_factory=list)
    #: Output events relayed from the first one on (not the stream's end, not a usage-only
    #: chunk): at least the tokens the client was sent (chat's role chunk counts one more).
    output_events: int = 0
    usage: Mapping[str, Any] | None = None
    sent_at: float | None = None
    finished_at: float | None = None
    client_gone: bool = False
    attempts: int = 0
    #: The client's response has started (headers sent): from then on, never a retry.
    responded: bool = False
    #: When the last bytes of its stream arrived (monotonic; None: no stream yet).
    last_byte_at: float | None = None
    #: Its stream is to end with the in-band error: its replica was marked down while the
    #: stream had been silent (``attempts.cut_stalled``).
    stall_cut: bool = False
    #: The relay is waiting for the client to take bytes: a silence upstream meanwhile is the
    #: client's doing (the gateway reads no more until it writes), not the replica's.
    writing_to_client: bool = False
    #: pool -> replica seconds charged to this request (a retry may span two pools).
    replica_seconds: dict[str, float] = field(default_factory=dict)
    #: The request's LoRA adapter as held for the latest attempt; None without one.
    adapter_load: AdapterLoad | None = None
    #: The stable error code of the gateway's own error answer (``GatewayError``), already
    #: counted in ``fleetgate_errors_total``; None for an answer relayed from the replica.
    error_code: str | None = None
    #: Settled when a watcher saw it end (a background Response): ``finished_at`` is that poll's
    #: time, not the engine's, so it times nothing.
    settled_later: bool = False

    def tpot_ms(self, completion_tokens: int, choices: int = 1) -> float | None:
        """Mean time per output token after the first, as the upstream delivered them (ms);
        None without a first token, an end, or a second token. ``choices`` answers decoded side
        by side (``n``) share ``completion_tokens``: each got its share over the same time.
        """
        completion_tokens //= max(1, choices)
        if (
            completion_tokens < 2
            or self.ttft_s is None
            or self.sent_at is None
            or not self.finished_at
        ):
            return None
        decode_s = self.finished_at - self.sent_at - self.ttft_s
        return max(0.0, decode_s) * 1000.0 / (completion_tokens - 1)


_URLS: dict[tuple[str, str], URL] = {}


def _upstream_url(base: str, path: str) -> URL:
    """``base + path`` parsed once (aiohttp would parse the string again on every request)."""
    url = _URLS.get((base, path))
    if url is None:
        if len(_URLS) > 4096:  # replicas come and go: never let the cache grow without bound
            _URLS.clear()
        url = _URLS[(base, path)] = URL(f"{base}{path}")
    return url


class _BodyUsage(msgspec.Struct):
    """The fields the gateway reads from an answer: decoding skips everything else.

    ``meta`` is where Cohere-shaped answers (vLLM's ``/v2/embed``) count their input, as
    ``meta.billed_units.input_tokens`` (and ``image_tokens``): without it, token budgets never
    settled such a request's estimate to the engine's count."""

    usage: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None


class _EventUsage(msgspec.Struct):
    """A stream event that mentions usage: the usage, and whether it carries choices too.

    The Responses API streams its usage inside the final ``response.completed`` event's
    ``response`` object instead.
    """

    usage: dict[str, Any] | None = None
    choices: list[Any] | None = None
    response: _BodyUsage | None = None


_decode_body_usage = msgspec.json.Decoder(_BodyUsage).decode
_decode_event_usage = msgspec.json.Decoder(_EventUsage).decode


def body_usage(body: bytes) -> Mapping[str, Any] | None:
    """The ``usage`` object of a JSON answer; None if it has none or is not a JSON object."""
    try:
        decoded = _decode_body_usage(body)
    except (ValueError, RecursionError):  # msgspec's DecodeError, ValidationError; too deep
        return None
    if decoded.usage is not None or decoded.meta is None:
        return decoded.usage
    return _billed_units_usage(decoded.meta)


def _billed_units_usage(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A Cohere answer's ``meta.billed_units`` as chat-shaped usage (an embedding has no output)."""
    billed = meta.get("billed_units")
    if not isinstance(billed, Mapping):
        return None
    counts = [billed.get(name) for name in ("input_tokens", "image_tokens")]
    tokens = [n for n in counts if isinstance(n, int) and not isinstance(n, bool) and n >= 0]
    if not tokens:
        return None
    return {"prompt_tokens": sum(tokens), "completion_tokens": 0, "total_tokens": sum(tokens)}


class SseRelay:
    """Splits an SSE byte stream into events and relays each as soon as it is complete.

    Only needed to see ``usage`` (and hide the usage chunk the gateway asked for on the client's
    behalf); bytes are never held back beyond the end of the event they belong to.
    """

    def __init__(self, hide_usage_chunk: bool) -> None:
        self.hide_usage_chunk = hide_usage_chunk
        self._buffer = b""
        self.usage: Mapping[str, Any] | None = None

    def feed(self, chunk: bytes) -> list[bytes]:
        """Complete events (each with its terminating blank line) to write now."""
        self._buffer += chunk
        out = []
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                break
            event, self._buffer = self._buffer[: end + 2], self._buffer[end + 2 :]
            if self._inspect(event):
                out.append(event)
        return out

    def flush(self) -> bytes:
        """Whatever is left when the upstream ends (an unterminated last event)."""
        rest, self._buffer = self._buffer, b""
        return rest

    def _inspect(self, event: bytes) -> bool:
        """Record usage; False to drop the event (the usage-only chunk the client did not want)."""
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            # Token events never mention usage: only the (rare) events that do are decoded.
            if not data.startswith(b"{") or b'"usage"' not in data:
                continue
            try:
                payload = _decode_event_usage(data)
            except (ValueError, RecursionError):
                continue
            if payload.usage is not None:
                self.usage = payload.usage
                if self.hide_usage_chunk and not payload.choices:
                    return False
            elif payload.response is not None and payload.response.usage is not None:
                self.usage = payload.response.usage
        return True


class UpstreamDiedBeforeFirstEvent(ConnectionError):
    """The replica answered 200 but failed before its first SSE event: still safe to retry."""


class UpstreamStreamCut(Exception):
    """The replica's stream ended (cleanly, as HTTP goes) before the event that ends it."""


class UpstreamDiedBeforeAnswer(ConnectionError):
    """The replica's (non-streamed) answer broke off: nothing reached the client, so retry."""


async def _first_events(resp: UpstreamResponse, relay: SseRelay) -> list[bytes]:
    """Read until the first complete SSE event (or the end of the stream).

    vLLM sends its 200 headers before the first token; the client's headers are held back until
    an event exists, so a replica that dies in between can still be retried elsewhere.
    """
    try:
        async for chunk in resp.iter_any():
            events = relay.feed(chunk)
            if events:
                return events
    except UpstreamPayloadError as exc:
        raise UpstreamDiedBeforeFirstEvent(str(exc) or type(exc).__name__) from exc
    return []


async def _relay_stream(
    request: web.Request,
    resp: UpstreamResponse,
    outcome: UpstreamOutcome,
    request_id: str,
    hide_usage_chunk: bool,
    hooks: AttemptHooks,
    first_token_marker: tuple[bytes, ...] | None = None,
    stream_error: Callable[[GatewayError, bytes], bytes] | None = None,
    end: StreamEnd = CHAT_STREAM_END,
    answered: Callable[[], None] | None = None,
    client_stall_s: float | None = None,
) -> web.StreamResponse:
    sse = SseRelay(hide_usage_chunk)
    first = await _first_events(resp, sse)  # raises before any byte reached the client
    if not first:  # ended (cleanly) without a single event: nothing reached the client yet
        raise UpstreamDiedBeforeFirstEvent("the stream ended before its first event")
    if answered is not None:
        answered()  # an event, not just the headers (vLLM sends those before it works)
    out = web.StreamResponse(status=resp.status)
    out.content_type = "text/event-stream"
    out.headers["Cache-Control"] = "no-cache"
    out.headers["X-Request-Id"] = request_id
    last: float | None = None
    ended = False  # the stream's own last event (or an error event of the engine's) was relayed
    engine_failed = False  # ... an error event of the engine's

    last_event = b""  # the last event relayed (the in-band error numbers itself after it)

    def ends(event: bytes) -> bool:
        nonlocal engine_failed
        seen = end.classify(event)
        engine_failed = engine_failed or seen == "error"
        return seen is not None

    async def relay(event: bytes) -> None:
        nonlocal ended, last_event
        ended = ended or ends(event)
        outcome.writing_to_client = True
        try:
            await _write_unless_stalled(out, event, request.transport, client_stall_s)
        finally:
            outcome.writing_to_client = False
        last_event = event

    async def upstream_events() -> AsyncIterator[list[bytes]]:
        yield first
        async for chunk in resp.iter_any():
            events = sse.feed(chunk)
            if events:
                yield events

    async def fail_in_band(why: str) -> bool:
        """Tell the client in-band that its stream failed upstream; False if it left."""
        log.warning(
            "upstream %s failed mid-stream on request %s: %s", outcome.replica, request_id, why
        )
        outcome.status = 502
        error = GatewayError(502, errors.UPSTREAM_ERROR, "upstream failed mid-stream")
        if stream_error is not None:
            event = stream_error(error, last_event)
        else:
            event = b"data: " + json.dumps(error.envelope()).encode() + b"\n\n"
        return await _write_to_client(out, event, outcome, resp)

    try:
        await out.prepare(request)
        outcome.responded = True
        outcome.last_byte_at = time.monotonic()
        async for events in upstream_events():
            now = outcome.last_byte_at = time.monotonic()
            if (
                last is None
                and first_token_marker is not None
                and not any(marker in event for event in events for marker in first_token_marker)
            ):
                for event in events:  # before any output (response.created): not yet TTFT
                    await relay(event)
                continue
            tokens = _output_events(events, end)
            outcome.output_events += tokens
            if last is None:
                outcome.ttft_s = now - (outcome.sent_at or now)
                if outcome.replica is not None:
                    hooks.first_byte(outcome.replica)
                last = now
            elif tokens:  # not a read of the end alone: the time to it is no token's
                outcome.gaps_s.extend([(now - last) / tokens] * tokens)
                last = now
            for event in events:
                await relay(event)
        tail = sse.flush()
        if tail and (ended or ends(tail)):
            await out.write(tail)  # the last event, its blank line lost on the way
        elif not ended:
            # The body ended properly but the stream did not (an ingress's idle timeout, an
            # engine going down gracefully): a client would take the partial answer as whole.
            raise UpstreamStreamCut(f"ended without its last event ({len(tail)} bytes left over)")
    except (UpstreamPayloadError, TimeoutError, UpstreamStreamCut) as exc:
        # Bytes already reached the client: no retry. Tell it in-band, then end the stream.
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if not await fail_in_band(why):
            return out
    except ConnectionError:
        # The client went away (a write failed; aiohttp raises ConnectionResetError or its
        # ClientConnectionResetError): close the upstream connection so the engine aborts the
        # request instead of generating for nobody. Never a retry: the client has bytes.
        outcome.client_gone = True
        resp.close()
        return out
    except ClientStalled:
        # The client left its answer unread for client_stall_timeout_s, its connection open:
        # as one that went away (the engine aborts), and its connection is closed.
        log.info(
            "client of request %s read nothing for %s s (client_stall_timeout_s); dropped",
            request_id,
            client_stall_s,
        )
        outcome.client_gone = True
        resp.close()
        if request.transport is not None:
            request.transport.abort()
        return out
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if outcome.stall_cut and task is not None and task.uncancel() == 0:
            # Its replica was marked down while this stream had gone silent (and the client
            # is still here: no other cancellation pending): end it in-band now rather than
            # after upstream_timeout_s.
            resp.close()
            if not await fail_in_band("silent on a replica marked down"):
                return out
        else:
            # aiohttp cancelled the handler because the client disconnected: as above, unwind.
            outcome.client_gone = True
            resp.close()
            raise
    outcome.usage = sse.usage
    if engine_failed:  # relayed as it came; an engine failure all the same
        log.info("replica %s failed request %s in its stream", outcome.replica, request_id)
        outcome.status = 502
    try:
        await out.write_eof()
    except ConnectionError:
        outcome.client_gone = True  # the answer is complete upstream; the client left
    return out


def _output_events(events: list[bytes], end: StreamEnd) -> int:
    """How many of ``events`` carry output: not the stream's end (or an engine's error event),
    not a chunk of usage alone."""
    return sum(
        1
        for event in events
        if end.classify(event) is None
        and not (b'"usage"' in event and (b'"choices":[]' in event or b'"choices": []' in event))
    )


class ClientStalled(Exception):
    """A streaming client left its answer unread past ``client_stall_timeout_s``."""


#: Bytes waiting in a client's transport past which a write may have to wait for the client
#: (aiohttp drains past 64 KiB): from here on, each write is bounded by the stall timeout. A
#: client reading along keeps this near zero, and its writes pay no timer.
_BEHIND_BYTES = 16 * 1024


async def _write_unless_stalled(
    out: web.StreamResponse,
    data: bytes,
    transport: asyncio.BaseTransport | None,
    stall_s: float | None,
) -> None:
    """Write ``data`` to the client; ``ClientStalled`` if it reads none of it within
    ``stall_s`` while behind (``_BEHIND_BYTES`` unread)."""
    behind = (
        stall_s is not None
        and isinstance(transport, asyncio.WriteTransport)
        and transport.get_write_buffer_size() + len(data) > _BEHIND_BYTES
    )
    if not behind:
        await out.write(data)
        return
    try:
        async with asyncio.timeout(stall_s):
            await out.write(data)
    except TimeoutError:
        raise ClientStalled from None


async def _write_to_client(
    out: web.StreamResponse, data: bytes, outcome: UpstreamOutcome, resp: UpstreamResponse
) -> bool:
    """Write to a client that may have left; False (and the upstream closed) if it has."""
    try:
        await out.write(data)
    except ConnectionError:
        outcome.client_gone = True
        resp.close()
        return False
    return True


async def _relay_body(
    resp: UpstreamResponse,
    outcome: UpstreamOutcome,
    request_id: str,
    read: bytes | None = None,
    error_response: Callable[[GatewayError, str], web.Response] | None = None,
) -> web.Response:
    """The upstream's whole answer as the client's (``read``: its body, read already)."""
    try:
        body = await resp.read() if read is None else read
    except UpstreamPayloadError as exc:
        raise UpstreamDiedBeforeAnswer(str(exc)) from exc
    outcome.ttft_s = None
    if resp.status == 200:
        outcome.usage = body_usage(body)
    elif resp.status >= 400 and not _is_json_object(body):
        # An ingress or sidecar in front of the engine answered (an HTML 502 page, a plain
        # "upstream connect error"): clients parse errors as the envelope, so wrap it in one.
        retry_after = {k: v for k, v in resp.headers if k.lower() == "retry-after"}
        error = GatewayError(
            resp.status, errors.UPSTREAM_ERROR,
            f"The replica answered {resp.status} with a body that is not JSON: "
            f"{_snippet(body)}",
            headers=retry_after,
        )
        return error_response(error, request_id) if error_response else error.response(request_id)
    headers = {k: v for k, v in resp.headers if k.lower() not in _DROP_HEADERS}
    headers["X-Request-Id"] = request_id
    return web.Response(status=resp.status, body=body, headers=headers)


def _is_json_object(body: bytes) -> bool:
    try:
        return isinstance(json.loads(body), dict)
    except (ValueError, RecursionError):
        return False


def _snippet(body: bytes, limit: int = 200) -> str:
    """The start of a body as one printable line (tags and whitespace runs kept as they are)."""
    text = body[: limit * 4].decode("utf-8", errors="replace")
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text[:limit] + ("..." if len(text) > limit else "") if text else "(empty)"


async def send(
    request: web.Request,
    plan: ForwardPlan,
    hooks: AttemptHooks,
    upstream: UpstreamPool,
    replicas: ReplicaDirectory,
) -> web.StreamResponse:
    """Send ``plan`` to its first reachable candidate and relay the answer; 503/504 otherwise.

    ``hooks`` keep in-flight counts and replica-time accounting for exactly the replica that is
    being tried, and ``hooks.outcome`` records what happened.
    """
    outcome = hooks.outcome
    request_id = plan.request_id
    # read_timeout_s bounds each wait for the replica (the first byte, then each next chunk),
    # never the whole response: a long stream that keeps producing is never cut.
    read_timeout_s = plan.read_timeout_s
    headers = {"Content-Type": "application/json", "X-Request-Id": engine_request_id(request_id),
               **upstream_trace_headers(request.headers)}
    max_attempts = plan.max_attempts
    tried = 0
    queue = list(plan.candidates)
    retried_missing: set[ReplicaId] = set()
    #: Candidates that failed this request before answering it (a connection, a drop, a 5xx)
    #: or could not be tried (an open circuit).
    failed: list[ReplicaId] = []
    unsuitable: ReplicaUnsuitable | None = None
    #: Why the previous attempt failed before answering (the retry's metric label), or None.
    retry_reason: str | None = None

    def can_retry() -> bool:
        """Another candidate could take the request if the current attempt ended now."""
        return tried < max_attempts and _any_usable(replicas, queue)

    while queue and tried < max_attempts:
        replica_id = queue.pop(0)
        replica = replicas.get(replica_id)
        if replica is None:
            continue
        breaker = replicas.breaker(replica_id)
        if not breaker.allows():
            failed.append(replica_id)  # a candidate that cannot take it just now
            continue
        last_resort = tried + 1 >= max_attempts or not _any_usable(replicas, queue)
        if retry_reason is not None:  # the previous candidate failed before answering: a retry
            hooks.retrying(retry_reason)
            retry_reason = None
        async with contextlib.AsyncExitStack() as held:
            try:
                await held.enter_async_context(hooks.prepare(replica, last_resort))
            except ReplicaUnsuitable as exc:
                # The reason is counted if another candidate is tried.
                if exc.unreachable:  # down: counted on its circuit, the answer is the 503 below
                    breaker.failure(health_clears=True)
                    retry_reason, unsuitable = "connect_failed", None
                else:
                    retry_reason, unsuitable = exc.reason, exc
                continue
            unsuitable = None
            tried += 1
            breaker.begin()
            outcome.replica = replica_id
            outcome.attempts = tried
            outcome.sent_at = time.monotonic()
            hooks.started(replica_id)
            attempt = replicas.attempts.begin(request_id, replica_id, outcome, can_retry)
            try:
                async with upstream.post(
                    _upstream_url(replica.url, plan.upstream_path),
                    plan.payload,
                    headers,
                    read_timeout_s=read_timeout_s,
                ) as resp:
                    outcome.status = resp.status
                    if resp.status in _BROKEN:
                        breaker.failure()
                    elif resp.status != 200:
                        breaker.success()  # a 503 is busy or draining, not broken
                    # A 200 counts once its first event or its body came: vLLM sends a
                    # stream's headers before it works, so a wedged engine answers them too.
                    if resp.status in _SERVER_ERRORS and can_retry():
                        # The engine failed the request before answering it (vLLM's 500 once
                        # its engine core died, an overloaded or draining one's 503, a proxy's
                        # 502/504): another replica may serve it. With none left, the error is
                        # relayed.
                        retry_reason = "upstream_5xx"
                        failed.append(replica_id)
                        log.info(
                            "replica %s answered %d; trying a fallback", replica_id, resp.status
                        )
                        continue
                    not_found: bytes | None = None
                    if resp.status == 404 and replica_id not in retried_missing:
                        not_found = await resp.read()  # small: kept to relay if not ours
                    longer = (
                        _longer_contexts(replicas, queue if can_retry() else [], replica)
                        if resp.status == 400
                        else []
                    )
                    if longer or (
                        resp.status == 400 and _longer_contexts(replicas, failed, replica)
                    ):
                        not_found = await resp.read()  # an error: small, relayed if not this
                        if _names_context_length(not_found):
                            # Routing sends a request only where it fits, but its prompt count
                            # may be the gateway's estimate: a replica with a longer context
                            # takes it, where one is left. Where the only longer ones failed
                            # just now, it fits the fleet, only not at the moment: the 503
                            # below, not this 400, which clients take as final.
                            queue[:] = longer
                            retry_reason = "context_length" if longer else None
                            log.info(
                                "replica %s's context is too short for the request; %s",
                                replica_id,
                                "trying one with a longer context" if longer
                                else "those with a longer context failed just now",
                            )
                            continue
                    if (
                        resp.status == 404
                        and not_found is not None
                        and _names_a_missing_model(not_found)
                        and await hooks.model_missing(replica_id)
                    ):
                        # The engine lost an adapter we believed loaded (it restarted, or an
                        # operator unloaded it): load it again on the same replica and retry.
                        retried_missing.add(replica_id)
                        queue.insert(0, replica_id)
                        tried -= 1  # the retry replaces this attempt
                        hooks.retrying("adapter_missing")
                        continue
                    if resp.status == 200:
                        await hooks.answering(replica_id)
                    if resp.status == 200 and plan.stream and _is_event_stream(resp):
                        result = await _relay_stream(
                            request, resp, outcome, request_id, plan.hide_usage_chunk, hooks,
                            plan.first_token_marker, plan.stream_error,
                            plan.stream_end, breaker.success, plan.client_stall_s,
                        )
                    else:
                        result = await _relay_body(
                            resp, outcome, request_id, not_found, plan.error_response
                        )
                        hooks.first_byte(replica_id)
                        if resp.status == 200:
                            breaker.success()
                    outcome.finished_at = time.monotonic()
                    return result
            except _RETRYABLE as exc:
                if outcome.responded:
                    raise  # bytes reached the client: the request is never replayed elsewhere
                # Refused opens the circuit at once only while another replica can take the
                # traffic: a lone replica's open circuit answered 503 for up to a health-poll
                # period after its engine was back (the diff review).
                refused = isinstance(exc, UpstreamConnectError) and exc.refused
                breaker.failure(health_clears=True, refused=refused and not last_resort)
                if isinstance(exc, UpstreamConnectError):
                    retry_reason = "connect_failed"  # it never saw the request
                    failed.append(replica_id)
                    log.info("replica %s unreachable (%s); trying a fallback", replica_id, exc)
                else:
                    retry_reason = "upstream_dropped"  # it dropped it before answering
                    failed.append(replica_id)
                    log.info(
                        "replica %s dropped the request (%s); trying a fallback", replica_id, exc
                    )
                continue
            except TimeoutError:
                breaker.failure()
                log.warning(
                    "replica %s did not answer request %s within %s s (upstream_timeout_s)",
                    replica_id, request_id, read_timeout_s,
                )
                raise GatewayError(
                    504, errors.UPSTREAM_TIMEOUT, "The upstream replica did not answer in time."
                ) from None
            except asyncio.CancelledError:
                # The health loop marked the replica down (it hangs) while this attempt waited
                # for its answer: nothing reached the client, so a fallback takes it. Unless
                # the client left as well (a second cancellation is pending): then unwind.
                task = asyncio.current_task()
                if not attempt.aborted or outcome.responded or task is None or task.uncancel():
                    raise
                breaker.failure(health_clears=True)
                retry_reason = "replica_down"
                failed.append(replica_id)
                log.warning("replica %s marked down holding the request; retrying", replica_id)
                continue
            finally:
                replicas.attempts.end(attempt)
                hooks.ended(replica_id)
    if unsuitable is not None:
        raise unsuitable.error
    raise GatewayError(
        503,
        errors.NO_HEALTHY_REPLICA,
        "No healthy replica could take the request.",
        headers={"Retry-After": "1"},
    )


def _names_a_missing_model(body: bytes) -> bool:
    """True for vLLM's answer to a model (or adapter) it does not serve ("The model `x` does
    not exist."): only that 404 means an adapter was lost. A 404 for a path the engine lacks,
    or a stored response it no longer has, is relayed as it is."""
    return b"does not exist" in body and b"model" in body.lower()


def _names_context_length(body: bytes) -> bool:
    """True for vLLM's refusal of a prompt (plus ``max_tokens``) over its ``--max-model-len``
    ("This model's maximum context length is N tokens. However, ...")."""
    return b"maximum context length" in body


def _longer_contexts(
    replicas: ReplicaDirectory, candidates: Sequence[ReplicaId], tried: ReplicaState
) -> list[ReplicaId]:
    """Those of ``candidates`` whose context is longer than ``tried``'s, or not known, in order;
    none when ``tried``'s is not known (nothing says another would fit better)."""
    if tried.max_model_len is None:
        return []
    longer = []
    for replica_id in candidates:
        state = replicas.get(replica_id)
        if state is not None and (state.max_model_len or math.inf) > tried.max_model_len:
            longer.append(replica_id)
    return longer


def _any_usable(replicas: ReplicaDirectory, candidates: Sequence[ReplicaId]) -> bool:
    """True if any of ``candidates`` is known and its circuit lets a request through."""
    for replica_id in candidates:
        if replicas.get(replica_id) is not None and replicas.breaker(replica_id).allows():
            return True
    return False


def _is_event_stream(resp: UpstreamResponse) -> bool:
    """The engine answered with events (a JSON body asked for as a stream is relayed whole)."""
    for name, value in resp.headers:
        if name.lower() == "content-type":
            return value.split(";", 1)[0].strip().lower() == "text/event-stream"
    return False
