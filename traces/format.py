"""The trace format shared by the workload generators, the fleet simulator and ``bench replay``.

One JSON object per line (the Mooncake / NVIDIA Dynamo format):

- ``timestamp``: arrival time in milliseconds since the start of the trace (non-decreasing); a
  fractional one (some tools write ``1200.4``) is rounded to the nearest millisecond;
- ``input_length``: prompt tokens;
- ``output_length``: tokens to generate; 0 (a request recorded as producing nothing) is
  replayed as 1, the least any engine generates, and the reader says how many it changed;
- ``hash_ids``: one integer per block of ``block_size`` prompt tokens (the last block may be
  partial). Equal integers mean equal content *and* equal prefix: the list is a prefix chain.

fleetgate extension: an optional ``adapter`` string names the LoRA adapter (fine-tune) that the
request targets; records without it target the base model. Other readers ignore unknown keys,
so traces with ``adapter`` stay readable by Mooncake/Dynamo tooling.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TextIO

DEFAULT_BLOCK_SIZE = 512
#: The latest timestamp read (ms): 2**53, where a float stops holding every integer (about
#: 285,000 years); anything later is a corrupt line, not a trace.
MAX_TIMESTAMP_MS = 2**53

#: Block sizes a trace is likely written with, for the hint when hash_ids do not fit.
_BLOCK_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)

_REQUIRED = ("timestamp", "input_length", "output_length", "hash_ids")
_OPTIONAL = ("adapter",)


class TraceFormatError(ValueError):
    """A trace line that does not follow the format; the message names the line."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace. See the module docstring for the meaning of each field."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = field(default_factory=tuple)
    adapter: str | None = None

    def to_json(self) -> str:
        """The record as one JSON line (no newline); ``adapter`` only when set."""
        obj: dict[str, Any] = {
            "timestamp": self.timestamp,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }
        if self.adapter is not None:
            obj["adapter"] = self.adapter
        return json.dumps(obj, separators=(",", ":"))


def blocks_for(input_length: int, block_size: int) -> int:
    """Hash ids in a prompt of ``input_length`` tokens has (the last block may be partial)."""
    return math.ceil(input_length / block_size)


def _int_field(obj: dict[str, Any], key: str, where: str, minimum: int) -> int:
    value = obj[key]
    # bool is an int subclass in Python; `true` is never a valid length.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(f"{where}: {key} must be an integer (got {value!r})")
    if value < minimum:
        raise TraceFormatError(f"{where}: {key} must be >= {minimum} (got {value})")
    return value


#: The hash ids a trace may hold: any 64-bit integer, signed or unsigned.
_MIN_ID, _MAX_ID = -(2**63), 2**64


def parse_record(line: str, where: str, block_size: int | None = None) -> TraceRecord:
    """Parse and validate one trace line; ``where`` (e.g. ``"trace.jsonl:3"``) prefixes errors.

    With ``block_size`` set, ``hash_ids`` must have exactly ``ceil(input_length / block_size)``
    entries, which catches a trace generated with a different block size.
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [key for key in _REQUIRED if key not in obj]
    if missing:
        raise TraceFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    timestamp = obj["timestamp"]
    if isinstance(timestamp, float) and math.isfinite(timestamp):
        # Some tools write 1200.0 or 1200.4: sub-millisecond arrival times change no replay.
        timestamp = round(timestamp)
    if (
        isinstance(timestamp, bool)
        or not isinstance(timestamp, int)
        or not 0 <= timestamp <= MAX_TIMESTAMP_MS
    ):
        raise TraceFormatError(
            f"{where}: timestamp must be a finite, non-negative number of ms (got {timestamp!r})"
        )
    input_length = _int_field(obj, "input_length", where, minimum=1)
    # vLLM's max_tokens is >= 1: a request recorded as generating nothing still samples one.
    output_length = max(1, _int_field(obj, "output_length", where, minimum=0))
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list):
        raise TraceFormatError(
            f"{where}: hash_ids must be a list of integers (got {type(hash_ids).__name__})"
        )
    bad = next(
        ((i, h) for i, h in enumerate(hash_ids) if isinstance(h, bool) or not isinstance(h, int)),
        None,
    )
    if bad is not None:
        raise TraceFormatError(
            f"{where}: hash_ids must be a list of integers (got {bad[1]!r} at index {bad[0]}; "
            "ids written as strings are not read as numbers)"
        )
    # Replays fold ids into 64 bits: past that range two different ids would name the same
    # content (0 and 2**64 shared a cache; the simulate review of session 46).
    wide = next(((i, h) for i, h in enumerate(hash_ids) if not _MIN_ID <= h < _MAX_ID), None)
    if wide is not None:
        raise TraceFormatError(
            f"{where}: hash_ids must fit in 64 bits, signed or unsigned (got {wide[1]} at index "
            f"{wide[0]})"
        )
    if block_size is not None and len(hash_ids) != blocks_for(input_length, block_size):
        fits = [
            b
            for b in _BLOCK_SIZES
            if b != block_size and len(hash_ids) == blocks_for(input_length, b)
        ]
        hint = (
            f"; it fits a block size of {fits[0]}: pass --trace-block-size {fits[0]}"
            if fits
            else ""
        )
        raise TraceFormatError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_length} does not match "
            f"block_size {block_size} (expected {blocks_for(input_length, block_size)}){hint}"
        )
    adapter = obj.get("adapter")
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise TraceFormatError(f"{where}: adapter must be a non-empty string (got {adapter!r})")
    return TraceRecord(timestamp, input_length, output_length, tuple(hash_ids), adapter)


def iter_trace(
    stream: Iterable[str], name: str = "<trace>", block_size: int | None = None
) -> Iterator[TraceRecord]:
    """Yield validated records from a JSONL stream; blank lines are skipped.

    Raises ``TraceFormatError`` naming ``name:line`` for the first bad line, including a
    timestamp that goes backwards (replay and simulation need arrival order).
    """
    previous = 0
    lines = enumerate(stream, start=1)
    number = 0
    while True:
        try:
            number, line = next(lines)
        except StopIteration:
            return
        except UnicodeDecodeError as exc:
            raise TraceFormatError(
                f"{name}: not UTF-8 text near line {number + 1} ({exc.reason}); a trace is "
                "JSON lines"
            ) from None
        if not line.strip():
            continue
        where = f"{name}:{number}"
        record = parse_record(line, where, block_size)
        if record.timestamp < previous:
            raise TraceFormatError(
                f"{where}: timestamp {record.timestamp} is before the previous line's {previous};"
                " traces must be sorted by timestamp (sort it first, e.g. "
                f"jq -c -s 'sort_by(.timestamp)[]' {name} > sorted.jsonl)"
            )
        previous = record.timestamp
        yield record


def read_trace(
    path: str | Path, block_size: int | None = None, limit: int | None = None
) -> list[TraceRecord]:
    """Read and validate a JSONL trace file, plain or gzip-compressed (a UTF-8 byte-order mark
    is skipped); only its first ``limit`` requests (all: None) are read, so a bad line past them
    does not stop a replay of the first ones."""
    path = Path(path)
    with _open_binary(path) as binary:
        records = iter_trace(_text_lines(binary, str(path)), str(path), block_size)
        if limit is None:
            return list(records)
        return [record for _, record in zip(range(limit), records, strict=False)]


_GZIP_MAGIC = b"\x1f\x8b"


def _open_binary(path: Path) -> BinaryIO:
    """``path`` for reading bytes: through gzip when it starts as a gzip file does (public traces
    are often shipped compressed), whatever its name."""
    with path.open("rb") as probe:
        compressed = probe.read(2) == _GZIP_MAGIC
    if compressed:
        return gzip.open(path, "rb")  # type: ignore[return-value]  # closes its file with it
    return path.open("rb")


def _text_lines(binary: Iterable[bytes], name: str) -> Iterator[str]:
    """The lines of ``binary`` as text, each decoded on its own, so that a byte that is not
    UTF-8 is reported on its own line; a byte-order mark on the first line is skipped."""
    lines = iter(binary)
    number = 0
    while True:
        try:
            raw = next(lines)
        except StopIteration:
            return
        except (OSError, EOFError) as exc:  # a gzip stream cut short or corrupt
            raise TraceFormatError(
                f"{name}: the compressed file breaks off after line {number} ({exc})"
            ) from None
        number += 1
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceFormatError(
                f"{name}:{number}: not UTF-8 text ({exc.reason}); a trace is JSON lines"
            ) from None


def zero_outputs(path: str | Path, limit: int | None = None) -> int:
    """How many of the first ``limit`` requests (all: None) of ``path`` record ``output_length``
    0 (``read_trace`` replays them as 1), for the note the commands print; 0 when the file
    cannot be scanned."""
    return _scan(path, _ZERO_OUTPUT, limit)[0]


def fractional_timestamps(path: str | Path, limit: int | None = None) -> tuple[int, str | None]:
    """How many of the first ``limit`` requests of ``path`` carry a timestamp with a fraction
    (``read_trace`` rounds it to the millisecond), and the first such one as written: a trace in
    seconds written with decimals (``1523.737``) would otherwise replay 1,000 times too fast.
    (0, None) when the file cannot be scanned."""
    return _scan(path, _FRACTIONAL_TIMESTAMP, limit)


def _scan(path: str | Path, pattern: re.Pattern[str], limit: int | None) -> tuple[int, str | None]:
    """How many of the first ``limit`` requests' lines ``pattern`` matches, and the first
    match's first group (or whole match); (0, None) when the file cannot be read."""
    count = requests = 0
    first = None
    try:
        with _open_binary(Path(path)) as binary:
            for line in _text_lines(binary, str(path)):
                if not line.strip():
                    continue
                if limit is not None and requests >= limit:
                    break
                requests += 1
                match = pattern.search(line)
                if match:
                    count += 1
                    if first is None:
                        first = match[1] if match.groups() else match[0]
    except (OSError, TraceFormatError):
        return 0, None
    return count, first


_ZERO_OUTPUT = re.compile(r'"output_length"\s*:\s*-?0\s*[,}]')
#: A timestamp written with a non-zero fraction (``1200.4``; ``1200.0`` is a whole number).
_FRACTIONAL_TIMESTAMP = re.compile(r'"timestamp"\s*:\s*(\d+\.\d*[1-9]\d*)')


def write_trace(records: Iterable[TraceRecord], out: str | Path | TextIO) -> int:
    """Write records as JSONL to a path or an open text stream; returns how many were written."""
    if isinstance(out, (str, Path)):
        with Path(out).open("w", encoding="utf-8") as stream:
            return write_trace(records, stream)
    count = 0
    for record in records:
        out.write(record.to_json())
        out.write("\n")
        count += 1
    return count
