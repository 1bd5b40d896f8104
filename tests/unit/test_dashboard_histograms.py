"""The dashboard's quantiles and windows answer as Prometheus would on the same samples."""

from __future__ import annotations

import math

from gateway.dashboard.histograms import SampleWindow, histogram_quantile, snapshot

INF = math.inf


def test_quantile_interpolates_inside_the_bucket_that_holds_the_rank() -> None:
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (INF, 40.0)]
    assert histogram_quantile(0.25, buckets) == 0.1  # rank 10: the first bucket's top
    assert histogram_quantile(0.5, buckets) == 0.1 + 0.4 * (20 - 10) / (30 - 10)
    assert histogram_quantile(0.95, buckets) == 0.5 + 0.5 * (38 - 30) / (40 - 30)


def test_quantile_in_the_first_bucket_starts_from_zero_and_inf_answers_the_top_bound() -> None:
    assert histogram_quantile(0.5, [(0.3, 4.0), (INF, 4.0)]) == 0.15
    assert histogram_quantile(0.99, [(0.3, 1.0), (INF, 4.0)]) == 0.3


def test_an_empty_histogram_has_no_quantile() -> None:
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None


def test_window_subtracts_the_snapshot_at_its_start_and_survives_a_counter_reset() -> None:
    window = SampleWindow(window_s=10.0, started_at=0.0)
    series = ("c_total", {"route": "r"})

    def at(t: float, value: float) -> dict[str, float]:
        increase = window.add(snapshot(t, [(*series, value)]))
        return {"window_s": increase.at, **increase.sum_by("c_total", "route")}

    # The baseline is the newest snapshot at or before the window's start (the window's length
    # is then at least window_s), or the empty one at creation while the gateway is younger.
    assert at(5.0, 50.0) == {"window_s": 5.0, "r": 50.0}
    assert at(12.0, 80.0) == {"window_s": 12.0, "r": 80.0}  # nothing yet at or before 2 s but 0
    assert at(16.0, 90.0) == {"window_s": 11.0, "r": 40.0}  # baseline: the snapshot at 5 s
    assert at(30.0, 20.0) == {"window_s": 14.0, "r": 20.0}  # below the 16 s value: restarted


def test_buckets_are_summed_by_the_grouping_label_across_other_labels() -> None:
    shot = snapshot(
        1.0,
        [
            ("h_bucket", {"pool": "a", "replica": "0", "le": "0.5"}, 1.0),
            ("h_bucket", {"pool": "a", "replica": "1", "le": "0.5"}, 2.0),
            ("h_bucket", {"pool": "a", "replica": "0", "le": "+Inf"}, 3.0),
            ("h_bucket", {"pool": "a", "replica": "1", "le": "+Inf"}, 4.0),
        ],
    )
    assert shot.buckets_by("h", "pool") == {"a": [(0.5, 3.0), (INF, 7.0)]}
