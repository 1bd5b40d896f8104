"""The ``fleetgate`` command line: one entry point, one small module per subcommand.

Each subcommand lives in ``fleetgate/commands/<name>.py`` and exposes two functions:
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only when their command
runs, so ``fleetgate --help`` stays fast and a broken optional dependency of one command never
breaks another.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import sys
import textwrap
from collections.abc import Sequence

from fleetgate.commands._args import HelpFormatter

#: The order here is the order ``--help`` shows.
#: name -> one-line purpose; the command's module is ``fleetgate.commands.<name>``.
COMMANDS: dict[str, str] = {
    "up": "Run gateway + N simulated replicas in one process (no Redis).",
    "serve": "Run the production gateway (policy YAML, Redis index).",
    "policy": "Validate or show a routing-policy YAML file; hash an API key.",
    "sim": "Run simulated vLLM replicas that speak vLLM's wire formats.",
    "agent": "Run the replica agent: KV events + metrics to the index.",
    "replica": "Start and supervise a vLLM engine with its agent.",
    "simulate": "Replay a trace through policies in virtual time.",
    "plan": "Capacity planning: roofline levers, Erlang-C sizing.",
    "triage": "Read a gateway's metrics and print the levers to pull.",
    "advise": "Advise each pool's vLLM flags from what it serves.",
    "bench": "Benchmarks: replay a trace against an OpenAI endpoint.",
    "kernels": "Check fleetgate's kernels against their references.",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; subcommand parsers are filled in lazily by ``main``."""
    parser = argparse.ArgumentParser(
        prog="fleetgate",
        description=(
            "fleetgate: a prefix-aware, adapter-aware router and gateway for fleets of vLLM "
            "replicas. Start with `fleetgate up --sim 2` for a local demo."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `fleetgate COMMAND --help` for a command's options and examples.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, purpose in COMMANDS.items():
        sub.add_parser(name, help=purpose, description=purpose, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fleetgate`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        parser = build_parser()
        if args and args[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(
                f"fleetgate: unknown command {args[0]!r}; choose from: {', '.join(COMMANDS)}",
                file=sys.stderr,
            )
            return 2
        parser.print_help()
        return 0
    name = args[0]
    purpose = COMMANDS[name]
    module = importlib.import_module(f"fleetgate.commands.{name}")
    parser = argparse.ArgumentParser(
        prog=f"fleetgate {name}",
        description=purpose,
        formatter_class=HelpFormatter,
    )
    module.add_arguments(parser)
    if parser.epilog is None and "Examples::" in (module.__doc__ or ""):
        # The command module's docstring examples, which its --help promised.
        examples = textwrap.dedent(module.__doc__.split("Examples::", 1)[1]).strip("\n")
        parser.epilog = "examples:\n" + textwrap.indent(examples, "  ")
    parsed = parser.parse_args(args[1:])
    try:
        code = int(module.run(parsed) or 0)
        sys.stdout.flush()  # here, where a full disk is reported, not at interpreter exit
        return code
    except BrokenPipeError:
        # `fleetgate plan levers --json | head`: the reader left; that is not an error.
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        if exc.errno not in _OUTPUT_ERRNOS:
            raise
        # `fleetgate simulate --json > out.json` on a full disk: one line, not a traceback. An
        # error that names a file is that file's (an input read off a failing disk).
        what = exc.filename if exc.filename is not None else "cannot write the output"
        with contextlib.suppress(OSError):
            print(f"fleetgate {name}: {what}: {exc.strerror}", file=sys.stderr)
        return 1


#: Write errors that are the output's, not the command's: a full disk or quota, a failed device.
_OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG})


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
