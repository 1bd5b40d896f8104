"""The engine's recent inter-token latency from its cumulative ITL histogram."""

from __future__ import annotations

import pytest

from routing.recent_itl import RecentItl


def test_the_mean_covers_the_trailing_window_only() -> None:
    itl = RecentItl(window_s=2.0)
    assert itl.observe(0.0, 0.0, 0) is None  # one reading: no interval yet
    # 100 tokens at 20 ms each in the first second, then 100 at 60 ms.
    assert itl.observe(1.0, 2.0, 100) == pytest.approx(20.0)
    assert itl.observe(2.0, 8.0, 200) == pytest.approx(40.0)
    # Past the window the first second drops out: only the 60 ms tokens are left.
    assert itl.observe(3.0, 14.0, 300) == pytest.approx(60.0)
    assert itl.observe(4.0, 20.0, 400) == pytest.approx(60.0)


def test_no_tokens_in_the_window_is_unknown_and_a_counter_reset_starts_afresh() -> None:
    itl = RecentItl(window_s=1.0)
    itl.observe(0.0, 5.0, 100)
    itl.observe(1.0, 6.0, 120)
    assert itl.observe(3.0, 6.0, 120) is None  # idle: nothing decoded lately
    # The engine restarted: its counters began again from zero.
    assert itl.observe(4.0, 0.1, 2) is None
    assert itl.observe(4.5, 0.4, 12) == pytest.approx(30.0)


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_s"):
        RecentItl(window_s=0.0)
