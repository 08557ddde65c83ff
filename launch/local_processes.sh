#!/usr/bin/env bash
# Runs one jaxrlhf experiment as several processes on this machine, joined by
# jax.distributed (on the CPU with gloo collectives), as a multi-host run is.
#
#   launch/local_processes.sh NUM_PROCESSES CONFIG WORKDIR [--config.x=y ...]
#
# For example, 2 processes, each with 1 CPU device:
#   launch/local_processes.sh 2 configs/quickstart.py /tmp/mp
#
# Process 0 prints the run's console; the others' output goes to a log file
# each, shown (its last lines) only when that process fails. When one process
# fails, the others are stopped (SIGTERM; then SIGKILL after
# JAXRLHF_STOP_GRACE_S seconds, 60), and this command exits with the failed
# one's status. Ctrl-C or a SIGTERM to this command reaches every process:
# they save a checkpoint at the same step boundary and stop, and running the
# same command again resumes. The coordinator listens on 127.0.0.1, at
# JAXRLHF_PORT or a free port; PYTHON names the Python (python).
set -euo pipefail

usage() {
  echo "error: usage: $(sed -n '5p' "$0" | sed 's/^# *//')" >&2
  exit 2
}
[ $# -ge 3 ] || usage
count=$1 config=$2 workdir=$3
shift 3
case $count in
  ''|*[!0-9]*|0) echo "error: NUM_PROCESSES must be a positive number, got '$count'." >&2; exit 2 ;;
esac
python=${PYTHON:-python}
grace_s=${JAXRLHF_STOP_GRACE_S:-60}
port=${JAXRLHF_PORT:-$("$python" -c '
import socket
with socket.socket() as s:
  s.bind(("127.0.0.1", 0))
  print(s.getsockname()[1])')}

logs=$(mktemp -d)
pids=()
cleanup() {
  local pid
  for pid in ${pids[@]+"${pids[@]}"}; do
    kill -KILL "$pid" 2>/dev/null || true
  done
  rm -rf "$logs"
}
trap cleanup EXIT

signal_all() {
  local pid
  for pid in "${pids[@]}"; do kill "-$1" "$pid" 2>/dev/null || true; done
}
# Ctrl-C and SIGTERM reach every process as a SIGTERM (background processes
# of a script ignore SIGINT until the run sets its own handler).
trap 'signal_all TERM' INT TERM

for ((i = 0; i < count; i++)); do
  command=("$python" -m jaxrlhf.main --config="$config" --workdir="$workdir"
           --coordinator_address="127.0.0.1:$port" --num_processes="$count"
           --process_id="$i" --cpu_collectives=gloo "$@")
  if [ "$i" = 0 ]; then
    "${command[@]}" &
  else
    "${command[@]}" >"$logs/process-$i.log" 2>&1 &
  fi
  pids+=("$!")
done

# Waits for every process; the first one to fail stops the others.
running=$count failed='' status=0 ended=() kill_at=''
while [ "$running" -gt 0 ]; do
  if [ -n "$kill_at" ] && [ "$SECONDS" -ge "$kill_at" ]; then
    signal_all KILL
  fi
  for ((i = 0; i < count; i++)); do
    [ -z "${ended[$i]:-}" ] || continue
    state=$(ps -o stat= -p "${pids[$i]}" 2>/dev/null || true)
    case $state in ''|Z*) ;; *) continue ;; esac
    wait "${pids[$i]}" && code=0 || code=$?
    ended[i]=$code
    running=$((running - 1))
    if [ "$code" != 0 ] && [ -z "$failed" ]; then
      failed=$i status=$code
      if [ "$running" -gt 0 ]; then
        signal_all TERM
        kill_at=$((SECONDS + grace_s))
      fi
    fi
  done
  sleep 0.2
done
if [ -n "$failed" ] && [ "$failed" != 0 ]; then
  echo "error: process $failed of $count failed (exit status $status); the end of its output:" >&2
  tail -n 5 "$logs/process-$failed.log" | sed 's/^/  /' >&2
fi
exit "$status"
