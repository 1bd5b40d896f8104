"""``bench.flow_control --trace``: a real trace replayed beside the generated workloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import flow_control


def _trace(path: Path, requests: int) -> Path:
    with path.open("w") as f:
        for i in range(requests):
            record = {"timestamp": i * 100, "input_length": 600, "output_length": 20,
                      "hash_ids": [0, i + 1]}
            f.write(json.dumps(record) + "\n")
    return path


def test_a_trace_subject_is_named_by_its_file_and_cut_to_the_limit(tmp_path: Path) -> None:
    traces = flow_control.trace_subjects([str(_trace(tmp_path / "conversation.jsonl", 10))], 4)
    assert list(traces) == ["conversation"]
    assert [r.timestamp for r in traces["conversation"]] == [0, 100, 200, 300]


def test_a_missing_trace_is_a_usage_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        flow_control.main(["--workloads", "", "--trace", str(tmp_path / "nope.jsonl")])
    assert exited.value.code == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_a_trace_is_replayed_with_and_without_flow_control(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "tiny.jsonl", 40)
    page = tmp_path / "fc.md"
    flow_control.main(
        ["--workloads", "", "--scales", "1", "--trace", str(trace), "--out", str(page)]
    )
    text = page.read_text()
    assert "`tiny` (40 requests)" in text
    assert "| tiny |" in text
