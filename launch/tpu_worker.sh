#!/usr/bin/env bash
# The part of launch/tpu_vm_pod.sh that runs on each TPU VM worker (copied
# there as ~/jaxrlhf-worker.sh; not meant to be run by hand).
#
#   bash ~/jaxrlhf-worker.sh start LAUNCH_ID CONFIG WORKDIR [ARGS...]
#   bash ~/jaxrlhf-worker.sh check | status | stop [WAIT_S] | logs [LINES] [-f]
#
# Everything lives in ~/jaxrlhf: src/ (the copied repository), venv/ (Python
# and the TPU wheels), run.log (every run's output, appended), run.pid
# ("PID LAUNCH_ID" of the latest run) and run.exit ("STATUS LAUNCH_ID" once
# it ended). A run is started detached (its own session, output to run.log,
# no terminal), so a closed or dropped ssh connection does not touch it.
# gcloud re-runs the whole command on a worker whose connection dropped: a
# `start` of a launch that already started here (same LAUNCH_ID) reports
# that run instead of starting a second one, and `start` is serialised by a
# lock, so the retry waits for an install in progress.
set -euo pipefail

HOME_DIR=$HOME/jaxrlhf
SRC=$HOME_DIR/src
VENV=$HOME_DIR/venv
LOG=$HOME_DIR/run.log
PID_FILE=$HOME_DIR/run.pid
EXIT_FILE=$HOME_DIR/run.exit
ARCHIVE=$HOME/jaxrlhf-src.tar.gz
# The Python the run uses: the version the project is tested on (setup.cfg
# requires 3.11 or newer, as jax does; TPU VM images have 3.10). uv installs
# it when the image has none.
PYTHON_VERSION=3.11

worker_number() {
  # TPU_WORKER_ID where the environment has it (GKE); else the VM's metadata.
  if [ -n "${TPU_WORKER_ID:-}" ]; then
    echo "$TPU_WORKER_ID"
  else
    curl -sf -m 5 -H 'Metadata-Flavor: Google' \
      "http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number" \
      || hostname
  fi
}
WORKER="worker $(worker_number)"

say() { echo "$WORKER: $*"; }
fail() { echo "$WORKER: error: $*" >&2; exit 1; }

# The latest run's PID and launch, or nothing.
read_pid_file() {
  RUN_PID='' RUN_LAUNCH=''
  if [ -f "$PID_FILE" ]; then
    read -r RUN_PID RUN_LAUNCH <"$PID_FILE" || true
  fi
}

# Whether the latest run's process is alive (and is still our run, not a
# process that reused its PID).
run_alive() {
  read_pid_file
  [ -n "$RUN_PID" ] && kill -0 "$RUN_PID" 2>/dev/null \
    && tr '\0' ' ' <"/proc/$RUN_PID/cmdline" 2>/dev/null | grep -q jaxrlhf.main
}

last_line() {
  if [ -s "$LOG" ]; then
    tail -n 1 "$LOG"
  fi
}

refuse_if_alive() {
  if run_alive; then
    echo "$WORKER: error: a run is alive here (PID $RUN_PID, launch" \
      "$RUN_LAUNCH): stop it first (launch/tpu_vm_pod.sh stop), or follow" \
      "it (launch/tpu_vm_pod.sh logs)." >&2
    exit 3
  fi
}

ensure_uv() {
  if command -v uv >/dev/null; then
    UV=$(command -v uv)
  elif [ -x "$HOME/.local/bin/uv" ]; then
    UV=$HOME/.local/bin/uv
  else
    # pip --user works on the Ubuntu 22.04 images; the installer elsewhere.
    python3 -m pip install --user --quiet uv >>"$HOME_DIR/install.log" 2>&1 \
      || curl -LsSf https://astral.sh/uv/install.sh \
        | sh -s -- --quiet >>"$HOME_DIR/install.log" 2>&1 \
      || install_failed "installing uv"
    UV=$HOME/.local/bin/uv
  fi
}

install_failed() {
  echo "$WORKER: error: $1 failed; the end of $HOME_DIR/install.log:" >&2
  tail -n 20 "$HOME_DIR/install.log" | sed "s/^/$WORKER:   /" >&2
  exit 1
}

# Unpacks the copied repository and installs it (and jax's TPU wheels, at the
# jax version setup.cfg allows) into the venv.
install() {
  : >"$HOME_DIR/install.log"
  rm -rf "$SRC.new"
  mkdir -p "$SRC.new"
  tar -xzf "$ARCHIVE" -C "$SRC.new"
  rm -rf "$SRC"
  mv "$SRC.new" "$SRC"
  ensure_uv
  if [ ! -x "$VENV/bin/python" ]; then
    "$UV" venv --quiet --python "$PYTHON_VERSION" "$VENV" \
      >>"$HOME_DIR/install.log" 2>&1 || install_failed "creating $VENV"
  fi
  "$UV" pip install --quiet --python "$VENV/bin/python" -e "$SRC" "jax[tpu]" \
    >>"$HOME_DIR/install.log" 2>&1 || install_failed "installing jaxrlhf"
}

start() {
  [ $# -ge 3 ] || fail "start needs LAUNCH_ID CONFIG WORKDIR"
  local launch=$1 config=$2 workdir=$3
  shift 3
  mkdir -p "$HOME_DIR"
  # One start at a time: gcloud's retry of this command waits here.
  exec 9>"$HOME_DIR/start.lock"
  flock 9
  read_pid_file
  if [ "$RUN_LAUNCH" = "$launch" ]; then
    if run_alive; then
      say "this launch's run is running (PID $RUN_PID)."
    else
      say "this launch's run has ended: $(describe_exit)"
    fi
    return 0
  fi
  refuse_if_alive
  [ -f "$ARCHIVE" ] || fail "$ARCHIVE is missing (it is copied by launch/tpu_vm_pod.sh run)"
  install
  rm -f "$EXIT_FILE"
  {
    echo "=== launch $launch, $(date -u '+%Y-%m-%d %H:%M:%S UTC'):" \
      "python -m jaxrlhf.main --config=$config --workdir=$workdir" \
      "--distributed $*"
  } >>"$LOG"
  cd "$SRC"
  # A session of its own and no terminal: neither a hangup nor a closed pipe
  # reaches the run. The wrapper records the run's exit status.
  # shellcheck disable=SC2016  # expanded by the wrapper
  setsid bash -c '
    pid_file=$1 exit_file=$2 launch=$3; shift 3
    "$@" &
    echo "$! $launch" >"$pid_file"
    wait "$!" && status=0 || status=$?
    echo "$status $launch" >"$exit_file"
  ' jaxrlhf-run "$PID_FILE" "$EXIT_FILE" "$launch" \
    "$VENV/bin/python" -m jaxrlhf.main --config="$config" \
    --workdir="$workdir" --distributed "$@" \
    </dev/null >>"$LOG" 2>&1 9>&- &
  # The PID file is written by the wrapper: wait for it (under the lock).
  local _
  for _ in $(seq 100); do
    read_pid_file
    [ "$RUN_LAUNCH" = "$launch" ] && break
    sleep 0.1
  done
  [ "$RUN_LAUNCH" = "$launch" ] || fail "the run did not start; see $LOG"
  say "started (PID $RUN_PID); its output goes to $LOG"
}

describe_exit() {
  local status launch
  if [ -f "$EXIT_FILE" ] && read -r status launch <"$EXIT_FILE"; then
    echo "exit status $status"
  else
    echo "no exit status recorded (the VM restarted, or the run was killed)"
  fi
}

status() {
  if [ ! -f "$PID_FILE" ]; then
    say "no run started here."
  elif run_alive; then
    say "running (PID $RUN_PID, launch $RUN_LAUNCH) | $(last_line)"
  else
    say "not running; the last run (launch $RUN_LAUNCH) ended with" \
      "$(describe_exit) | $(last_line)"
  fi
}

stop() {
  local wait_s=${1:-900} waited=0
  if ! run_alive; then
    say "no run is alive here."
    return 0
  fi
  # The run saves a checkpoint at the next step boundary (all workers at the
  # same step) and exits.
  kill -TERM "$RUN_PID"
  while run_alive; do
    if [ "$waited" -ge "$wait_s" ]; then
      fail "the run (PID $RUN_PID) is still saving after ${wait_s} s; run stop again to wait longer"
    fi
    sleep 1
    waited=$((waited + 1))
  done
  # The wrapper records the exit status just after the run ends.
  for _ in $(seq 50); do
    [ -f "$EXIT_FILE" ] && break
    sleep 0.1
  done
  say "stopped: $(describe_exit) | $(last_line)"
}

logs() {
  local lines=100 follow=''
  for arg in "$@"; do
    case $arg in
      -f) follow=-F ;;
      *[!0-9]*|'') fail "logs takes a line count and -f, not '$arg'" ;;
      *) lines=$arg ;;
    esac
  done
  [ -f "$LOG" ] || { say "no run started here."; return 0; }
  tail -n "$lines" $follow "$LOG"
}

action=${1:-}
shift || true
case $action in
  start) start "$@" ;;
  check) mkdir -p "$HOME_DIR"; refuse_if_alive ;;
  status) status ;;
  stop) stop "$@" ;;
  logs) logs "$@" ;;
  *) fail "unknown action '$action' (start, check, status, stop, logs)" ;;
esac
