"""Same-run A/B of two trees: bench.gateway_overhead with a second fleetgate target.

Run from the "after" checkout with PYTHONPATH set to it and BEFORE naming the "before" checkout
(e.g. ``git worktree add /tmp/before <commit>``):

    cd /tmp/after && BEFORE=/tmp/before PYTHONPATH=/tmp/after /work/main/.venv/bin/python \
        docs/benchmarks/request-path/ab_overhead.py --no-routers --workers2 --latency-rounds 20 \
        --output /tmp/ab.md

``--workers2`` adds a second fleetgate target; here that target is the before tree's
``fleetgate serve --workers 1``, so both gateways face the same simulated replicas, the same
requests and the same shuffled round order. The "fleetgate" row is the after tree,
"fleetgate (before)" the before tree.
"""
import os
import sys

import bench.gateway_overhead as g
import gateway

BEFORE = os.environ["BEFORE"]
assert not gateway.__path__[0].startswith(BEFORE), gateway.__path__
_original = g.fleetgate_proc


def fleetgate_proc(replicas, log_dir, *, workers=1, extra=(), python_prefix=()):
    if workers != 2:
        return _original(replicas, log_dir, workers=workers, extra=extra)
    check = (
        "import sys, gateway; "
        f"assert gateway.__path__[0].startswith({BEFORE!r}), gateway.__path__; "
        "from fleetgate.cli import main; sys.argv[0] = 'fleetgate'; sys.exit(main())"
    )
    # -P: not the current directory (the after tree) first on sys.path.
    prefix = [sys.executable, "-P", "-c", check]
    proc = _original(replicas, log_dir, workers=1, extra=extra, python_prefix=prefix)
    proc.env = {"PYTHONPATH": BEFORE}
    return proc


g.fleetgate_proc = fleetgate_proc
g.router_versions = lambda: {}
_run = g.run


async def run(args, log_dir):
    result = await _run(args, log_dir)
    for target in result["targets"]:
        if target.name == "fleetgate --workers 2":
            target.name = "fleetgate (before)"
    return result


g.run = run
raise SystemExit(g.main(sys.argv[1:]))
