"""``fleetgate kernels check``: run each kernel against its reference on this machine.

What an operator runs before rolling out a new kernel version (docs/kernels.md): every case of
the sweep prints its max abs / rel error against the PyTorch reference, and the exit status is 1
if any case is out of tolerance or over its mismatch budget. On a GPU the compiled kernel runs;
without one, Triton's interpreter runs the same source on CPU, and ``--device auto`` (the
default) says on stderr that the compiled kernel was not checked. A roll-out gate on a GPU host
uses ``--device cuda``, which exits 2 rather than fall back to the interpreter.

The kernels need torch and Triton, which fleetgate's own venv does not carry (the gateway has no
use for them). If this interpreter lacks them, the check runs in the vLLM venv
(``.venv-vllm/``, or ``$FLEETGATE_VLLM_VENV``) — the environment the engines use.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys

from fleetgate.commands._args import HelpFormatter

EPILOG = """\
examples:
  fleetgate kernels check                 # the CI sweep (odd shapes, edge values, 3 dtypes)
  fleetgate kernels check --full          # + Llama-3 shapes (1-8192 tokens x 4096, 8192, 16384)
  fleetgate kernels check --full --device cuda   # the roll-out gate on a GPU host: no fallback
  fleetgate kernels check --match bf16    # only cases whose name contains 'bf16'
  fleetgate kernels check --json          # one JSON document (what the CI tests parse)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="compare each kernel with its reference; exit 1 on a "
                           "failure", epilog=EPILOG,
                           formatter_class=HelpFormatter)
    check.add_argument("--full", action="store_true",
                       help="the full sweep (minutes under the interpreter)")
    check.add_argument("--json", action="store_true", help="print one JSON document")
    check.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="auto: the GPU if there is one, else the interpreter on CPU "
                       "(with a warning: the compiled kernel is then not checked); cuda: the "
                       "compiled kernel, or exit 2 (use it to gate a roll-out)")
    check.add_argument("--match", default="", help="only cases whose name contains this")


def _forwarded(args: argparse.Namespace) -> list[str]:
    argv = ["--device", args.device]
    if args.full:
        argv.append("--full")
    if args.json:
        argv.append("--json")
    if args.match:
        argv += ["--match", args.match]
    return argv


def _has_kernel_deps() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "triton"))


def run(args: argparse.Namespace) -> int:
    argv = _forwarded(args)
    if _has_kernel_deps():
        from replica.kernels.check import main

        return main(argv)
    from replica.vllm_env import INSTALL_COMMAND, venv_python

    python = venv_python()
    if not python.exists():
        print(f"fleetgate kernels check: torch and triton are not installed here, and there is "
              f"no vLLM venv at {python.parent.parent} to run in; install it with "
              f"`{INSTALL_COMMAND}`, or run this where the engines run", file=sys.stderr)
        return 2
    print(f"(torch/triton are not in this venv: running in {python})", file=sys.stderr)
    return subprocess.call([str(python), "-m", "replica.kernels.check", *argv])
