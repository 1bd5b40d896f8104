"""Prefill-speed calibration for ``expected-ttft``: one speed per pool, replicas shrunk toward it.

Each completed request yields one noisy measurement of how fast its replica prefilled: the TTFT
residual (observed TTFT minus the queue wait predicted at routing time) also carries whatever
queueing the prediction missed, so single measurements scatter. Learning one free speed per
replica turns that scatter into fake differences between identical replicas, and a replica that
merely *looks* slower loses the requests whose prefix it holds.

So speeds are learned as factors on the configured speed (``actual / configured``), in log space:

* each replica keeps its own estimate (an EWMA of its observations) and the scatter of those
  observations around it, which gives the estimate's sampling variance ``var_i``;
* the **pool factor** is the median of its replicas' estimates: robust, so one slow replica does
  not drag its healthy peers' speed down;
* each replica's **deviation** from the pool is shrunk toward 0 by its own signal-to-noise ratio
  (a positive-part James–Stein rule): only the share ``max(0, 1 − 3·var_i / dev_i²)`` counts.
  Identical replicas deviate by about their noise and share the pool's speed; a genuinely slower
  replica stands many standard errors out and keeps its own. Until three replicas of a pool
  have reported, all of them use the pool's (plain EWMA) factor.

Every observation is first clipped to within ``max_step``× of what its replica is believed to do
(bounded influence), so one TTFT blown up by an unpredicted queue cannot drag an estimate far.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from routing.types import ReplicaId

__all__ = ["SpeedCalibration"]

#: Replicas with feedback a pool needs before any of them may deviate from the pool's speed.
_MIN_REPLICAS_FOR_SPREAD = 3
#: A deviation must exceed about sqrt(3) standard errors of its own estimate to count at all.
_SIGNIFICANCE = 3.0
#: The furthest a learned speed may move from the configured one, either way. Beyond 10x the
#: configuration is wrong, not the replica; and without a bound, TTFTs that read as instant (a
#: clock glitch, answers served from somewhere else) push the speed towards infinity, prefill
#: then costs nothing, and later observations are all filtered out as queue: it never comes back.
MAX_FACTOR = 10.0
_MAX_LOG = math.log(MAX_FACTOR)


@dataclass
class _ReplicaFit:
    """One replica's own log-factor estimate and the scatter of observations around it."""

    pool: str
    #: EWMA of the replica's (clipped) log speed ratios.
    log_factor: float
    #: EWMA of the squared innovation: the variance of one observation around the estimate.
    noise: float = 0.0
    observations: int = 0


class SpeedCalibration:
    """Learns ``actual / configured`` prefill speed per pool, with shrunk per-replica deviations.

    ``alpha`` is the EWMA weight of one observation; ``max_step`` bounds (as a factor) how far one
    observation may pull an estimate; ``prior_noise`` is the observation variance assumed for a
    replica until it has ``min_observations`` (so early deviations count for little).
    """

    def __init__(
        self,
        alpha: float,
        max_step: float,
        *,
        prior_noise: float = 0.25,
        min_observations: int = 8,
    ) -> None:
        self._alpha = alpha
        self._clip = math.log(max_step) if max_step > 1.0 else 0.0
        self._prior_noise = prior_noise
        self._min_observations = min_observations
        #: Per pool: an EWMA over every member's observations (used while few replicas report).
        self._pool_ewma: dict[str, float] = {}
        #: Per pool: the log factor in use (median of members, or the EWMA).
        self._pool_log: dict[str, float] = {}
        self._fits: dict[ReplicaId, _ReplicaFit] = {}
        #: Effective factor per replica, recomputed after each observation (read per decision).
        self._factor: dict[ReplicaId, float] = {}

    def factor(self, replica: ReplicaId) -> float | None:
        """Calibrated ``actual / configured`` speed for ``replica``; None before its feedback."""
        return self._factor.get(replica)

    def pool_factor(self, pool: str) -> float | None:
        """The pool's shared factor; None before any feedback from the pool."""
        log_factor = self._pool_log.get(pool)
        return None if log_factor is None else math.exp(log_factor)

    def observe(self, replica: ReplicaId, pool: str, ratio: float) -> None:
        """One measurement: ``replica`` (of ``pool``) prefilled at ``ratio`` × configured speed."""
        if not (ratio > 0 and math.isfinite(ratio)):
            return
        log_ratio = math.log(ratio)
        alpha = self._alpha
        fit = self._fits.get(replica)
        if fit is None or fit.pool != pool:
            start = self._pool_log.get(pool, 0.0)
            fit = self._fits[replica] = _ReplicaFit(pool, start)
        log_ratio = max(-_MAX_LOG, min(_MAX_LOG, log_ratio))
        clipped = fit.log_factor + max(-self._clip, min(self._clip, log_ratio - fit.log_factor))
        innovation = clipped - fit.log_factor
        fit.log_factor += alpha * innovation
        fit.noise += alpha * (innovation * innovation - fit.noise)
        fit.observations += 1
        ewma = self._pool_ewma.get(pool, 0.0)
        pool_clipped = ewma + max(-self._clip, min(self._clip, log_ratio - ewma))
        self._pool_ewma[pool] = ewma + alpha * (pool_clipped - ewma)
        self._refresh(pool)

    def _sampling_variance(self, fit: _ReplicaFit) -> float:
        """Variance of the EWMA estimate: observation variance × alpha / (2 − alpha)."""
        noise = fit.noise if fit.observations >= self._min_observations else self._prior_noise
        return max(noise, 1e-12) * self._alpha / (2.0 - self._alpha)

    def _kept(self, fit: _ReplicaFit, center: float) -> float:
        """Share of ``fit``'s deviation from ``center`` that counts (positive-part shrinkage)."""
        deviation = fit.log_factor - center
        dev2 = deviation * deviation
        if dev2 <= 0.0:
            return 0.0
        return max(0.0, 1.0 - _SIGNIFICANCE * self._sampling_variance(fit) / dev2)

    def _refresh(self, pool: str) -> None:
        """Recompute the pool factor and every member's shrunk factor."""
        members = [(rid, fit) for rid, fit in self._fits.items() if fit.pool == pool]
        if len(members) < _MIN_REPLICAS_FOR_SPREAD:
            # One or two replicas cannot tell a real difference from noise: one shared speed.
            center = self._pool_log[pool] = self._pool_ewma[pool]
            for rid, _ in members:
                self._factor[rid] = math.exp(center)
            return
        center = self._pool_log[pool] = statistics.median(fit.log_factor for _, fit in members)
        for rid, fit in members:
            kept = self._kept(fit, center)
            self._factor[rid] = math.exp(center + kept * (fit.log_factor - center))

    def shrinkage(self, replica: ReplicaId) -> float | None:
        """How much of ``replica``'s own deviation is kept (0: the pool's speed, 1: its own)."""
        fit = self._fits.get(replica)
        if fit is None:
            return None
        members = sum(1 for f in self._fits.values() if f.pool == fit.pool)
        if members < _MIN_REPLICAS_FOR_SPREAD:
            return 0.0
        return self._kept(fit, self._pool_log[fit.pool])
