"""The contracts between routing layers: tokenizers, the block index, and policy plugins.

The engine (``routing/engine``) imports only this module and ``routing/state``; every policy is a
small module that implements one of these protocols and registers itself by name in
``routing/policies/registry.py``. The gateway, the fleet simulator and tests all drive routing
through these same types.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from routing.state import ReplicaState
from routing.types import BlockHash, Epoch, ReplicaId

# --------------------------------------------------------------------------- tokenization


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt ready for hashing: token ids, or characters in approximate (text) mode."""

    token_ids: Sequence[int] | None
    #: Set in text mode, where blocks are made of characters rather than tokens.
    text: str | None = None

    @property
    def length(self) -> int:
        """Prompt length in tokens (or characters in text mode)."""
        if self.token_ids is not None:
            return len(self.token_ids)
        return len(self.text or "")


@runtime_checkable
class PromptTokenizer(Protocol):
    """Turns an OpenAI request body into what vLLM would tokenize."""

    async def tokenize_completion(self, model: str, prompt: str) -> TokenizedPrompt:
        """Tokenize a ``/v1/completions`` prompt exactly as vLLM would."""
        ...

    async def tokenize_chat(
        self, model: str, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any
    ) -> TokenizedPrompt:
        """Render the chat template over ``messages`` and tokenize, exactly as vLLM would."""
        ...


# --------------------------------------------------------------------------- block index


@dataclass(frozen=True)
class IndexStats:
    """Size and health of a block index, for the admin API and metrics."""

    backend: str
    entries: int
    replicas: int
    max_entries: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


class IndexUnavailable(RuntimeError):
    """The index could not answer (Redis down, timeout); callers degrade to load-only routing."""


class IndexLost(IndexUnavailable):
    """Redis no longer knows a replica's epoch (flushed, or restarted without persistence): a
    confirmed write landed, but everything written before it is gone. The writer must declare a
    new epoch and re-record what its engine holds (the agent's resync)."""


@runtime_checkable
class BlockIndex(Protocol):
    """Which replicas hold which prefix blocks.

    Entries are keyed by fleetgate's chained ``BlockHash``; each carries the replica's epoch. Only
    entries whose epoch is the replica's *current* epoch match, so retiring an epoch hides all of
    that incarnation's entries at once, without scanning.
    """

    async def set_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        """Declare ``epoch`` the live incarnation of ``replica``; entries of other epochs die."""
        ...

    async def retire_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        """Retire ``epoch`` (restart, ``AllBlocksCleared``, event gap): its entries never match."""
        ...

    async def record(
        self,
        replica: ReplicaId,
        epoch: Epoch,
        blocks: Sequence[BlockHash],
        ttl_s: float | None = None,
    ) -> None:
        """Record that ``replica`` at ``epoch`` holds ``blocks``.

        ``ttl_s`` marks a speculative entry (the gateway's own routing decision) that expires unless
        an engine event confirms it; ``None`` is an engine-confirmed entry.
        """
        ...

    async def remove(self, replica: ReplicaId, epoch: Epoch, blocks: Sequence[BlockHash]) -> None:
        """Forget that ``replica`` holds ``blocks`` (``BlockRemoved``)."""
        ...

    async def match(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        """Longest cached prefix of ``chain`` per replica, in blocks; replicas with 0 omitted.

        Raises ``IndexUnavailable`` when the backend cannot answer.
        """
        ...

    async def heartbeat(self, replica: ReplicaId, ttl_s: float) -> None:
        """Keep ``replica``'s entries alive for ``ttl_s`` more seconds."""
        ...

    async def stats(self) -> IndexStats:
        """Size and health figures."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


@runtime_checkable
class InProcessLookup(Protocol):
    """A ``BlockIndex`` whose lookups never wait (the memory index, the mirror): the engine calls
    ``match_now`` directly, with no coroutine or timer."""

    def match_now(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]: ...


@runtime_checkable
class EpochAwareHeartbeat(Protocol):
    """An index that can tell a heartbeating agent that it lost the agent's epoch (Redis flushed
    or restarted empty): the agent then declares a new epoch and re-records its blocks."""

    async def heartbeat_known(self, replica: ReplicaId, ttl_s: float) -> bool: ...


def in_process_match(
    index: object,
) -> Callable[[Sequence[BlockHash]], dict[ReplicaId, int]] | None:
    """``index.match_now`` when lookups on ``index`` never wait, else ``None`` (checked once).

    Only when the class that defines ``match_now`` also defines the ``match`` in use: a subclass
    that overrides the async ``match`` (tests do, to fail or count calls) must be called there.
    """
    if not isinstance(index, InProcessLookup):
        return None
    mro = type(index).__mro__
    match_owner = next((k for k in mro if "match" in k.__dict__), None)
    match_now_owner = next((k for k in mro if "match_now" in k.__dict__), None)
    return index.match_now if match_owner is match_now_owner else None


# --------------------------------------------------------------------------- routing requests


@dataclass(frozen=True)
class CandidatesSummary:
    """Fleet-wide figures of a decision's candidates, taken before pruning."""

    #: Candidates that survived the filters.
    count: int
    #: Their mean ``ReplicaState.load``.
    mean_load: float
    #: Their mean ``ReplicaState.queued``.
    mean_queued: float


@dataclass
class RoutingRequest:
    """Everything a policy may read about one request. No prompt text: policies never need it."""

    request_id: str
    model: str
    #: LoRA adapter name when ``model`` names an adapter; ``model`` is then its base model.
    adapter: str | None
    tenant: str
    route: str
    prompt_tokens: int
    #: fleetgate chained block hashes of the prompt's full blocks (seeded by model/adapter/salt).
    chain: Sequence[BlockHash] = ()
    block_size: int = 16
    max_output_tokens: int | None = None
    #: Answers decoded side by side for it (OpenAI's ``n``): its usage counts the output tokens
    #: of all of them, and each advances once per engine step, so its time per output token is
    #: the decode time over the tokens of one.
    choices: int = 1
    #: The latency objectives the request is held to, where its tenant or route declares them
    #: (None: undeclared). Policies whose thresholds derive from the SLOs (fleet-cost's overflow
    #: and short-decode protection) follow them instead of their 2,000 / 50 ms defaults.
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    #: Filled by the engine from the index: longest cached prefix per replica, in blocks.
    #: ``None`` means the index was unavailable and routing is load-only (degraded).
    prefix_matches: dict[ReplicaId, int] | None = None
    #: Adapter cold-load estimate per replica (ms), filled from ``adapters_registry`` if known.
    #: Readers use ``get``: the gateway's mapping works each replica out when it is read.
    adapter_cold_load_ms: Mapping[ReplicaId, float] = field(default_factory=dict)
    #: Deterministic per-request seed for randomised tie-breaks (tests fix it).
    seed: int | None = None
    #: Filled by the engine when it prunes candidates before scoring (``routing/prune.py``):
    #: figures of every candidate, for plugins that compare a replica with the fleet rather
    #: than with the few replicas left to score. ``None``: nothing was pruned.
    candidates: CandidatesSummary | None = None
    #: Set by a scorer that judged the request lost wherever it goes (every replica's queue past
    #: its bound): pickers then take the scorer's choice even over their load bound.
    overflow: bool = False


@dataclass
class ReplicaExplanation:
    """Why a replica scored what it did: per-plugin scores and any cost terms (ms, blocks)."""

    replica: ReplicaId
    matched_blocks: int = 0
    scores: dict[str, float] = field(default_factory=dict)
    terms: dict[str, float] = field(default_factory=dict)
    filtered_out_by: str | None = None


@dataclass
class RoutingDecision:
    """The engine's answer: the chosen replica, the runners-up in order, and why."""

    replica: ReplicaId
    #: Other acceptable replicas, best first; the gateway retries on these.
    fallbacks: list[ReplicaId]
    profile: str
    degraded: bool
    #: Per replica the decision saw; read-only (the engine's is ``routing.engine.ExplanationMap``).
    explanations: Mapping[ReplicaId, ReplicaExplanation]
    #: Time spent in each stage and plugin, in ms (index lookup, each filter/scorer, picker).
    timings_ms: dict[str, float] = field(default_factory=dict)

    def with_fallbacks(self, more: Sequence[ReplicaId]) -> RoutingDecision:
        """The same decision with the replicas of ``more`` it does not name yet appended to its
        fallbacks, in their order (a decision made among a few replicas keeps the rest of the
        fleet to retry on)."""
        named = {self.replica, *self.fallbacks}
        extra = [replica for replica in more if replica not in named]
        return replace(self, fallbacks=[*self.fallbacks, *extra])


class NoReplicaAvailable(RuntimeError):
    """No healthy replica left after filtering: the one routing failure the client sees (503)."""


# --------------------------------------------------------------------------- policy plugins


@runtime_checkable
class Filter(Protocol):
    """Removes replicas that must not serve a request."""

    type_name: str

    def filter(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> list[ReplicaState]: ...


@runtime_checkable
class Scorer(Protocol):
    """Scores each replica in [0, 1], higher is better; the engine clamps and applies weights."""

    type_name: str

    def score(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> dict[ReplicaId, float]: ...


@runtime_checkable
class Picker(Protocol):
    """Chooses among weighted-scored replicas; returns them ordered best first."""

    type_name: str

    def pick(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaState],
        scores: Mapping[ReplicaId, float],
    ) -> list[ReplicaId]: ...


class RequestObserver(Protocol):
    """Optional hooks a plugin may implement; the engine calls them when the gateway reports."""

    def on_request_start(self, request: RoutingRequest, replica: ReplicaId) -> None: ...

    def on_request_complete(
        self,
        request: RoutingRequest,
        replica: ReplicaId,
        ttft_ms: float | None,
        cached_tokens: int | None,
        ok: bool,
    ) -> None: ...
