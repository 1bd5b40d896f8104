#!/usr/bin/env bash
# Issue 15's reliability check: the README's test command, N times in a row, each on a fresh
# clone of this repository's committed HEAD (as it was when the script started: commits made while
# it runs do not change what is tested), while another process keeps one core busy.
#
#   bash tests/fresh_clone_runs.sh [N] [WORK_DIR]      # default: 5 runs under /tmp/fresh
#
# Stops at the first failure. WORK_DIR/summary.txt gets one line per run (commit, exit status,
# wall time, pytest's summary); WORK_DIR/runK.log the whole output. No rerun plugin is installed
# (tests/run.sh installs none): a failure is a failure.
set -uo pipefail
runs=${1:-5}
work=${2:-/tmp/fresh}
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$work"
commit=$(git -C "$repo" rev-parse HEAD)
( while :; do :; done ) &
busy=$!
trap 'kill $busy 2>/dev/null' EXIT
for i in $(seq 1 "$runs"); do
  clone="$work/clone$i"
  rm -rf "$clone"
  git clone -q "$repo" "$clone" && git -C "$clone" checkout -q "$commit"
  start=$(date +%s)
  (cd "$clone" && bash .ci/run) > "$work/run$i.log" 2>&1
  status=$?
  echo "run $i commit $(git -C "$clone" rev-parse --short HEAD) rc=$status" \
       "wall=$(( $(date +%s) - start ))s $(tail -1 "$work/run$i.log")" >> "$work/summary.txt"
  rm -rf "$clone/.venv" "$clone/.venv-vllm"  # ~4 GB a run
  [ "$status" -eq 0 ] || exit "$status"
done
