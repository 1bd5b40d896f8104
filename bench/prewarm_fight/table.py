"""Markdown table of the fight.sh runs given (run directory names under $OUT/runs/)."""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = Path(os.environ.get("OUT", "/tmp/prewarm_fight")) / "runs"
COLUMNS = [
    "run", "code", "replicas", "engine loads ok (failed)", "engine unloads",
    "loads / unloads after 30 s", "gw unloads by reason", "failed requests", "requests",
    "p50 s", "p95 s", "p99 s", "ok > 0.5 s", "replica-seconds over max_cpu_loras",
]
print("| " + " | ".join(COLUMNS) + " |")
print("|" + "---|" * len(COLUMNS))
for name in sys.argv[1:]:
    out = subprocess.run(
        [sys.executable, str(HERE / "summarize.py"), str(RUNS / name)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    s = json.loads(out)
    info = s["info"]
    code = info.split("(")[1].split(")")[0]
    reps = info.rsplit("replicas=", 1)[1] if "replicas=" in info else "3"
    reasons = {}
    for k, v in s["gw_unloads_total_by_reason"].items():
        r = k.split(":")[1]
        reasons[r] = reasons.get(r, 0) + int(v)
    failed = sum(s["errors"].values())
    over = round(sum(s["seconds_over_capacity_per_replica"].values()))
    cells = [
        name, code, reps, f"{s['engine_loads_ok']} ({s['engine_loads_failed']})",
        s["engine_unloads_ok"], f"{s['engine_loads_after_30s']} / {s['engine_unloads_after_30s']}",
        reasons or "-", f"{failed} {s['errors'] or ''}", s["requests"], f"{s['p50_s']:.3f}",
        f"{s['p95_s']:.3f}", f"{s['p99_s']:.3f}", s["ok_over_0.5s"], over,
    ]
    print("| " + " | ".join(str(c) for c in cells) + " |")
