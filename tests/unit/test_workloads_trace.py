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


def _line(timestamp: object, **extra: object) -> str:
    return json.dumps(
        {"timestamp": timestamp, "input_length": 5, "output_length": 1, "hash_ids": [0], **extra}
    )


def test_a_gzip_compressed_trace_is_read_as_it_is(tmp_path: Path) -> None:
    """Public traces are often shipped compressed: the simulate review found a .gz reported as
    'not UTF-8 text'."""
    import gzip

    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(("\n".join(_line(t) for t in (0, 5, 9)) + "\n").encode()))
    assert [r.timestamp for r in read_trace(path, 512)] == [0, 5, 9]
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(path.read_bytes()[:-12])  # the compressed stream breaks off
    with pytest.raises(TraceFormatError, match="breaks off"):
        read_trace(cut, 512)


def test_a_byte_that_is_not_utf8_is_named_on_its_own_line(tmp_path: Path) -> None:
    lines = [_line(t).encode() for t in range(400)]
    lines[300] = _line(300, note="cafe").encode().replace(b"cafe", b"caf\xe9")  # Latin-1
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(TraceFormatError, match=r"latin1.jsonl:301: not UTF-8 text"):
        read_trace(path, 512)


def test_a_limit_reads_only_the_requests_it_replays(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([*(_line(t) for t in range(10)), _line(-1)]) + "\n")
    assert len(read_trace(path, 512, limit=10)) == 10  # the bad 11th line is never read
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:11"):
        read_trace(path, 512)


def test_errors_show_the_value_and_the_way_out() -> None:
    with pytest.raises(TraceFormatError, match=r"got '0' at index 0"):
        list(iter_trace(io.StringIO(_line(0).replace("[0]", '["0"]')), "t.jsonl"))
    unsorted = "\n".join([_line(10), _line(9)])
    with pytest.raises(TraceFormatError, match=r"jq -c -s 'sort_by\(.timestamp\)\[\]'"):
        list(iter_trace(io.StringIO(unsorted), "t.jsonl"))


@pytest.mark.parametrize("wide", [2**64, -(2**63) - 1])
def test_a_hash_id_past_64_bits_is_refused(wide: int) -> None:
    """The simulate review of session 46: ids are folded into 64 bits, and 0 and 2**64 named
    the same content (a trace without reuse showed a 42.7% hit rate)."""
    with pytest.raises(TraceFormatError, match=rf"fit in 64 bits.*got {wide} at index 0"):
        list(iter_trace(io.StringIO(_line(0).replace("[0]", f"[{wide}]")), "t.jsonl"))
    for edge in (2**64 - 1, -(2**63)):  # both ends of the range read
        assert list(iter_trace(io.StringIO(_line(0).replace("[0]", f"[{edge}]")), "t.jsonl"))


def test_timestamps_in_seconds_are_noted_however_few_or_fractional(tmp_path: Path) -> None:
    # Seconds written with decimals, 300 requests over 25 minutes: read as ms, a 197 req/s burst.
    stamps = [round(5.1 * i + 0.737, 3) for i in range(300)]
    path = tmp_path / "seconds.jsonl"
    path.write_text("\n".join(_line(t) for t in stamps) + "\n")
    (note,) = trace_notes(path, read_trace(path, 512))
    assert "timestamps have a fraction" in note and "multiply them by 1000" in note
    # Whole seconds, five requests each, seen on too few requests for the rate test.
    few = tmp_path / "few.jsonl"
    few.write_text("")
    (note,) = trace_notes(few, _records([i // 5 for i in range(60)]))
    assert "timestamps in seconds" in note and "--arrival-spread-ms" not in note
