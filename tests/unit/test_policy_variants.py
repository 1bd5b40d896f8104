"""``bench.policy_variants``: a built-in policy rebuilt with changed plugin parameters."""

from __future__ import annotations

import pytest

from bench.policy_variants import parse_variant
from routing.policies.fleet_cost import FleetCostScorer
from routing.policies.registry import builtin_profile


def test_a_variant_changes_only_the_named_parameters_of_the_plugins_that_take_them() -> None:
    variant = parse_variant("d05=fleet-cost:decode_weight=0.05,tie_tolerance=0.02")
    profile = variant.build()
    stock = builtin_profile("fleet-cost")
    scorer = profile.scorers[0][0]
    assert profile.name == "d05"
    assert isinstance(scorer, FleetCostScorer)
    assert scorer.params.decode_weight == 0.05
    assert profile.picker.params.tie_tolerance == 0.02
    unchanged = scorer.params.model_dump(exclude={"decode_weight"})
    assert unchanged == stock.scorers[0][0].params.model_dump(exclude={"decode_weight"})


def test_none_switches_an_optional_parameter_off() -> None:
    variant = parse_variant("flat=fleet-cost:decode_weight=0.03,decode_free_duty=none")
    assert variant.build().scorers[0][0].params.decode_free_duty is None


def test_each_build_is_a_fresh_profile() -> None:
    """Replays must not share learned state (calibration, arrival rate) through a variant."""
    variant = parse_variant("v=fleet-cost:duplicate_per_queued=4")
    assert variant.build().scorers[0][0] is not variant.build().scorers[0][0]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("d05", "the form is NAME=POLICY:key=value"),
        ("d05=fleet-cost", "the form is NAME=POLICY:key=value"),
        ("d05=fleet-cost:decode_weight", "bad assignment"),
        ("d05=no-such:decode_weight=1", "unknown policy 'no-such'"),
        ("d05=fleet-cost:no_such=1", "no plugin of 'fleet-cost' takes no_such"),
        ("d05=fleet-cost:decode_weight=-1", "greater than or equal to 0"),
        ("round-robin=fleet-cost:decode_weight=1", "is a built-in policy"),
    ],
)
def test_a_bad_variant_says_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_variant(spec)
