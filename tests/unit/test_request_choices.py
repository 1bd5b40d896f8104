"""A request for ``n`` answers: its usage counts the output tokens of all of them, decoded side
by side, so its time per output token is the decode time over one answer's tokens. Before,
``n=4`` reported a quarter of the real TPOT (13 against 51 ms in the review that found it),
and the SLO accounting and flow control's inter-token bound believed it."""

from __future__ import annotations

import pytest

from gateway.proxy import UpstreamOutcome
from gateway.request.route import choices_of


@pytest.mark.parametrize(
    ("body", "choices"),
    [
        ({"n": 4}, 4), ({}, 1), ({"n": 0}, 1), ({"n": True}, 1), ({"n": "4"}, 1), ({"n": None}, 1),
        # A completions batch decodes each prompt's answers side by side too (the diff review).
        ({"prompt": ["a", "b", "c"]}, 3), ({"prompt": ["a", "b"], "n": 2}, 4),
        ({"prompt": [[1, 2], [3]]}, 2), ({"prompt": [1, 2, 3]}, 1), ({"prompt": "a"}, 1),
    ],
)
def test_choices_are_read_from_n(body: dict[str, object], choices: int) -> None:
    assert choices_of({"model": "m", **body}) == choices


def test_tpot_divides_the_decode_time_by_one_answers_tokens() -> None:
    # 1 s from the send to the end, the first token after 0.05 s: 0.95 s of decode.
    outcome = UpstreamOutcome(sent_at=10.0, ttft_s=0.05, finished_at=11.0)
    one = outcome.tpot_ms(20)
    four = outcome.tpot_ms(80, choices=4)  # four answers of 20 tokens each
    assert one == pytest.approx(950.0 / 19)
    assert four == pytest.approx(one)
    assert outcome.tpot_ms(4, choices=4) is None  # one token per answer: no second token
