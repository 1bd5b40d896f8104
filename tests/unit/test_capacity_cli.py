"""``fleetgate plan``: tools are dispatched lazily and get every argument after their name."""

from __future__ import annotations

import argparse
import sys
import types

import pytest

from fleetgate.cli import main
from fleetgate.commands import plan


def test_capacity_runs_through_the_top_level_cli(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "capacity", "--rate", "5", "--slo-ttft-ms", "500", "--prompt-tokens", "1000"]
    argv += ["--output-tokens", "100", "--prefill-ms", "50"]
    assert main(argv) == 0
    assert "replicas needed: 1" in capsys.readouterr().out


def test_a_cached_fraction_beside_a_given_prefill_time_is_noted_as_unused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The planning review: the fraction was dropped in silence and the text still showed it.
    argv = ["plan", "capacity", "--rate", "5", "--slo-ttft-ms", "500", "--prompt-tokens", "1000"]
    argv += ["--output-tokens", "100", "--prefill-ms", "50", "--cached-fraction", "0.5"]
    assert main(argv) == 0
    assert "--cached-fraction changes nothing here" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_tool_help_is_the_tools_own(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "capacity", flag])
    assert info.value.code == 0
    assert "--slo-ttft-ms" in capsys.readouterr().out


def test_levers_is_imported_only_when_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, argparse.Namespace] = {}
    fake = types.ModuleType("planning.levers")

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model")
        parser.add_argument("-x", action="store_true")

    def run(args: argparse.Namespace) -> int:
        seen["args"] = args
        return 7

    fake.add_arguments, fake.run = add_arguments, run
    monkeypatch.setitem(sys.modules, "planning.levers", fake)
    assert main(["plan", "levers", "--model", "llama3-8b", "-x"]) == 7
    assert seen["args"].model == "llama3-8b"
    assert seen["args"].x is True


def test_a_missing_tool_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(plan.TOOLS, "levers", ("planning.no_such_module", "test"))
    assert main(["plan", "levers"]) == 2
    assert "fleetgate plan levers: unavailable" in capsys.readouterr().err


def test_plan_without_a_tool_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan"])
    assert info.value.code == 2



@pytest.mark.parametrize(
    "argv",
    [
        # The planning review of session 46: each input finite, a figure computed from them not.
        ["levers", "--model-params", "1e308"],  # ZeroDivisionError traceback, exit 1
        ["levers", "--mfu", "1e-320", "--json"],  # Infinity in the JSON, exit 0
        [
            "capacity", "--rate", "20", "--slo-ttft-ms", "800", "--prompt-tokens", "4000",
            "--output-tokens", "250", "--prefill-ms", "100", "--price-per-hour", "1e308",
        ],  # $inf/h, exit 0
    ],
)
def test_inputs_whose_figures_overflow_are_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert "past what" in captured.err and "inf" not in captured.out.lower()
