"""Erlang B/C formulas for an M/M/c queue: c servers, Poisson arrivals, exponential service.

Notation: ``arrival_rate`` λ and ``service_rate`` μ are per second (μ is per server), the offered
load is A = λ/μ (in Erlangs) and utilisation ρ = A/c. The queue is stable only when A < c; past
that, waits grow without bound and the functions here say so (probability 1, infinite wait)
instead of returning a misleading finite number.

Erlang C is computed from the Erlang B recursion B(k) = A·B(k-1) / (k + A·B(k-1)), which uses
only values in [0, 1]; the textbook closed form with A^c/c! overflows floats near c ≈ 170.
"""

from __future__ import annotations

import math


def erlang_b(servers: int, offered_load: float) -> float:
    """Blocking probability of an M/M/c/c loss system (Erlang B)."""
    _check_servers(servers)
    if offered_load < 0:
        raise ValueError(f"offered_load must be >= 0 Erlangs (got {offered_load})")
    blocking = 1.0
    for k in range(1, servers + 1):
        blocking = offered_load * blocking / (k + offered_load * blocking)
    return blocking


def erlang_c(servers: int, offered_load: float) -> float:
    """Probability that an arrival has to wait in an M/M/c queue (Erlang C).

    Returns 1.0 when the queue is unstable (offered_load >= servers).
    """
    blocking = erlang_b(servers, offered_load)
    if offered_load >= servers:
        return 1.0
    return servers * blocking / (servers - offered_load * (1 - blocking))


def prob_wait_exceeds(
    servers: int, arrival_rate: float, service_rate: float, wait_s: float
) -> float:
    """P(W > t) for the queueing delay W of an M/M/c queue: C · e^{-(cμ-λ)t}."""
    _check_rates(arrival_rate, service_rate)
    if wait_s < 0:
        raise ValueError(f"wait_s must be >= 0 (got {wait_s})")
    waiting = erlang_c(servers, arrival_rate / service_rate)
    drain_rate = servers * service_rate - arrival_rate
    if drain_rate <= 0:
        return 1.0
    return waiting * math.exp(-drain_rate * wait_s)


def mean_wait(servers: int, arrival_rate: float, service_rate: float) -> float:
    """Mean queueing delay E[W] = C / (cμ - λ) in seconds; ``inf`` when unstable."""
    _check_rates(arrival_rate, service_rate)
    drain_rate = servers * service_rate - arrival_rate
    if drain_rate <= 0:
        return math.inf
    return erlang_c(servers, arrival_rate / service_rate) / drain_rate


def wait_percentile(
    servers: int, arrival_rate: float, service_rate: float, quantile: float
) -> float:
    """The ``quantile`` (e.g. 0.95) of the queueing delay, in seconds.

    Solves C·e^{-(cμ-λ)t} = 1 - q for t; it is 0 when fewer than (1 - q) of arrivals wait at all.
    """
    _check_rates(arrival_rate, service_rate)
    if not 0 < quantile < 1:
        raise ValueError(f"quantile must be in (0, 1) (got {quantile})")
    drain_rate = servers * service_rate - arrival_rate
    if drain_rate <= 0:
        return math.inf
    waiting = erlang_c(servers, arrival_rate / service_rate)
    if waiting <= 1 - quantile:
        return 0.0
    return math.log(waiting / (1 - quantile)) / drain_rate


def _check_servers(servers: int) -> None:
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise ValueError(f"servers must be an integer >= 1 (got {servers!r})")


def _check_rates(arrival_rate: float, service_rate: float) -> None:
    if arrival_rate < 0:
        raise ValueError(f"arrival_rate must be >= 0 per second (got {arrival_rate})")
    if service_rate <= 0:
        raise ValueError(f"service_rate must be > 0 per second (got {service_rate})")
