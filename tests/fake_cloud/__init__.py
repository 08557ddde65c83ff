"""Fake `gcloud`, `uv`, `sbatch`, `srun`, `scancel` and `scontrol` for the
launcher tests: no cloud or cluster is reached.

Each fake records its arguments (`calls(root, tool)`) and does locally what
the real tool would make happen remotely:
- `gcloud compute tpus ...` keeps queued resources and TPU VMs in a state
  file; a queued resource becomes ACTIVE after a few `describe` calls, and
  then has workers, each a home directory. `tpu-vm scp` copies into the
  workers' homes; `tpu-vm ssh --command=...` runs the command with bash in
  each worker's home, with the environment a pod worker gives JAX
  (`fake_tpu_vm`). `gcloud batch jobs submit` checks the job spec and,
  with FAKE_BATCH_RUN=1, runs its container's command here as Batch would
  (retrying as its lifecycle policy says).
- `uv` (on the workers' PATH) makes a venv of this Python.
- `python` is this Python, the one running the tests: what a run's `python`
  (in Batch's image, on a Slurm node, on this machine) would be. Without
  it, `python` on PATH would be whatever is there: for a venv's tests run
  without activating it, another Python, without the packages.
- `sbatch` runs the batch script here with the environment Slurm gives it
  (on nodes of FAKE_SLURM_NODE_GPUS GPUs, 8 by default); `srun` starts the
  step's tasks as processes with Slurm's task variables; `scancel --signal`
  signals them; `scontrol show job` prints the job's record; `scontrol
  requeue` is recorded, and refused for a job Slurm may not requeue.
"""

import json
import os
import pathlib
import stat
import sys

HERE = pathlib.Path(__file__).resolve().parent
TOOLS = {"gcloud": "gcloud.py", "sbatch": "slurm.py", "srun": "slurm.py",
         "scancel": "slurm.py", "scontrol": "slurm.py"}


def _wrapper(path, script, name):
  path.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE / script} "
                  f"{name} \"$@\"\n")
  path.chmod(path.stat().st_mode | stat.S_IXUSR)


def install(root, env):
  """Puts the fakes first on env's PATH, their state in `root`; returns env."""
  root = pathlib.Path(root)
  bin_dir, worker_bin = root / "bin", root / "worker-bin"
  bin_dir.mkdir(parents=True, exist_ok=True)
  worker_bin.mkdir(exist_ok=True)
  for name, script in TOOLS.items():
    _wrapper(bin_dir / name, script, name)
  python = bin_dir / "python"
  python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
  python.chmod(python.stat().st_mode | stat.S_IXUSR)
  _wrapper(worker_bin / "uv", "uv.py", "uv")
  env = dict(env)
  env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
  env["FAKE_CLOUD"] = str(root)
  return env


def record(tool, argv, **extra):
  """Appends one call of `tool` to its log in $FAKE_CLOUD."""
  with open(pathlib.Path(os.environ["FAKE_CLOUD"]) / f"{tool}.calls", "a",
            encoding="utf-8") as f:
    f.write(json.dumps(dict(argv=list(argv), **extra)) + "\n")


def calls(root, tool):
  """The recorded calls of `tool`: a list of {"argv": [...], ...}."""
  path = pathlib.Path(root) / f"{tool}.calls"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines()]
