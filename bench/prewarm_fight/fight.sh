#!/usr/bin/env bash
# Two gateways on one Redis, three LoRA sim replicas, two herds asking for disjoint adapters.
# env NREP: sim replicas (default 3), each --max-loras 1 (host cache 2).
# usage: fight.sh LABEL CODE_DIR [DURATION_S=110] [RATE_PER_HERD=2] [PREWARM_S=10] [SEED=7]
#   CODE_DIR: the fleetgate tree the GATEWAYS run (PYTHONPATH); the sims always run this repo's.
# env OUT: where runs/LABEL/ goes (default /tmp/prewarm_fight). docs/benchmarks/adapters-two-gateways.md
set -u
LABEL=$1; CODE=$2; DUR=${3:-110}; RATE=${4:-2}; PREWARM=${5:-10}; SEED=${6:-7}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PY=$REPO/.venv/bin/python
OUT=${OUT:-/tmp/prewarm_fight}
RUN=$OUT/runs/$LABEL
REDIS_PORT=26301; SIM_PORT=26310; GWA=26320; GWB=26321
NREP=${NREP:-3}
REPS=$(seq 0 $((NREP-1)))
URLS=$(for i in $REPS; do printf "http://127.0.0.1:%s, " $((SIM_PORT+i)); done); URLS=${URLS%, }
rm -rf "$RUN"; mkdir -p "$RUN"
for p in $REDIS_PORT $(for i in $REPS; do echo $((SIM_PORT+i)); done) $GWA $GWB; do
  if ss -ltn | awk '{print $4}' | grep -q ":$p\$"; then echo "port $p busy" >&2; exit 1; fi
done
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null
  done
  redis-cli -p $REDIS_PORT shutdown nosave >/dev/null 2>&1
}
trap cleanup EXIT

echo "== $LABEL: code=$CODE ($(git -C "$CODE" rev-parse --short HEAD)) dur=${DUR}s rate=${RATE}/s/herd prewarm=${PREWARM}s seed=$SEED replicas=$NREP" | tee "$RUN/info.txt"
redis-server --port $REDIS_PORT --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
  --pidfile "$RUN/redis.pid" --logfile "$RUN/redis.log"
sleep 0.5; redis-cli -p $REDIS_PORT ping >/dev/null || { echo "redis failed" >&2; exit 1; }

(cd "$REPO" && exec env PYTHONPATH="$REPO" $PY $HERE/sim_counted.py $NREP $SIM_PORT 1 "$RUN/engine_events.jsonl") \
  >"$RUN/sim.log" 2>&1 &
PIDS+=($!)
for i in $REPS; do
  for _ in $(seq 1 100); do curl -sf localhost:$((SIM_PORT+i))/health >/dev/null && break; sleep 0.2; done
done

cat >"$RUN/policy.yaml" <<YAML
version: 1
replica_pools:
  - name: sims
    replicas: [$URLS]
    max_loras: 1          # sim --max-loras 1
    max_cpu_loras: 2      # the sim's host cache (2 x max_loras)
models:
  - name: sim-model
    pools: [sims]
gateway:
  health_check_interval_s: 1
tenants:
  - name: acme
    api_key_sha256: [819685611e044dc4918e558945f580790befd0786cc2fb36e3417477ed704a3d]   # sk-acme-1
  - name: globex
    api_key_sha256: [1877e953ed0fed17a7ae6d0c5600a90fd8d0797b1ac09ce2066d2451838a01e8]   # sk-globex-1
adapters:
  - {name: acme-x, base_model: sim-model, source: /adapters/acme/x, rank: 8, size_mb: 160, owners: [acme]}
  - {name: acme-y, base_model: sim-model, source: /adapters/acme/y, rank: 8, size_mb: 160, owners: [acme]}
  - {name: globex-z, base_model: sim-model, source: /adapters/globex/z, rank: 8, size_mb: 160, owners: [globex]}
  - {name: globex-w, base_model: sim-model, source: /adapters/globex/w, rank: 8, size_mb: 160, owners: [globex]}
YAML
(cd "$REPO" && PYTHONPATH=$CODE $PY -m fleetgate.cli policy validate "$RUN/policy.yaml" >"$RUN/validate.txt" 2>&1; true)

for gw in A:$GWA B:$GWB; do
  name=${gw%%:*}; port=${gw##*:}
  (cd "$RUN" && exec env PYTHONPATH=$CODE PREWARM_S=$PREWARM $PY $HERE/serve_wrap.py serve \
      --config "$RUN/policy.yaml" --redis redis://127.0.0.1:$REDIS_PORT/0 --host 127.0.0.1 --port $port) \
    >"$RUN/gw$name.log" 2>&1 &
  PIDS+=($!)
done
for port in $GWA $GWB; do
  for _ in $(seq 1 150); do curl -sf localhost:$port/ready >/dev/null && break; sleep 0.2; done
  curl -sf localhost:$port/ready >/dev/null || { echo "gateway $port not ready" >&2; exit 1; }
done
date +%s.%N >"$RUN/t_start"
$PY $HERE/herds.py http://127.0.0.1:$GWA http://127.0.0.1:$GWB "$DUR" "$RATE" "$SEED" "$RUN/requests.jsonl" \
  >"$RUN/herds.log" 2>&1
date +%s.%N >"$RUN/t_end"
sleep 1
curl -s localhost:$GWA/metrics >"$RUN/metrics_gwA.txt"
curl -s localhost:$GWB/metrics >"$RUN/metrics_gwB.txt"
for i in $REPS; do
  echo "replica $((SIM_PORT+i)): $(curl -s localhost:$((SIM_PORT+i))/v1/models | $PY -c 'import json,sys; print([m["id"] for m in json.load(sys.stdin)["data"] if m.get("parent")])')"
done >"$RUN/final_residency.txt"
redis-cli -p $REDIS_PORT --scan --pattern '*traffic*' >"$RUN/redis_traffic_keys.txt"
redis-cli -p $REDIS_PORT hgetall 'fleetgate:adapters:traffic' >>"$RUN/redis_traffic_keys.txt"
$PY $HERE/summarize.py "$RUN" | tee "$RUN/summary.txt"
