"""What every routing plugin shares: strict parameters, a type name, a kind, seeded randomness.

A plugin is a small class with one job (filter, scorer or picker). Its parameters are a pydantic
model decoded strictly (unknown keys are errors), so a typo in the policy YAML is refused with the
parameter's name instead of being silently ignored.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from routing.contracts import RoutingRequest
from routing.state import ReplicaState
from routing.types import ReplicaId

PluginKind = Literal["filter", "scorer", "picker"]

#: Per-plugin terms that explain a decision: replica -> {term name: value}.
Terms = dict[ReplicaId, dict[str, float]]


class PluginParams(BaseModel):
    """Base of every plugin's ``Params``: strict (unknown keys refused) and immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Plugin:
    """Base class of the built-in plugins.

    Subclasses set ``type_name`` (the name the YAML uses), ``kind``, and a nested ``Params`` model.
    ``needs_prefix`` tells the engine to consult the block index before running the profile;
    ``prunable`` lets it score only the candidates that can win in large fleets.
    """

    type_name: ClassVar[str]
    kind: ClassVar[PluginKind]
    needs_prefix: ClassVar[bool] = False
    #: True when the plugin decides the same on pruned candidates (routing/prune.py): it reads
    #: fleet-wide figures only from ``request.candidates`` when that is set.
    prunable: ClassVar[bool] = False
    Params: ClassVar[type[PluginParams]] = PluginParams

    def __init__(self, params: PluginParams | None = None, *, name: str | None = None) -> None:
        if params is None:
            params = self.Params()
        elif not isinstance(params, self.Params):
            raise TypeError(
                f"{self.type_name}: params must be {type(self).__name__}.Params "
                f"(got {type(params).__name__})"
            )
        self.params = params
        #: Instance name (YAML ``name``); keys this plugin's scores, terms and timings.
        self.name = name or self.type_name
        # Used when a request carries no seed; seeded from the OS so gateways differ.
        self._rng = random.Random()

    def rng(self, request: RoutingRequest) -> random.Random:
        """Randomness for one decision: deterministic when ``request.seed`` is set."""
        if request.seed is not None:
            return random.Random(request.seed)
        return self._rng

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, params={self.params!r})"


class ExplainingPicker(Plugin):
    """A picker that explains itself: subclasses implement ``pick_with_terms`` only."""

    kind: ClassVar[PluginKind] = "picker"

    def pick(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaState],
        scores: Mapping[ReplicaId, float],
    ) -> list[ReplicaId]:
        """Candidates best first (the engine uses ``pick_with_terms`` to explain them too)."""
        return self.pick_with_terms(request, replicas, scores)[0]

    def pick_with_terms(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaState],
        scores: Mapping[ReplicaId, float],
    ) -> tuple[list[ReplicaId], Terms]:
        """Candidates best first, and per replica the terms that placed it there."""
        raise NotImplementedError


def order_by_load(replicas: Iterable[ReplicaState], rng: random.Random) -> list[ReplicaId]:
    """Replica ids from least to most loaded; equal loads in random order.

    Random tie-breaks matter: sorting equal loads by id would send every burst to replica 0.
    """
    keyed = [(r.load, rng.random(), r.replica_id) for r in replicas]
    keyed.sort()
    return [rid for _load, _tie, rid in keyed]


def match_ratio(request: RoutingRequest, replica: ReplicaId) -> float:
    """Share of the prompt's tokens that ``replica`` holds cached, in [0, 1] (0 when unknown)."""
    if not request.prefix_matches or request.prompt_tokens <= 0:
        return 0.0
    matched_tokens = request.prefix_matches.get(replica, 0) * request.block_size
    return min(1.0, matched_tokens / request.prompt_tokens)
