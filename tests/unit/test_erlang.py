"""Erlang B/C against the closed forms (computed here with math.factorial) and textbook values."""

from __future__ import annotations

import math

import pytest

from planning.erlang import erlang_b, erlang_c, mean_wait, prob_wait_exceeds, wait_percentile


def closed_form_erlang_c(c: int, a: float) -> float:
    """P(wait) = (A^c/c! · c/(c-A)) / (Σ_{k<c} A^k/k! + A^c/c! · c/(c-A))."""
    top = a**c / math.factorial(c) * c / (c - a)
    return top / (sum(a**k / math.factorial(k) for k in range(c)) + top)


def closed_form_erlang_b(c: int, a: float) -> float:
    return (a**c / math.factorial(c)) / sum(a**k / math.factorial(k) for k in range(c + 1))


CASES = [(1, 0.5), (2, 1.0), (3, 2.4), (5, 4.0), (10, 8.0), (20, 17.5), (40, 30.0)]


@pytest.mark.parametrize(("servers", "load"), CASES)
def test_erlang_b_matches_closed_form(servers: int, load: float) -> None:
    assert erlang_b(servers, load) == pytest.approx(closed_form_erlang_b(servers, load), rel=1e-9)


@pytest.mark.parametrize(("servers", "load"), CASES)
def test_erlang_c_matches_closed_form(servers: int, load: float) -> None:
    assert erlang_c(servers, load) == pytest.approx(closed_form_erlang_c(servers, load), rel=1e-9)


@pytest.mark.parametrize("load", [0.1, 0.5, 0.9])
def test_one_server_waits_with_probability_rho(load: float) -> None:
    # M/M/1: P(wait) = ρ and E[W] = ρ / (μ - λ).
    assert erlang_c(1, load) == pytest.approx(load)
    assert mean_wait(1, load * 4.0, 4.0) == pytest.approx(load / (4.0 - load * 4.0))


def test_textbook_call_centre() -> None:
    # The classic example: 10 Erlangs on 11 agents waits ~68.2% of the time (tables: 0.6821).
    assert erlang_c(11, 10.0) == pytest.approx(0.6821, abs=5e-4)


def test_large_fleets_do_not_overflow() -> None:
    # A^c/c! overflows a float for c = 400; the recursion does not.
    value = erlang_c(400, 380.0)
    assert 0.0 < value < 1.0


@pytest.mark.parametrize(("servers", "load"), [(1, 1.0), (4, 4.0), (4, 9.0)])
def test_unstable_queues_always_wait_forever(servers: int, load: float) -> None:
    assert erlang_c(servers, load) == 1.0
    assert mean_wait(servers, load, 1.0) == math.inf
    assert wait_percentile(servers, load, 1.0, 0.95) == math.inf
    assert prob_wait_exceeds(servers, load, 1.0, 100.0) == 1.0


@pytest.mark.parametrize(("servers", "arrivals", "service"), [(1, 3.0, 4.0), (5, 18.0, 4.0)])
@pytest.mark.parametrize("quantile", [0.5, 0.9, 0.95, 0.99])
def test_percentile_inverts_the_tail(
    servers: int, arrivals: float, service: float, quantile: float
) -> None:
    t = wait_percentile(servers, arrivals, service, quantile)
    if t > 0:
        assert prob_wait_exceeds(servers, arrivals, service, t) == pytest.approx(1 - quantile)
    else:
        # Zero: already fewer than (1 - q) of requests wait at all.
        assert erlang_c(servers, arrivals / service) <= 1 - quantile


def test_mean_wait_integrates_the_tail() -> None:
    # E[W] = ∫ P(W > t) dt; a coarse numeric integral agrees with the closed form.
    servers, arrivals, service = 3, 2.5, 1.0
    step = 1e-3
    integral = sum(prob_wait_exceeds(servers, arrivals, service, i * step) for i in range(20000))
    assert integral * step == pytest.approx(mean_wait(servers, arrivals, service), rel=1e-2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: erlang_b(0, 1.0), "servers must be an integer >= 1"),
        (lambda: erlang_c(2, -1.0), "offered_load must be >= 0"),
        (lambda: mean_wait(2, 1.0, 0.0), "service_rate must be > 0"),
        (lambda: mean_wait(2, -1.0, 1.0), "arrival_rate must be >= 0"),
        (lambda: wait_percentile(2, 1.0, 1.0, 1.0), "quantile must be in"),
        (lambda: prob_wait_exceeds(2, 1.0, 1.0, -1.0), "wait_s must be >= 0"),
    ],
)
def test_bad_input_is_refused(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
