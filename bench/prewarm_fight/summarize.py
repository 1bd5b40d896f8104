"""Summarise one fight.sh run directory (engine events, gateway metrics, requests)."""

import json
import re
import sys
from collections import Counter
from pathlib import Path

run = Path(sys.argv[1])
t0 = float((run / "t_start").read_text())
t1 = float((run / "t_end").read_text())
events_text = (run / "engine_events.jsonl").read_text()
ev = [json.loads(line) for line in events_text.splitlines() if line.strip()]
loads_ok = [e for e in ev if e["kind"] == "load" and e["status"] == 200]
loads_bad = [e for e in ev if e["kind"] == "load" and e["status"] != 200]
unloads_ok = [e for e in ev if e["kind"] == "unload" and e["status"] == 200]
unloads_bad = [e for e in ev if e["kind"] == "unload" and e["status"] != 200]


def late(es):
    """Past the first 30 s (the initial cold loads)."""
    return [e for e in es if e["t"] >= t0 + 30]



def metric(name, label=None):
    out = Counter()
    for gw in ("A", "B"):
        for line in (run / f"metrics_gw{gw}.txt").read_text().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                m = re.match(r"([^{ ]+)(\{[^}]*\})?\s+(\S+)", line)
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
                key = (gw, labels.get(label, "")) if label else (gw, "")
                out[key] += float(m.group(3))
    return out


reqs = [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines() if line]
lat = sorted(r["latency"] for r in reqs if r["status"] == 200)


def pct(xs, p):
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


errors = Counter((r["status"], r.get("code")) for r in reqs if r["status"] != 200)
slow = [r for r in reqs if r["status"] == 200 and r["latency"] > 0.5]
s = {
    "run": run.name,
    "info": (run / "info.txt").read_text().strip(),
    "engine_loads_ok": len(loads_ok),
    "engine_loads_failed": len(loads_bad),
    "engine_unloads_ok": len(unloads_ok),
    "engine_unloads_failed": len(unloads_bad),
    "engine_loads_after_30s": len(late(loads_ok)),
    "engine_unloads_after_30s": len(late(unloads_ok)),
    "engine_loads_by_adapter": dict(Counter(e["adapter"] for e in loads_ok)),
    "gw_loads_total_by_outcome": {
        f"{k[0]}:{k[1]}": v for k, v in metric("fleetgate_adapter_loads_total", "outcome").items()
    },
    "gw_unloads_total_by_reason": {
        f"{k[0]}:{k[1]}": v for k, v in metric("fleetgate_adapter_unloads_total", "reason").items()
    },
    "gw_cold_start_count": {
        f"{k[0]}": v for k, v in metric("fleetgate_adapter_cold_start_seconds_count").items()
    },
    "gw_thrash_events": {
        f"{k[0]}": v for k, v in metric("fleetgate_adapter_thrash_events_total").items()
    },
    "requests": len(reqs),
    "ok": len(lat),
    "errors": {f"{k[0]} {k[1]}": v for k, v in errors.items()},
    "p50_s": pct(lat, 50),
    "p95_s": pct(lat, 95),
    "p99_s": pct(lat, 99),
    "max_s": lat[-1] if lat else None,
    "ok_over_0.5s": len(slow),
    "ok_over_0.5s_by_herd": dict(Counter(r["herd"] for r in slow)),
    "drive_s": round(t1 - t0, 1),
}
# Residency per replica replayed from the engine's successful load/unload calls (at completion).
res, peak = {}, Counter()
over_s = Counter()
last_t = {}
cap = 2
for e in sorted(loads_ok + unloads_ok, key=lambda e: e["t"] + e["secs"]):
    t = e["t"] + e["secs"]
    here = res.setdefault(e["port"], set())
    if len(here) > cap and e["port"] in last_t:
        over_s[e["port"]] += t - last_t[e["port"]]
    (here.add if e["kind"] == "load" else here.discard)(e["adapter"])
    last_t[e["port"]] = t
    peak[e["port"]] = max(peak[e["port"]], len(here))
for port, here in res.items():  # still over at the end of the run
    if len(here) > cap:
        over_s[port] += t1 - last_t[port]
s["peak_resident_per_replica"] = dict(peak)
s["seconds_over_capacity_per_replica"] = {k: round(v, 1) for k, v in over_s.items()}
print(json.dumps(s, indent=1))
