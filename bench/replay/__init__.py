"""``fleetgate bench replay``: replay a trace against any OpenAI-compatible endpoint.

Prompts are synthesised from the trace's hash ids (equal ids give equal text), sent on the
trace's schedule with bounded concurrency, and measured client-side (TTFT, ITL, throughput);
replicas' own prefix-cache counters are read from their ``/metrics`` when given.
See ``docs/replay.md``.
"""

from bench.replay.prompts import PromptText
from bench.replay.runner import EndpointProblem, ReplayConfig, ReplayResult, replay

__all__ = ["EndpointProblem", "PromptText", "ReplayConfig", "ReplayResult", "replay"]
