#!/usr/bin/env bash
# Runs one jaxrlhf experiment on every worker of a TPU VM pod slice.
#
#   launch/tpu_vm_pod.sh create TPU ZONE ACCELERATOR_TYPE [--spot] [--runtime-version=V] [GCLOUD_FLAGS...]
#   launch/tpu_vm_pod.sh run TPU ZONE CONFIG WORKDIR [--config.x=y ...]
#   launch/tpu_vm_pod.sh status|stop|recreate|delete TPU ZONE
#   launch/tpu_vm_pod.sh logs TPU ZONE [WORKER] [-f]
#
# For example:
#   launch/tpu_vm_pod.sh create dro us-west4-a v5litepod-32 --spot
#   launch/tpu_vm_pod.sh run dro us-west4-a configs/dro_t5xl.py gs://bucket/dro \
#       --config.mesh.shape="(-1,4)"
#   launch/tpu_vm_pod.sh logs dro us-west4-a -f
#
# create    Requests the slice as a queued resource named TPU (how v5e, v5p
#           and v6e capacity is obtained; --spot for Spot capacity) and waits
#           until it is ACTIVE. A request can wait for hours: Ctrl-C leaves it
#           queued, and `run` waits for it. The runtime version defaults to
#           the one for the accelerator's generation.
# run       Copies the repository (the files git tracks or would track: not
#           what .gitignore excludes, nor an untracked venv) to every
#           worker, creates the Python environment there once (uv, Python
#           3.11, jax[tpu]) and starts the run on every worker with
#           --distributed (JAX finds its peers on a pod by itself),
#           detached: it outlives this command and its ssh connections, and
#           writes ~/jaxrlhf/run.log on each worker. Refused while a run is
#           alive on the slice. When the slice's queued resource was
#           preempted (SUSPENDED) or failed, it is deleted and requested
#           again first.
# status    The slice's state and, per worker, whether the run is alive and
#           its last line.
# logs      The end of a worker's run.log (worker 0 by default); -f follows.
# stop      SIGTERM to the run on every worker: all save a checkpoint at the
#           same step boundary and stop; waits until they have.
# recreate  Deletes the queued resource and requests it again with the same
#           accelerator type, runtime version and tier; waits for ACTIVE.
# delete    Deletes the queued resource (or TPU VM) and its slice.
#
# WORKDIR should be a gs:// path (or a filesystem every worker mounts): the
# run writes its checkpoints there. Running the same `run` command again
# resumes from its latest checkpoint that verifies, on the same slice or a
# recreated one. A preemption or maintenance event sends SIGTERM to the runs,
# which save a checkpoint and stop together when the grace period allows (a
# save cut short is discarded at the next start); a worker lost without a
# signal stops the others within config.train.lost_process_timeout_s. So
# after a preemption, `run` again: the slice is requested again and the run
# resumes (the lost slice's workdir lock is taken over once it is 150 s old).
# JAXRLHF_TPU_POLL_S sets how often the queued resource's state is read (30).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
POLL_S=${JAXRLHF_TPU_POLL_S:-30}
ARCHIVE_NAME=jaxrlhf-src.tar.gz

die() { echo "error: $*" >&2; exit 1; }
# A command this script refuses.
refuse() { echo "error: $*" >&2; exit 2; }
# The synopsis (no action), or one line with the action's.
usage() {
  if [ -z "${ACTION:-}" ]; then
    sed -n '4,7p' "$0" | sed 's/^# *//' >&2
    echo "(launch/tpu_vm_pod.sh --help explains each action)" >&2
  else
    echo "error: usage: $(sed -n '4,7p' "$0" | sed 's/^# *//' \
      | grep -E "tpu_vm_pod.sh ([a-z|]*\|)?${ACTION}[ |]" | head -n 1)" >&2
  fi
  exit 2
}

case ${1:-} in
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  create|run|status|logs|stop|recreate|delete) ;;
  '') usage ;;
  *) refuse "unknown action '$1': create, run, status, logs, stop, recreate or delete (launch/tpu_vm_pod.sh --help)." ;;
esac
ACTION=$1
[ $# -ge 3 ] || usage
TPU=$2 ZONE=$3
shift 3
command -v gcloud >/dev/null \
  || die "gcloud is not on PATH: install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install)."

# --- the slice ---------------------------------------------------------------

# The queued resource's state (ACTIVE, WAITING_FOR_RESOURCES, SUSPENDED, ...),
# or nothing when there is no queued resource named TPU.
queued_state() {
  local out err
  err=$(mktemp)
  if out=$(gcloud compute tpus queued-resources describe "$TPU" \
      --zone="$ZONE" --format='value(state.state)' 2>"$err"); then
    rm -f "$err"
    echo "$out"
  elif grep -q NOT_FOUND "$err"; then
    rm -f "$err"
  else
    cat "$err" >&2
    rm -f "$err"
    die "could not read the queued resource $TPU in $ZONE (gcloud's message is above)."
  fi
}

# The TPU VM's state (READY, PREEMPTED, CREATING, ...), or nothing.
node_state() {
  gcloud compute tpus tpu-vm describe "$TPU" --zone="$ZONE" \
    --format='value(state)' 2>/dev/null || true
}

default_runtime() {
  case $1 in
    v4-*) echo tpu-ubuntu2204-base ;;
    v5litepod-*) echo v2-alpha-tpuv5-lite ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
  esac
}

# Requests the queued resource TPU: ACCELERATOR_TYPE [gcloud flags...].
request() {
  local accelerator=$1 runtime=''
  shift
  local arg
  for arg in "$@"; do
    case $arg in --runtime-version=*) runtime=${arg#*=} ;; esac
  done
  if [ -z "$runtime" ]; then
    runtime=$(default_runtime "$accelerator")
    [ -n "$runtime" ] \
      || die "no default runtime version for $accelerator: pass --runtime-version=..."
    set -- "$@" "--runtime-version=$runtime"
  fi
  gcloud compute tpus queued-resources create "$TPU" --zone="$ZONE" \
    --node-id="$TPU" --accelerator-type="$accelerator" "$@"
}

wait_active() {
  local state last=''
  while :; do
    state=$(queued_state)
    if [ "$state" != "$last" ]; then
      echo "Queued resource $TPU: ${state:-gone}"
      last=$state
    fi
    case $state in
      ACTIVE) return 0 ;;
      '') die "there is no queued resource $TPU in $ZONE (launch/tpu_vm_pod.sh create makes one)." ;;
      FAILED|SUSPENDING|SUSPENDED)
        die "the queued resource $TPU is $state (gcloud compute tpus queued-resources describe $TPU --zone=$ZONE says why); launch/tpu_vm_pod.sh recreate $TPU $ZONE requests it again." ;;
    esac
    sleep "$POLL_S"
  done
}

# Deletes the queued resource and requests the same slice again.
recreate() {
  local spec
  spec=$(gcloud compute tpus queued-resources describe "$TPU" --zone="$ZONE" \
    --format=json | python3 -c '
import json, sys
q = json.load(sys.stdin)
node = q["tpu"]["nodeSpec"][0]["node"]
if "acceleratorType" not in node:
  sys.exit("error: the queued resource does not name an accelerator type; delete it and create it again.")
tier = ("--spot" if "spot" in q else "--reserved" if q.get("guaranteed", {}).get("reserved")
        else "--guaranteed" if "guaranteed" in q else "")
print(node["acceleratorType"], node["runtimeVersion"], tier)')
  local accelerator runtime tier
  read -r accelerator runtime tier <<<"$spec"
  echo "Requesting $TPU again ($accelerator, $runtime${tier:+, $tier}): deleting the old request."
  gcloud compute tpus queued-resources delete "$TPU" --zone="$ZONE" --force \
    --quiet
  # shellcheck disable=SC2086  # tier is one flag or none
  request "$accelerator" "--runtime-version=$runtime" $tier
  wait_active
}

# Makes sure the slice is up: waits for a queued request, recreates a
# preempted or failed one.
ensure_slice() {
  local state node
  state=$(queued_state)
  case $state in
    '') ;;
    ACTIVE)
      if [ "$(node_state)" = PREEMPTED ]; then
        echo "The slice $TPU was preempted."
        recreate
      fi ;;
    SUSPENDING|SUSPENDED|FAILED)
      echo "The queued resource $TPU is $state (its slice was preempted, or the request failed)."
      recreate ;;
    *) wait_active ;;
  esac
  node=$(node_state)
  case $node in
    READY) ;;
    '') die "there is no TPU $TPU in $ZONE (launch/tpu_vm_pod.sh create makes one)." ;;
    PREEMPTED) die "the TPU $TPU was preempted; it is not a queued resource, so delete it and create it again (launch/tpu_vm_pod.sh create requests one that run can recreate)." ;;
    *) die "the TPU $TPU is $node, not READY." ;;
  esac
}

# --- the workers -------------------------------------------------------------

# Runs the worker script's ACTION [ARGS...] on WORKER ("all" or a number).
on_workers() {
  local worker=$1
  shift
  gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker="$worker" \
    --command="if [ -f jaxrlhf-worker.sh ]; then bash jaxrlhf-worker.sh $(printf '%q ' "$@"); else echo \"\$(hostname): no run started here.\"; fi"
}

# Lists (NUL-separated) the repository's files that git tracks or would
# track: not what .gitignore excludes, nor an untracked virtual environment
# (a directory with a pyvenv.cfg).
repository_files() {
  cd "$REPO"
  local venvs=() v f
  while IFS= read -r -d '' v; do
    v=$(dirname "$v")
    if [ "$v" != . ]; then venvs+=("$v"); fi
  done < <(git ls-files -z --others --exclude-standard -- '*pyvenv.cfg')
  git ls-files -z --cached --others --exclude-standard | sort -zu \
    | while IFS= read -r -d '' f; do
      [ -e "$f" ] || continue  # deleted, not yet committed
      for v in ${venvs[@]+"${venvs[@]}"}; do
        case $f in "$v"/*) continue 2 ;; esac
      done
      printf '%s\0' "$f"
    done
}

run() {
  [ $# -ge 2 ] || usage
  local config=$1 workdir=$2
  shift 2
  git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1 \
    || die "$REPO is not a git checkout: run copies the files git tracks or would track."
  # The config as a path inside the repository (the workers run from its copy).
  local path=${config%%:*} suffix=''
  [ "$path" = "$config" ] || suffix=:${config#*:}
  [ -f "$path" ] || refuse "CONFIG $path: no such file."
  local dir top relative
  dir=$(cd "$(dirname "$path")" && pwd -P)
  top=$(cd "$REPO" && pwd -P)
  case $dir/ in
    "$top"/*) relative=${dir#"$top"}/$(basename "$path")
              relative=${relative#/} ;;
    *) refuse "CONFIG $path is outside the repository $REPO." ;;
  esac
  if git -C "$REPO" check-ignore -q -- "$relative"; then
    refuse "CONFIG $relative is ignored by git (.gitignore), and the workers get only the files git tracks or would track."
  fi
  config=$relative$suffix
  case $workdir in
    gs://*) ;;
    *) echo "Note: WORKDIR $workdir is not a gs:// path: it must be a directory every worker shares (an NFS mount)." ;;
  esac

  ensure_slice
  # Nothing is copied while a run is alive on the slice.
  on_workers all check \
    || die "a run is alive on $TPU (above): launch/tpu_vm_pod.sh stop $TPU $ZONE stops it."

  local tmp
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064  # expand now: tmp is local
  trap "rm -rf '$tmp'" EXIT
  (repository_files) | tar -czf "$tmp/$ARCHIVE_NAME" -C "$REPO" --null -T -
  echo "Copying the repository ($(du -h "$tmp/$ARCHIVE_NAME" | cut -f1): the files git tracks or would track) to every worker."
  gcloud compute tpus tpu-vm scp "$tmp/$ARCHIVE_NAME" "$TPU:$ARCHIVE_NAME" \
    --zone="$ZONE" --worker=all
  local launch
  launch=$(date -u +%Y%m%d-%H%M%S)-$$
  echo "Installing and starting the run on every worker (launch $launch)."
  # The worker script comes out of the archive (renamed into place: a retry
  # of this command by gcloud must not rewrite a script bash is reading).
  if ! gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all \
      --command="tar -xzf $ARCHIVE_NAME -O launch/tpu_worker.sh >jaxrlhf-worker.sh.new && mv jaxrlhf-worker.sh.new jaxrlhf-worker.sh && bash jaxrlhf-worker.sh start $(printf '%q ' "$launch" "$config" "$workdir" "$@")"; then
    die "the run did not start on every worker (above); launch/tpu_vm_pod.sh stop $TPU $ZONE stops the workers where it did."
  fi
  echo "Running on every worker of $TPU. Follow it: launch/tpu_vm_pod.sh logs $TPU $ZONE -f; its state: launch/tpu_vm_pod.sh status $TPU $ZONE; stop it (with a checkpoint): launch/tpu_vm_pod.sh stop $TPU $ZONE."
}

case $ACTION in
  create)
    if [ $# -eq 0 ] || [ "${1#-}" != "$1" ]; then usage; fi
    request "$@"
    wait_active
    echo "The slice $TPU is ready: launch/tpu_vm_pod.sh run $TPU $ZONE CONFIG WORKDIR starts a run on it." ;;
  run) run "$@" ;;
  status)
    [ $# -eq 0 ] || usage
    state=$(queued_state)
    node=$(node_state)
    echo "TPU $TPU: ${node:-no TPU VM}${state:+ (queued resource: $state)}"
    if [ "$node" = READY ]; then on_workers all status; fi ;;
  logs)
    worker=0 follow=()
    for arg in "$@"; do
      case $arg in
        -f) follow=(-f) ;;
        *[!0-9]*|'') usage ;;
        *) worker=$arg ;;
      esac
    done
    on_workers "$worker" logs 100 ${follow[@]+"${follow[@]}"} ;;
  stop)
    [ $# -eq 0 ] || usage
    on_workers all stop ;;
  recreate)
    [ $# -eq 0 ] || usage
    [ -n "$(queued_state)" ] || die "there is no queued resource $TPU in $ZONE to recreate."
    recreate ;;
  delete)
    [ $# -eq 0 ] || usage
    if [ -n "$(queued_state)" ]; then
      gcloud compute tpus queued-resources delete "$TPU" --zone="$ZONE" --force --quiet
    else
      gcloud compute tpus tpu-vm delete "$TPU" --zone="$ZONE" --quiet
    fi ;;
esac
