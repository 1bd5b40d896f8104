"""The policy engine: filters → (one index lookup) → weighted scorers → picker, per profile.

The engine knows plugins only through the protocols in ``routing/contracts.py``; policies are
small modules under ``routing/policies/``. It owns the parts every policy shares: the built-in
health/model filter, the single block-index lookup (and degrading to load-only routing when the
index fails), clamping and weighting of scores, timing every stage, explaining the decision, and
forwarding request outcomes to plugins that learn from them (TTFT calibration).

Explanations are built lazily: a decision keeps what each stage returned (per-plugin scores and
terms, filter verdicts, loads, prefix matches) and ``RoutingDecision.explanations`` turns it into
``ReplicaExplanation`` objects only for the replicas someone reads (``ExplanationMap``). Most
decisions are never explained; building an object and a terms dict per replica per request was
about a quarter of the engine's own time at 64 replicas. Plugins must therefore not modify the
score and term mappings they return once they have returned them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import operator
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from routing.contracts import (
    BlockIndex,
    Filter,
    NoReplicaAvailable,
    Picker,
    ReplicaExplanation,
    RoutingDecision,
    RoutingRequest,
    Scorer,
    in_process_match,
)
from routing.policies.serves_model import ServesModelFilter
from routing.prune import PRUNED, Pruning, prune
from routing.state import ReplicaState
from routing.types import ReplicaId

__all__ = ["ExplainingPicker", "ExplainingScorer", "ExplanationMap", "Profile", "RoutingEngine"]

log = logging.getLogger(__name__)

#: Terms a plugin reports per replica to explain its opinion (ms, tokens, flags).
PluginTerms = Mapping[ReplicaId, Mapping[str, float]]


@runtime_checkable
class ExplainingScorer(Protocol):
    """A scorer that also reports the cost terms behind its scores (optional extension)."""

    def score_with_terms(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> tuple[dict[ReplicaId, float], PluginTerms]: ...


@runtime_checkable
class ExplainingPicker(Protocol):
    """A picker that also reports why it ordered replicas as it did (optional extension)."""

    def pick_with_terms(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaState],
        scores: Mapping[ReplicaId, float],
    ) -> tuple[list[ReplicaId], PluginTerms]: ...


class _Stages:
    """What one decision's stages returned: enough to explain any replica later."""

    __slots__ = ("filtered_out_by", "matches", "picker_terms", "pruned", "scorers", "totals")

    def __init__(self) -> None:
        #: True when candidates were pruned before scoring: those not scored were pruned.
        self.pruned = False
        #: Replica -> name of the filter that removed it (removed replicas only).
        self.filtered_out_by: dict[ReplicaId, str] = {}
        self.matches: Mapping[ReplicaId, int] | None = None
        #: Per scorer, in order: (name, raw scores as returned, terms as returned).
        self.scorers: list[tuple[str, Mapping[ReplicaId, float], PluginTerms]] = []
        #: The candidates (the replicas scored), as keys.
        self.totals: Mapping[ReplicaId, float] = {}
        self.picker_terms: PluginTerms = {}

    def explain(self, replica: ReplicaId, load: float) -> ReplicaExplanation:
        """The explanation of ``replica``, exactly as building it stage by stage would give."""
        terms = {"load": load}
        scores: dict[str, float] = {}
        if replica in self.totals:
            for name, raw, scorer_terms in self.scorers:
                scores[name] = _clamp01(raw.get(replica, 0.0))
                if replica in scorer_terms:
                    terms.update(scorer_terms[replica])
        if replica in self.picker_terms:
            terms.update(self.picker_terms[replica])
        matches = self.matches
        return ReplicaExplanation(
            replica=replica,
            matched_blocks=matches.get(replica, 0) if matches else 0,
            scores=scores,
            terms=terms,
            filtered_out_by=self.filtered_out_by.get(
                replica, PRUNED if self.pruned and replica not in self.totals else None
            ),
        )


class ExplanationMap(Mapping[ReplicaId, ReplicaExplanation]):
    """``RoutingDecision.explanations``: a read-only mapping whose values are built on first read.

    The contract: its keys, order and length are those of the replicas the decision saw (every
    replica passed to ``route``, filtered out or not), known at no cost; reading one replica
    (``[]``, ``get``) builds that replica's ``ReplicaExplanation`` from what the stages returned
    and its load at decision time, once, and keeps it; reading all (``items()``, ``values()``,
    equality, ``repr``) builds the rest. It cannot be written: a reader that wants to change
    explanations copies them first (``dict(m)``); copies and pickles are plain dicts.
    """

    __slots__ = ("_built", "_loads", "_stages")

    def __init__(self, loads: Mapping[ReplicaId, float], stages: _Stages) -> None:
        #: Each replica's load at decision time, in the order the engine saw them. Owned: the
        #: engine builds it per decision and never touches it again.
        self._loads = loads
        self._stages = stages
        self._built: dict[ReplicaId, ReplicaExplanation] = {}

    def __getitem__(self, key: ReplicaId) -> ReplicaExplanation:
        built = self._built.get(key)
        if built is None:
            built = self._built[key] = self._stages.explain(key, self._loads[key])
        return built

    def get(self, key: ReplicaId, default: Any = None) -> Any:  # type: ignore[override]
        # Mapping.get goes through __getitem__ and a KeyError: twice as slow on a miss.
        built = self._built.get(key)
        if built is not None:
            return built
        load = self._loads.get(key)
        if load is None:
            return default
        built = self._built[key] = self._stages.explain(key, load)
        return built

    def __contains__(self, key: object) -> bool:
        return key in self._loads

    def scored(self) -> Iterator[tuple[ReplicaId, ReplicaExplanation]]:
        """(replica, explanation) of the replicas that were scored, in the order they were
        scored: every other replica was filtered out or pruned. A reader that wants only the
        candidates of a 1,000-replica decision builds 30 explanations instead of 1,000."""
        for replica in self._stages.totals:
            yield replica, self[replica]

    def __iter__(self) -> Iterator[ReplicaId]:
        return iter(self._loads)

    def __len__(self) -> int:
        return len(self._loads)

    def __repr__(self) -> str:
        return repr(dict(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        # Copies (copy.copy, deepcopy) and pickles are plain dicts of built explanations.
        return (dict, (dict(self.items()),))


def _plugin_name(plugin: object) -> str:
    """A plugin's instance name (YAML ``name``), falling back to its type name."""
    return str(getattr(plugin, "name", None) or getattr(plugin, "type_name", type(plugin).__name__))


@dataclass(frozen=True)
class Profile:
    """A named routing policy: filters, weighted scorers and one picker.

    ``needs_prefix`` is derived: true when any plugin declares ``needs_prefix = True``, so the
    engine consults the block index only for profiles that read prefix matches.
    """

    name: str
    filters: Sequence[Filter]
    scorers: Sequence[tuple[Scorer, float]]
    picker: Picker

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"profile name must be a non-empty string (got {self.name!r})")
        object.__setattr__(self, "filters", tuple(self.filters))
        object.__setattr__(self, "scorers", tuple(tuple(pair) for pair in self.scorers))
        where = f"profile {self.name!r}"
        for plugin in self.filters:
            if not isinstance(plugin, Filter):
                raise TypeError(f"{where}: {plugin!r} is not a filter (no filter() method)")
        seen: set[str] = set()
        for index, pair in enumerate(self.scorers):
            if len(pair) != 2:
                raise ValueError(f"{where}: scorers[{index}] must be (scorer, weight)")
            scorer, weight = pair
            if not isinstance(scorer, Scorer):
                raise TypeError(f"{where}: {scorer!r} is not a scorer (no score() method)")
            if (
                isinstance(weight, bool)
                or not isinstance(weight, int | float)
                or not math.isfinite(weight)
                or weight < 0
            ):
                raise ValueError(
                    f"{where}: weight of scorer {_plugin_name(scorer)!r} must be a finite "
                    f"number >= 0 (got {weight!r})"
                )
            name = _plugin_name(scorer)
            if name in seen:
                # Scores and explanations are keyed by plugin name; two with one name would merge.
                raise ValueError(f"{where}: scorer name {name!r} is used twice")
            seen.add(name)
        if not isinstance(self.picker, Picker):
            raise TypeError(f"{where}: {self.picker!r} is not a picker (no pick() method)")

    @property
    def plugins(self) -> tuple[object, ...]:
        """Every plugin of the profile: filters, scorers, then the picker."""
        return (*self.filters, *(scorer for scorer, _ in self.scorers), self.picker)

    @property
    def needs_prefix(self) -> bool:
        """True when a plugin of this profile reads ``request.prefix_matches``."""
        return any(getattr(plugin, "needs_prefix", False) for plugin in self.plugins)


class _RateLimitedWarning:
    """Logs a warning at most once per ``interval_s``, counting what it suppressed.

    During a Redis outage every request degrades; one line per request would bury the logs.
    """

    def __init__(self, interval_s: float = 10.0) -> None:
        self._interval_s = interval_s
        self._last = -math.inf
        self._suppressed = 0

    def warn(self, message: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._last < self._interval_s:
            self._suppressed += 1
            return
        suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            message += f" ({suppressed} similar suppressed)"
        log.warning(message, *args, exc_info=exc_info)


def _clamp01(value: float) -> float:
    """Clamp a plugin score to [0, 1]; NaN (a plugin bug) counts as no opinion (0)."""
    if value != value:  # NaN
        return 0.0
    return 0.0 if value < 0.0 else 1.0 if value > 1.0 else float(value)


def _loads_of(replicas: Sequence[ReplicaState]) -> dict[ReplicaId, float]:
    """Each replica's ``ReplicaState.load``, in order."""
    return {r.replica_id: float(r.load) for r in replicas}


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


class _Plan:
    """What ``route`` needs of a profile, worked out once per profile instead of per request."""

    __slots__ = (
        "filters",
        "needs_prefix",
        "picker_key",
        "picker_name",
        "profile",
        "prunable",
        "scorers",
    )

    def __init__(self, profile: Profile, builtin_filter: Filter) -> None:
        self.profile = profile
        self.needs_prefix = profile.needs_prefix  # a property walking every plugin
        #: Every scorer and the picker read fleet-wide figures only as ``request.candidates``:
        #: the engine may prune candidates before scoring (routing/prune.py).
        self.prunable = all(
            getattr(plugin, "prunable", False)
            for plugin in (*(scorer for scorer, _ in profile.scorers), profile.picker)
        )
        filter_names = [_plugin_name(f) for f in (builtin_filter, *profile.filters)]
        #: (filter, its name, its timings key), the built-in filter first.
        self.filters: tuple[tuple[Filter, str, str], ...] = tuple(
            (plugin, name, f"filter:{name}")
            for plugin, name in zip((builtin_filter, *profile.filters), filter_names, strict=True)
        )
        #: (scorer, weight, its name, its timings key).
        self.scorers: tuple[tuple[Scorer, float, str, str], ...] = tuple(
            (scorer, weight, _plugin_name(scorer), f"scorer:{_plugin_name(scorer)}")
            for scorer, weight in profile.scorers
        )
        self.picker_name = _plugin_name(profile.picker)
        self.picker_key = f"picker:{self.picker_name}"


class RoutingEngine:
    """Runs routing profiles over the current replica states.

    ``index`` may be ``None`` (no prefix data: profiles that need it route on load alone unless
    the caller pre-filled ``request.prefix_matches``). ``index_timeout_s`` bounds the one index
    lookup per decision; past it the decision degrades rather than waits.
    """

    def __init__(
        self,
        index: BlockIndex | None,
        profiles: Mapping[str, Profile],
        *,
        index_timeout_s: float = 0.05,
        pruning: Pruning | None = Pruning(),  # noqa: B008 - frozen, shared safely
    ) -> None:
        if not (index_timeout_s > 0 and math.isfinite(index_timeout_s)):
            raise ValueError(f"index_timeout_s must be a positive number (got {index_timeout_s!r})")
        self._index = index
        #: Past ``pruning.above`` candidates, score only those that can win (routing/prune.py);
        #: ``None`` scores every candidate.
        self._pruning = pruning
        #: Tie-breaks between equally loaded replicas when pruning (seeded requests use their own).
        self._rng = np.random.default_rng()
        #: The synchronous lookup of an in-process index (memory, mirror), found once; a
        #: subclass overriding the async ``match`` (tests do) is called through that instead.
        self._match_now = in_process_match(index)
        self._index_timeout_s = index_timeout_s
        self._builtin_filter = ServesModelFilter()
        self._index_warning = _RateLimitedWarning()
        self._plugin_warning = _RateLimitedWarning()
        self._profiles: dict[str, Profile] = {}
        self._plans: dict[str, _Plan] = {}
        self._observers: list[object] = []
        self.replace_profiles(profiles)

    # ------------------------------------------------------------------ configuration

    @property
    def profiles(self) -> Mapping[str, Profile]:
        """The profiles this engine routes with, by name."""
        return dict(self._profiles)

    def calibrated_speeds(self, replica: ReplicaId) -> dict[str, float]:
        """Per profile whose scorer learns prefill speed (``expected-ttft``, ``fleet-cost``): the
        speed it believes ``replica`` prefills at, in tokens/s, once it has feedback. For
        people (``/admin/replicas``): a configured speed far from the learned one is a pool
        whose engines are not what the policy says."""
        speeds: dict[str, float] = {}
        for name, profile in self._profiles.items():
            for plugin in profile.plugins:
                learned = getattr(plugin, "calibrated_speed", None)
                speed = learned(replica) if callable(learned) else None
                if speed is not None:
                    speeds[name] = speed
                    break
        return speeds

    @property
    def index(self) -> BlockIndex | None:
        """The block index consulted for prefix matches (``None``: none configured)."""
        return self._index

    def replace_profiles(self, profiles: Mapping[str, Profile]) -> None:
        """Swap in a new set of profiles (policy reload); in-flight decisions keep the old ones.

        Plugin state (round-robin position, TTFT calibration) lives in plugin instances, so it
        survives a reload only for plugin instances the new profiles reuse.
        """
        checked: dict[str, Profile] = {}
        for key, profile in profiles.items():
            if not isinstance(profile, Profile):
                raise TypeError(
                    f"profiles[{key!r}] must be a Profile (got {type(profile).__name__})"
                )
            if key != profile.name:
                raise ValueError(f"profiles[{key!r}] holds a profile named {profile.name!r}")
            checked[key] = profile
        observers: dict[int, object] = {}
        for profile in checked.values():
            for plugin in profile.plugins:
                if hasattr(plugin, "on_request_start") or hasattr(plugin, "on_request_complete"):
                    observers[id(plugin)] = plugin
        plans = {key: _Plan(profile, self._builtin_filter) for key, profile in checked.items()}
        self._profiles, self._plans = checked, plans
        self._observers = list(observers.values())

    # ------------------------------------------------------------------ routing

    async def route(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState], profile: str
    ) -> RoutingDecision:
        """Choose a replica for ``request`` with the named profile.

        Raises ``NoReplicaAvailable`` only when no replica survives filtering; an index failure
        degrades the decision to load-only (``decision.degraded``) instead of failing it.
        """
        started = time.perf_counter()
        try:
            plan = self._plans[profile]
        except KeyError:
            known = ", ".join(sorted(self._profiles)) or "none"
            raise ValueError(f"unknown routing profile {profile!r} (known: {known})") from None
        prof = plan.profile
        timings: dict[str, float] = {}
        stages = _Stages()
        pruning = self._pruning
        may_prune = pruning is not None and plan.prunable and len(replicas) > pruning.above
        # Loads now: replica states change in place after the decision (in-flight counts).
        # A decision that may prune reads them in its one pass over the fleet instead.
        loads = None if may_prune else _loads_of(replicas)

        request.candidates = None  # a request routed again is pruned afresh
        request.overflow = False  # ... and judged afresh
        if may_prune and len(plan.filters) == 1:
            # Only the built-in filter: one pass over the fleet filters, reads loads and prunes.
            # The index first (the pass groups by prefix depth; the lookup needs no filter).
            degraded = await self._prefix_stage(request, plan, timings, stages)
            start = time.perf_counter()
            pruned = prune(
                request, replicas, pruning, self._draw(request), serves=request.model  # type: ignore[arg-type]
            )
            _, filter_name, filter_key = plan.filters[0]
            loads = pruned.loads  # type: ignore[assignment]
            for rid in pruned.removed:
                stages.filtered_out_by[rid] = filter_name
            if not pruned.count:
                raise NoReplicaAvailable(
                    self._no_replica_message(request, replicas, plan.profile, filter_name)
                )
            timings[filter_key] = 0.0  # done in the prune pass, timed there
            candidates = pruned.scored
            if pruned.summary is not None:
                request.candidates = pruned.summary
                stages.pruned = True
            timings["prune"] = _ms_since(start)
        else:
            candidates = self._run_filters(request, replicas, plan, timings, stages)
            degraded = await self._prefix_stage(request, plan, timings, stages)
            if may_prune and len(candidates) > pruning.above:  # type: ignore[union-attr]
                start = time.perf_counter()
                if loads is None and len(candidates) < len(replicas):
                    loads = _loads_of(replicas)  # filtered-out replicas are explained too
                pruned = prune(
                    request, candidates, pruning, self._draw(request), loads  # type: ignore[arg-type]
                )
                candidates, request.candidates, loads = pruned.scored, pruned.summary, pruned.loads  # type: ignore[assignment]
                stages.pruned = True
                timings["prune"] = _ms_since(start)
        if loads is None:
            loads = _loads_of(replicas)

        totals = self._run_scorers(request, candidates, plan, timings, stages)
        order = self._run_picker(request, candidates, totals, plan, timings, stages)

        timings["total"] = _ms_since(started)
        return RoutingDecision(
            replica=order[0],
            fallbacks=order[1:],
            profile=prof.name,
            degraded=degraded,
            explanations=ExplanationMap(loads, stages),
            timings_ms=timings,
        )

    async def _prefix_stage(
        self, request: RoutingRequest, plan: _Plan, timings: dict[str, float], stages: _Stages
    ) -> bool:
        """The index lookup, if the profile reads prefix matches; True when the decision
        degrades (index unavailable)."""
        degraded = plan.needs_prefix and not await self._lookup_prefix(request, timings)
        if request.prefix_matches:
            stages.matches = dict(request.prefix_matches)
        return degraded

    def _draw(self, request: RoutingRequest) -> np.random.Generator:
        """Tie-breaks between equally loaded replicas when pruning: seeded requests (tests, the
        simulator's replays) prune the same way every time."""
        seed = request.seed
        return self._rng if seed is None else np.random.default_rng(seed)

    def _run_filters(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaState],
        plan: _Plan,
        timings: dict[str, float],
        stages: _Stages,
    ) -> list[ReplicaState]:
        candidates = list(replicas)
        filtered_out_by = stages.filtered_out_by
        for plugin, name, key in plan.filters:
            start = time.perf_counter()
            kept = plugin.filter(request, candidates)
            timings[key] = _ms_since(start)
            if not (
                type(kept) is list
                and len(kept) == len(candidates)
                and all(map(operator.is_, kept, candidates))
            ):  # else it kept everyone, in order (the usual case): nothing changes
                kept_ids = {r.replica_id for r in kept}
                for replica in candidates:
                    if replica.replica_id not in kept_ids:
                        filtered_out_by[replica.replica_id] = name
                # A filter may only remove replicas, never add ones it was not given.
                candidates = [r for r in candidates if r.replica_id in kept_ids]
            if not candidates:
                raise NoReplicaAvailable(
                    self._no_replica_message(request, replicas, plan.profile, name)
                )
        return candidates

    @staticmethod
    def _no_replica_message(
        request: RoutingRequest, replicas: Sequence[ReplicaState], prof: Profile, last: str
    ) -> str:
        if not replicas:
            return f"no replicas are registered (model {request.model!r}, profile {prof.name!r})"
        healthy = sum(1 for r in replicas if r.healthy)
        serving = sum(1 for r in replicas if r.healthy and request.model in r.models)
        return (
            f"no replica can serve model {request.model!r} (profile {prof.name!r}): "
            f"{len(replicas)} known, {healthy} healthy, {serving} healthy with the model; "
            f"the last filter to remove replicas was {last!r}"
        )

    async def _lookup_prefix(self, request: RoutingRequest, timings: dict[str, float]) -> bool:
        """Fill ``request.prefix_matches`` from the index; False when the decision degrades."""
        if self._index is None:
            # No index configured: trust matches the caller supplied (the simulator does this).
            return request.prefix_matches is not None
        if not request.chain:
            request.prefix_matches = {}
            return True
        start = time.perf_counter()
        try:
            match_now = self._match_now
            if match_now is not None:
                # An in-process index (MemoryBlockIndex) answers without waiting: no coroutine,
                # and no timer to arm (~4 us a decision) for a lookup that cannot time out.
                matches = match_now(request.chain)
            else:
                async with asyncio.timeout(self._index_timeout_s):
                    matches = await self._index.match(request.chain)
        except Exception as exc:  # IndexUnavailable, TimeoutError, or a backend bug: degrade.
            timings["index"] = _ms_since(start)
            self._index_warning.warn(
                "block index lookup failed (%s: %s); routing on load alone",
                type(exc).__name__,
                exc,
            )
            request.prefix_matches = None
            return False
        timings["index"] = _ms_since(start)
        request.prefix_matches = dict(matches)
        return True

    def _run_scorers(
        self,
        request: RoutingRequest,
        candidates: list[ReplicaState],
        plan: _Plan,
        timings: dict[str, float],
        stages: _Stages,
    ) -> dict[ReplicaId, float]:
        totals = dict.fromkeys([r.replica_id for r in candidates], 0.0)
        stages.totals = totals
        for scorer, weight, name, key in plan.scorers:
            start = time.perf_counter()
            terms: PluginTerms = {}
            # getattr, not isinstance(ExplainingScorer): protocol checks are slow on a hot path.
            explaining = getattr(scorer, "score_with_terms", None)
            try:
                if explaining is not None:
                    raw, terms = explaining(request, candidates)
                else:
                    raw = scorer.score(request, candidates)
            except Exception:
                # A scorer bug must not take routing down: it gives no opinion for this request.
                self._plugin_warning.warn("scorer %r failed; ignoring it", name, exc_info=True)
                raw = {}
            timings[key] = _ms_since(start)
            stages.scorers.append((name, raw, terms))
            get = raw.get
            for rid in totals:
                score = get(rid, 0.0)
                if not 0.0 <= score <= 1.0:  # out of range or NaN (rare): clamp
                    score = _clamp01(score)
                totals[rid] += weight * score
        return totals

    def _run_picker(
        self,
        request: RoutingRequest,
        candidates: list[ReplicaState],
        totals: dict[ReplicaId, float],
        plan: _Plan,
        timings: dict[str, float],
        stages: _Stages,
    ) -> list[ReplicaId]:
        picker = plan.profile.picker
        name = plan.picker_name
        start = time.perf_counter()
        terms: PluginTerms = {}
        explaining = getattr(picker, "pick_with_terms", None)
        try:
            if explaining is not None:
                order, terms = explaining(request, candidates, totals)
            else:
                order = picker.pick(request, candidates, totals)
        except Exception:
            self._plugin_warning.warn("picker %r failed; using scores", name, exc_info=True)
            order = []
        timings[plan.picker_key] = _ms_since(start)
        stages.picker_terms = terms
        # Keep only candidates, once each; a picker that returned nothing usable falls back to
        # the weighted scores, then load, so a picker bug degrades rather than fails.
        if type(order) is list and len(order) == len(totals) and totals.keys() == set(order):
            return list(order)  # every candidate once (the usual case)
        clean: list[ReplicaId] = []
        seen: set[ReplicaId] = set()
        for rid in order:
            if rid in totals and rid not in seen:
                seen.add(rid)
                clean.append(rid)
        if not clean:
            ranked = sorted(candidates, key=lambda r: (-totals[r.replica_id], r.load))
            clean = [r.replica_id for r in ranked]
        return clean

    # ------------------------------------------------------------------ feedback

    def observe_start(self, request: RoutingRequest, replica: ReplicaId) -> None:
        """Tell learning plugins that ``request`` was sent to ``replica`` (also on a retry)."""
        for plugin in self._observers:
            hook = getattr(plugin, "on_request_start", None)
            if hook is not None:
                try:
                    hook(request, replica)
                except Exception:
                    self._plugin_warning.warn(
                        "on_request_start of %r failed", plugin, exc_info=True
                    )

    def observe_complete(
        self,
        request: RoutingRequest,
        replica: ReplicaId,
        ttft_ms: float | None,
        cached_tokens: int | None,
        ok: bool,
    ) -> None:
        """Report a request's outcome (TTFT, engine-reported cached tokens) to learning plugins.

        ``cached_tokens`` is in the units of ``request.prompt_tokens``: where routing's count is
        an estimate (text mode), the engine's cached share of its own count applied to it."""
        for plugin in self._observers:
            hook = getattr(plugin, "on_request_complete", None)
            if hook is not None:
                try:
                    hook(request, replica, ttft_ms, cached_tokens, ok)
                except Exception:
                    self._plugin_warning.warn(
                        "on_request_complete of %r failed", plugin, exc_info=True
                    )
