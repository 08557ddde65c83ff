#!/usr/bin/env bash
# Runs one jaxrlhf experiment on every host of a TPU VM pod slice.
#
#   launch/tpu_vm_pod.sh TPU_NAME ZONE CONFIG WORKDIR [--config.x=y ...]
#
# WORKDIR should be a gs:// path (every file of the run is written through
# etils.epath / tf.io.gfile) so all hosts share checkpoints. The repository is
# copied to every host, installed with the TPU wheels, and started with
# --distributed (JAX finds its peers on TPU pods by itself). Re-running the
# command resumes from the latest checkpoint that verifies.
#
# Preemption: a maintenance event or the preemption of a spot/preemptible
# slice sends SIGTERM to the processes; whichever hosts receive it, all of
# them stop at the same step boundary after saving a checkpoint (a save cut
# short by the grace period is discarded at the next start). A host lost
# without a signal stops the others within config.train.lost_process_timeout_s
# in one line. Closing this script's ssh sessions sends SIGHUP, which saves
# and stops the same way. Re-run the same command (on a new slice if need be):
# the old slice's workdir lock is taken over once it is 150 s old.
set -euo pipefail
if [ $# -lt 4 ]; then
  sed -n '2,19p' "$0"; exit 2
fi
TPU_NAME=$1; ZONE=$2; CONFIG=$3; WORKDIR=$4; shift 4
REPO_DIR=$(cd "$(dirname "$0")/.." && pwd)
ARCHIVE=$(mktemp -d)/jaxrlhf.tar.gz
tar -czf "$ARCHIVE" -C "$REPO_DIR" --exclude=.git .
gcloud compute tpus tpu-vm scp "$ARCHIVE" "$TPU_NAME":~/jaxrlhf.tar.gz \
  --zone="$ZONE" --worker=all
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all \
  --command="mkdir -p ~/jaxrlhf && tar -xzf ~/jaxrlhf.tar.gz -C ~/jaxrlhf && \
    cd ~/jaxrlhf && pip install -q -e . 'jax[tpu]==0.10.2' && \
    python -m jaxrlhf.main --config=$CONFIG --workdir=$WORKDIR --distributed $*"
