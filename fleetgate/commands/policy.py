"""``fleetgate policy``: check a routing-policy file before it reaches a gateway.

``validate`` is meant for CI and for SREs before a rollout: every problem goes to stderr on its
own line (``file:line: path: reason (got value)``) and the exit status is 1; a valid file prints a
one-line summary and exits 0, after any warnings (``file: warning: ...`` on stderr: valid, but
probably not meant, such as tenants without a single API key, which lock every caller out).
``show`` prints the policy as the gateway will see it, defaults and derived tenant salts filled
in. ``hash-key`` turns an API key into the SHA-256 the file stores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any

import yaml

from fleetgate.commands._args import HelpFormatter
from routing.config import PolicyError, load_policy

EXAMPLES = """\
examples:
  fleetgate policy validate deploy/examples/policy.yaml
      prints "deploy/examples/policy.yaml: OK: policy v1: 2 pools ..." and exits 0, or
      each error on its own line on stderr, e.g.
      policy.yaml:42: routes[2].slo.ttft_p95_ms: must be > 0 (got -5)
      and exits 1.
  fleetgate policy show deploy/examples/policy.yaml --format json
  printf %s "$NEW_KEY" | fleetgate policy hash-key
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``validate``, ``show`` and ``hash-key``."""
    parser.epilog = EXAMPLES
    sub = parser.add_subparsers(dest="action", metavar="ACTION")

    validate = sub.add_parser(
        "validate",
        help="check policy files; exit 1 with every error if any is invalid",
        description="Validate routing-policy YAML files: structure, plugin parameters and "
        "every cross-reference. Exit status 0 when all are valid, 1 otherwise.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    validate.add_argument("files", nargs="+", metavar="FILE", help="policy YAML file")
    validate.add_argument(
        "-q", "--quiet", action="store_true", help="print nothing when a file is valid"
    )

    show = sub.add_parser(
        "show",
        help="print the validated policy with defaults filled in",
        description="Validate a policy and print it as the gateway will use it: every default "
        "filled in and each tenant's effective cache salt shown.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    show.add_argument("file", metavar="FILE", help="policy YAML file")
    show.add_argument(
        "--format", choices=("yaml", "json"), default="yaml", help="output format (default: yaml)"
    )

    sub.add_parser(
        "hash-key",
        help="print the SHA-256 of an API key read from stdin",
        description="Read one API key from standard input (not the command line, which shell "
        "history and process listings keep) and print its hex SHA-256 for api_key_sha256.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    parser.set_defaults(_parser=parser)


def _validate(files: list[str], quiet: bool) -> int:
    status = 0
    for path in files:
        try:
            policy = load_policy(path)
        except PolicyError as exc:
            status = 1
            for line in exc.errors:
                # load_policy already prefixes "file:line:"; errors without a file get one here.
                print(line if line.startswith(path) else f"{path}: {line}", file=sys.stderr)
            continue
        for warning in policy.warnings():
            print(f"{path}: warning: {warning}", file=sys.stderr)
        if not quiet:
            print(f"{path}: OK: {policy.summary()}")
    return status


def _show(path: str, fmt: str) -> int:
    try:
        policy = load_policy(path)
    except PolicyError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 1
    data = _without_passwords(policy.model_dump(mode="json"))
    for tenant, shown in zip(policy.tenants, data.get("tenants", []), strict=True):
        shown["cache_salt"] = tenant.effective_cache_salt
    if fmt == "json":
        print(json.dumps(data, indent=2))
    else:
        print(yaml.safe_dump(data, sort_keys=False), end="")
    return 0


def _without_passwords(value: Any, key: str = "") -> Any:
    """``value`` with the passwords written out in its URLs (a Redis URL's, a replica's basic
    auth) shown as ``***``: what ``show`` prints ends up in terminals, tickets and CI logs."""
    from routing.redis_clients import redacted

    if isinstance(value, dict):
        return {k: _without_passwords(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_passwords(v, key) for v in value]
    if isinstance(value, str) and "://" in value:
        return redacted(value)
    return value


def _hash_key() -> int:
    key = sys.stdin.readline().rstrip("\r\n")
    if not key:
        print("fleetgate policy hash-key: no key on standard input", file=sys.stderr)
        return 1
    print(hashlib.sha256(key.encode()).hexdigest())
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the chosen action; returns the process exit status."""
    if args.action == "validate":
        return _validate(args.files, args.quiet)
    if args.action == "show":
        return _show(args.file, args.format)
    if args.action == "hash-key":
        return _hash_key()
    args._parser.print_help(sys.stderr)
    return 2
