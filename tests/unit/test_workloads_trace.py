"""Trace format: round trip and validation errors that name the line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from traces.format import (
    TraceFormatError,
    TraceRecord,
    iter_trace,
    read_trace,
    write_trace,
    zero_outputs,
)
from traces.notes import trace_notes

RECORDS = [
    TraceRecord(0, 600, 20, (0, 1)),
    TraceRecord(1500, 512, 7, (0,), adapter="ft-03"),
]


def test_round_trip_keeps_every_field() -> None:
    buffer = io.StringIO()
    assert write_trace(RECORDS, buffer) == len(RECORDS)
    buffer.seek(0)
    assert list(iter_trace(buffer, block_size=512)) == RECORDS


def test_adapter_is_written_only_when_set() -> None:
    assert "adapter" not in RECORDS[0].to_json()
    assert '"adapter":"ft-03"' in RECORDS[1].to_json()


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"timestamp": 0'], "t.jsonl:1: not valid JSON"),
        (["[1, 2]"], "t.jsonl:1: expected a JSON object"),
        (['{"timestamp": 0, "input_length": 5}'], "missing field(s) output_length, hash_ids"),
        (
            ['{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}'],
            "t.jsonl:1: timestamp must be a finite, non-negative number of ms",
        ),
        (
            ['{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": [0]}'],
            "t.jsonl:1: timestamp must be a finite, non-negative number of ms",
        ),
        (
            ['{"timestamp": "12", "input_length": 5, "output_length": 1, "hash_ids": [0]}'],
            "t.jsonl:1: timestamp must be a finite, non-negative number of ms",
        ),
        (
            [
                '{"timestamp": 1'
                + "0" * 400
                + ', "input_length": 5, "output_length": 1, "hash_ids": [0]}'
            ],
            "t.jsonl:1: timestamp must be a finite, non-negative number of ms",
        ),
        (
            ['{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [0]}'],
            "input_length must be an integer",
        ),
        (
            ['{"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": [0]}'],
            "output_length must be >= 0",
        ),
        (
            ['{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}'],
            "hash_ids must be a list of integers",
        ),
        (
            ['{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}'],
            "2 hash_ids for input_length 1025 does not match block_size 512 (expected 3)",
        ),
        (
            [
                '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}',
                "",
                '{"timestamp": 9, "input_length": 5, "output_length": 1, "hash_ids": [0],'
                ' "adapter": ""}',
            ],
            "t.jsonl:3: adapter must be a non-empty string",
        ),
        (
            [
                '{"timestamp": 10, "input_length": 5, "output_length": 1, "hash_ids": [0]}',
                '{"timestamp": 9, "input_length": 5, "output_length": 1, "hash_ids": [0]}',
            ],
            "t.jsonl:2: timestamp 9 is before the previous line's 10",
        ),
    ],
)
def test_bad_lines_are_refused_with_their_line_number(lines: list[str], message: str) -> None:
    stream = io.StringIO("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError) as info:
        list(iter_trace(stream, "t.jsonl", block_size=512))
    assert message in str(info.value)


def test_float_timestamps_with_integer_value_are_accepted() -> None:
    line = '{"timestamp": 12.0, "input_length": 5, "output_length": 1, "hash_ids": [0]}'
    (record,) = iter_trace(io.StringIO(line))
    assert record.timestamp == 12


def test_fractional_millisecond_timestamps_are_rounded() -> None:
    lines = [
        '{"timestamp": 1200.4, "input_length": 5, "output_length": 1, "hash_ids": [0]}',
        '{"timestamp": 1200.6, "input_length": 5, "output_length": 1, "hash_ids": [0]}',
        '{"timestamp": 1300.0, "input_length": 5, "output_length": 1, "hash_ids": [0]}',
    ]
    records = list(iter_trace(io.StringIO("\n".join(lines)), "t.jsonl", block_size=512))
    assert [r.timestamp for r in records] == [1200, 1201, 1300]
    assert all(isinstance(r.timestamp, int) for r in records)


def test_a_trace_written_with_another_block_size_names_the_flag_that_reads_it() -> None:
    # 1025 tokens in 65 blocks: 16-token blocks, as some public traces use.
    line = json.dumps(
        {"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": list(range(65))}
    )
    with pytest.raises(TraceFormatError, match="pass --trace-block-size 16"):
        list(iter_trace(io.StringIO(line), "t.jsonl", block_size=512))


def test_zero_outputs_are_replayed_as_one_token_and_counted(tmp_path: Path) -> None:
    lines = [
        '{"timestamp": 0, "input_length": 5, "output_length": 0, "hash_ids": [0]}',
        '{"timestamp":1,"input_length":5,"output_length":0,"hash_ids":[0]}',
        '{"timestamp": 2, "input_length": 5, "output_length": 10, "hash_ids": [0]}',
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    records = read_trace(path, 512)
    assert [r.output_length for r in records] == [1, 1, 10]
    assert zero_outputs(path) == 2
    assert zero_outputs(path, limit=1) == 1  # only the requests replayed


def test_a_byte_order_mark_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf"
        + b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'
    )
    assert [r.input_length for r in read_trace(path, 512)] == [5]


def _records(timestamps: list[int]) -> list[TraceRecord]:
    return [TraceRecord(t, 5, 1, (0,)) for t in timestamps]


def test_notes_say_what_a_trace_probably_needs(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("")
    # Stamped in seconds: 200 requests in 199 ms is 1,000 req/s and more.
    (note,) = trace_notes(path, _records(list(range(200))))
    assert "timestamps in seconds" in note and "multiply them by 1000" in note
    (note,) = trace_notes(path, _records([5] * 200))
    assert "same timestamp" in note
    # 3-second buckets: spread them, unless they are spread already.
    bucketed = _records([3000 * (i // 10) for i in range(200)])
    (note,) = trace_notes(path, bucketed)
    assert "--arrival-spread-ms 3000" in note
    assert trace_notes(path, bucketed, arrival_spread_ms=3000) == []
    assert trace_notes(path, _records([1000 * i for i in range(200)])) == []
