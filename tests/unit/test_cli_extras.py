"""Without the ``[plan]``/``[bench]`` extras the CLI says what to install (fleetgate/extras.py).

matplotlib and tqdm are hidden by a ``None`` entry in ``sys.modules``: Python's own way to make
an import fail, so the check runs in this process whether or not they are installed here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fleetgate.cli import main
from fleetgate.extras import BENCH, progress_available

CAPACITY = [
    "plan", "capacity", "--rate", "20", "--slo-ttft-ms", "800", "--prompt-tokens", "4000",
    "--output-tokens", "250", "--profile", "h100-llama3-8b",
]


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)


@pytest.mark.parametrize(
    "argv",
    [
        [*CAPACITY, "--plot", "{out}/capacity.png"],
        ["plan", "levers", "--plot", "{out}/levers.png"],
        ["simulate", "--trace", "{out}/never-read.jsonl", "--plot", "{out}/plots"],
    ],
    ids=["plan-capacity", "plan-levers", "simulate"],
)
def test_a_plot_without_matplotlib_stops_before_any_work_and_names_the_extra(
    argv: list[str], tmp_path: Path, no_matplotlib: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([a.format(out=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib, which is not installed: pip install 'fleetgate[plan]'" in err
    assert list(tmp_path.iterdir()) == []  # nothing written, the trace not even opened


def test_the_same_command_without_plot_runs(
    no_matplotlib: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(CAPACITY) == 0
    assert "fleetgate[plan]" not in capsys.readouterr().err


def test_no_tqdm_means_no_progress_bar_and_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert not progress_available(BENCH, "fleetgate bench replay")
    assert capsys.readouterr().err == (
        "fleetgate bench replay: no progress bar "
        "(tqdm is not installed: pip install 'fleetgate[bench]')\n"
    )
