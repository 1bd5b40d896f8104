"""Builds the routing pieces the gateway drives: tokenizer, block index, routing engine.

``routing/`` owns all of them; the gateway only constructs them from its configuration.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gateway.policy_view import GatewayPolicy
from routing.contracts import (
    BlockIndex,
    PromptTokenizer,
    RoutingDecision,
    RoutingRequest,
    TokenizedPrompt,
)
from routing.state import ReplicaState
from routing.types import ReplicaId

log = logging.getLogger(__name__)


class Router(Protocol):
    """What the gateway needs from ``routing/engine.RoutingEngine``."""

    async def route(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState], profile: str
    ) -> RoutingDecision: ...

    def replace_profiles(self, profiles: Mapping[str, Any]) -> None: ...

    def observe_start(self, request: RoutingRequest, replica: ReplicaId) -> None: ...

    def observe_complete(
        self,
        request: RoutingRequest,
        replica: ReplicaId,
        ttft_ms: float | None,
        cached_tokens: int | None,
        ok: bool,
    ) -> None: ...


# --------------------------------------------------------------------------- tokenizer


class ModelTokenizers:
    """One tokenizer per base model (the policy may give each its own), with a default."""

    def __init__(self, default: PromptTokenizer, per_model: Mapping[str, PromptTokenizer]):
        self.default = default
        self.per_model = dict(per_model)

    def _for(self, model: str) -> PromptTokenizer:
        return self.per_model.get(model, self.default)

    async def tokenize_completion(self, model: str, prompt: str) -> TokenizedPrompt:
        return await self._for(model).tokenize_completion(model, prompt)

    async def tokenize_chat(
        self, model: str, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any
    ) -> TokenizedPrompt:
        return await self._for(model).tokenize_chat(model, messages, **template_kwargs)

    async def close(self) -> None:
        """Close tokenizers that hold connections (remote ones)."""
        for tokenizer in {id(t): t for t in (self.default, *self.per_model.values())}.values():
            close = getattr(tokenizer, "close", None)
            if close is not None:
                await close()


def build_prompt_tokenizer(
    tokenizer_dir: str | None, remote_url: str | None, policy: GatewayPolicy | None = None
) -> ModelTokenizers:
    """Tokenizers: ``--tokenizer`` / ``--remote-tokenizer`` for every model, else each model's
    tokenizer from the policy, else text mode (characters as blocks)."""
    from routing.tokenize import build_tokenizer

    if tokenizer_dir:
        return ModelTokenizers(build_tokenizer("local", model_dir=tokenizer_dir), {})
    if remote_url:
        return ModelTokenizers(build_tokenizer("remote", base_url=remote_url), {})
    per_model: dict[str, PromptTokenizer] = {}
    source = policy.source if policy is not None else None
    for spec in getattr(source, "models", None) or ():
        kind = spec.tokenizer.kind
        if kind == "local":
            per_model[spec.name] = build_tokenizer("local", model_dir=str(spec.tokenizer.path))
        elif kind == "remote":
            per_model[spec.name] = build_tokenizer("remote", base_url=str(spec.tokenizer.url))
    return ModelTokenizers(build_tokenizer("text"), per_model)


# --------------------------------------------------------------------------- index


def build_gateway_index(
    redis_url: str | None, key_prefix: str | None = None, mode: str | None = None
) -> BlockIndex:
    """The block index: Redis (``mode`` lookup or mirror) when ``redis_url`` is given, else
    in-memory."""
    from routing.index import build_index

    opts = {"mode": mode} if mode else {}
    if redis_url and key_prefix:
        return build_index(redis_url, key_prefix=key_prefix, **opts)
    return build_index(redis_url, **opts)


# --------------------------------------------------------------------------- engine


def build_profiles(policy: GatewayPolicy) -> dict[str, Any]:
    """Engine profiles for every route: from the policy file, else built-in profiles by name."""
    if policy.source is not None and hasattr(policy.source, "profiles_for_engine"):
        return dict(policy.source.profiles_for_engine())
    from routing.policies.registry import builtin_profiles

    return builtin_profiles()


def build_engine(index: BlockIndex, policy: GatewayPolicy, index_timeout_s: float) -> Router:
    """``routing.engine.RoutingEngine`` over ``index`` with the policy's profiles."""
    from routing.engine import RoutingEngine

    return RoutingEngine(index, build_profiles(policy), index_timeout_s=index_timeout_s)
