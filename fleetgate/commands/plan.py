"""``fleetgate plan``: capacity planning. Two tools, each in its own module under ``planning/``:

- ``fleetgate plan levers``: the roofline lever table (``planning/levers.py``);
- ``fleetgate plan capacity``: Erlang-C fleet sizing (``planning/capacity.py``).

Like the top-level CLI, a tool's module is imported only when that tool runs, so one tool's
missing or broken dependency never breaks the other.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from fleetgate.commands._args import HelpFormatter
from fleetgate.extras import PLAN, missing_extra

#: tool -> (module exposing add_arguments/run, one-line purpose), in ``--help`` order.
TOOLS: dict[str, tuple[str, str]] = {
    "levers": (
        "planning.levers",
        "Roofline lever table: what FP8/INT4, KV dtype, prefix cache and batch do to cost/latency.",
    ),
    "capacity": (
        "planning.capacity",
        "Replicas needed for a rate and a p95 TTFT SLO (Erlang C), the hockey stick, the cost.",
    ),
}

EPILOG = """\
examples:
  fleetgate plan capacity --rate 20 --slo-ttft-ms 800 --prompt-tokens 4000 \\
      --cached-fraction 0.7 --output-tokens 250 --profile h100-llama3-8b
  fleetgate plan levers --help

Run `fleetgate plan TOOL --help` for a tool's options.
"""

# Every argument after the tool name belongs to the tool's own parser, including -h. A prefix
# character that no real flag uses makes argparse treat "--help" and "--rate" as plain values,
# so the tool's parser (built only after its module is imported) sees them untouched.
_NO_OPTIONS = "\x00"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``fleetgate plan TOOL [tool options]``; the tool's options are parsed by the tool."""
    parser.epilog = EPILOG
    parser.formatter_class = HelpFormatter
    tools = parser.add_subparsers(dest="tool", metavar="TOOL", required=True)
    for name, (_module, purpose) in TOOLS.items():
        tool = tools.add_parser(name, help=purpose, add_help=False, prefix_chars=_NO_OPTIONS)
        tool.add_argument("tool_args", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    """Import the chosen tool, parse its options, run it."""
    module_name, purpose = TOOLS[args.tool]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        print(
            f"fleetgate plan {args.tool}: unavailable in this install ({module_name}: {exc})",
            file=sys.stderr,
        )
        return 2
    parser = argparse.ArgumentParser(
        prog=f"fleetgate plan {args.tool}",
        description=purpose,
        formatter_class=HelpFormatter,
    )
    module.add_arguments(parser)
    parsed = parser.parse_args(args.tool_args)
    # Checked before the tool runs, so a missing extra costs no work (fleetgate/extras.py).
    problem = missing_extra("matplotlib", PLAN, "--plot") if getattr(parsed, "plot", None) else None
    if problem is not None:
        print(f"fleetgate plan {args.tool}: {problem}", file=sys.stderr)
        return 2
    try:
        return int(module.run(parsed) or 0)
    except ArithmeticError as exc:  # each input finite, their product not (--x 1e308)
        print(
            f"fleetgate plan {args.tool}: error: these inputs give figures past what a float "
            f"holds ({type(exc).__name__}: {exc}): check the magnitudes of the numbers given",
            file=sys.stderr,
        )
        return 2
