"""A replica's request path in virtual time: the API server (and a gateway in front) as one server.

Between a client and the engine core sits Python that does work per request (parse, tokenise,
route, hand to the engine core) and per streamed token (detokenise, serialise, write the SSE
event, relay it). On a lone request that work is a constant, ``request_overhead_s``; under
concurrency it queues: a burst of 48 requests on a CPU engine waited ~0.5 s for the API server
and the gateway while vLLM's own queue-time counter said 3 ms.

So the path is one first-come-first-served server with two kinds of job:

* **admission** (``request_work_s``): the request reaches the engine when its job is done,
  plus the plain latency of the hop (whatever of ``request_overhead_s`` is not work);
* **delivery** of a step's tokens (``stream_token_s`` per token): the client sees a token when
  the job that carries it is done.

A lone request's TTFT is then ``request_overhead_s`` + its prefill step, as calibrated; a burst
pays for everyone's tokens in turn. Jobs arrive in time order (the caller's event loop), so
``free_at`` alone is the whole queue.
"""

from __future__ import annotations

from dataclasses import dataclass

from replica.sim.step_time import StepTimeModel

__all__ = ["RequestPath"]


@dataclass(slots=True)
class RequestPath:
    """One FCFS server: admissions and token deliveries, each a job of known work."""

    request_work_s: float
    stream_token_s: float
    #: Latency every admission adds after its work (the hop itself; not exclusive).
    hop_s: float
    #: When the server finishes the last job it was given.
    free_at: float = 0.0

    @classmethod
    def of(cls, step_time: StepTimeModel | None) -> RequestPath | None:
        """The path a calibrated profile describes; None when it has none (the roofline
        profiles: requests reach the engine at once and tokens the client at once)."""
        if step_time is None:
            return None
        work, token = step_time.request_work_s, step_time.stream_token_s
        if step_time.request_overhead_s == 0 and work == 0 and token == 0:
            return None
        # A lone request pays: admission work, the hop, its prefill, one token's delivery.
        hop = max(0.0, step_time.request_overhead_s - work - token)
        return cls(work, token, hop)

    def _serve(self, now: float, work_s: float) -> float:
        self.free_at = max(now, self.free_at) + work_s
        return self.free_at

    def admit(self, now: float) -> float:
        """A request arrives at ``now``: when the engine receives it."""
        return self._serve(now, self.request_work_s) + self.hop_s

    def deliver(self, now: float, tokens: int) -> float:
        """A step ending at ``now`` made ``tokens`` tokens: when the client has them."""
        return self._serve(now, self.stream_token_s * tokens)
