r"""Submits a jaxrlhf run as a GCP Batch job (one VM with GPUs).

  python launch/gcp_batch.py --name=dro-t5l --config=configs/quickstart.py \
      --workdir=gs://bucket/runs/dro-t5l --image=us-docker.pkg.dev/.../jaxrlhf \
      --machine_type=a3-highgpu-8g --gpu_type=nvidia-h100-80gb --gpu_count=8 \
      -- --config.train.num_steps=20000

Writes the job spec to <name>.batch.json and, with --submit, runs
`gcloud batch jobs submit`. The container image must have the repository
installed (`pip install -e . "jax[cuda13]"`). Batch retries a preempted task
(max_retry_count; a preempted Spot VM counts as a failed task) on a new VM;
the run resumes from the latest checkpoint in --workdir that verifies, which
should be a gs:// path. A preemption sends SIGTERM first, and the run saves
a checkpoint at the next step boundary if the VM lives that long; a save cut
short is discarded at the next start. The lock the lost VM left in the
workdir is taken over once it is 150 s old (a retry that comes sooner is
refused in one line and counts as a failed try).
"""

import argparse
import json
import shlex
import subprocess
import sys


def job_spec(args, overrides):
  command = ["python", "-m", "jaxrlhf.main", f"--config={args.config}",
             f"--workdir={args.workdir}", *overrides]
  return {
      "taskGroups": [{
          "taskCount": 1,
          "taskSpec": {
              "runnables": [{"container": {
                  "imageUri": args.image,
                  "commands": ["bash", "-c", shlex.join(command)],
                  "options": "--gpus all",
              }}],
              "maxRetryCount": args.max_retry_count,
              "maxRunDuration": f"{args.max_run_hours * 3600}s",
          },
      }],
      "allocationPolicy": {
          "instances": [{
              "installGpuDrivers": True,
              "policy": {
                  "machineType": args.machine_type,
                  "provisioningModel": "SPOT" if args.spot else "STANDARD",
                  "accelerators": [{"type": args.gpu_type,
                                    "count": args.gpu_count}],
              },
          }],
      },
      "logsPolicy": {"destination": "CLOUD_LOGGING"},
  }


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  overrides = []
  if "--" in argv:
    i = argv.index("--")
    argv, overrides = argv[:i], argv[i + 1:]
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--name", required=True)
  p.add_argument("--config", required=True)
  p.add_argument("--workdir", required=True)
  p.add_argument("--image", required=True)
  p.add_argument("--machine_type", default="a3-highgpu-8g")
  p.add_argument("--gpu_type", default="nvidia-h100-80gb")
  p.add_argument("--gpu_count", type=int, default=8)
  p.add_argument("--spot", action="store_true")
  p.add_argument("--max_retry_count", type=int, default=3)
  p.add_argument("--max_run_hours", type=int, default=72)
  p.add_argument("--location", default="us-central1")
  p.add_argument("--submit", action="store_true")
  args = p.parse_args(argv)
  path = f"{args.name}.batch.json"
  with open(path, "w") as f:
    json.dump(job_spec(args, overrides), f, indent=2)
  print(f"Wrote {path}")
  submit = ["gcloud", "batch", "jobs", "submit", args.name,
            f"--location={args.location}", f"--config={path}"]
  if args.submit:
    subprocess.run(submit, check=True)
  else:
    print("Submit with: " + shlex.join(submit))


if __name__ == "__main__":
  main()
