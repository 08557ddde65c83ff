r"""Submits a jaxrlhf run as a GCP Batch job (one VM with GPUs).

  python launch/gcp_batch.py --name=dro-t5l --config=configs/dro_t5l.py \
      --workdir=gs://bucket/runs/dro-t5l \
      --image=us-docker.pkg.dev/PROJECT/REPO/jaxrlhf:cuda13 \
      --machine_type=a3-highgpu-8g --gpu_type=nvidia-h100-80gb --gpu_count=8 \
      --spot --submit -- --config.train.num_steps=20000

Writes the job spec to --spec_out (by default <name>.batch.json in a new
temporary directory, outside this repository, whose files
launch/tpu_vm_pod.sh run copies to TPU workers) and, with --submit,
submits it with `gcloud batch jobs submit`, then prints the job's console page and the
commands that follow its state and logs. The image is built from this
repository's Dockerfile (its header says how); the job runs
`python -m jaxrlhf.main --config=CONFIG --workdir=WORKDIR [overrides]` in
it, whatever the image's own entrypoint.

Retries: Batch retries the task only when its VM was preempted (exit code
50001), up to --max_retry_count times, each time on a new VM that resumes
from the latest checkpoint in --workdir that verifies; so --workdir must be
a gs:// path. Any other failure ends the job at once: a refused config
(exit 2) or a failed run (exit 1) would fail the same way again. A
preemption sends SIGTERM first, and the run saves a checkpoint at the next
step boundary if the VM lives that long; a save cut short is discarded at
the next start. The lock the lost VM left in the workdir is taken over once
it is 150 s old (a retry that comes sooner is refused in one line, and the
job fails: submit it again).
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Batch's exit code for a task whose VM was preempted.
PREEMPTED = 50001
# Batch's rule for job names (its API refuses any other).
JOB_NAME = re.compile(r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$")
# Cloud Storage's rule for bucket names: lowercase letters, digits, "-", "_"
# and ".", starting and ending with a letter or digit, 3-63 characters (up
# to 222 with dots, each dot-separated part at most 63).
BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]*[a-z0-9]$")


def job_spec(args, overrides):
  """The Batch v1 job: one task running our command in the image."""
  container = {
      "imageUri": args.image,
      "entrypoint": "python",
      "commands": ["-m", "jaxrlhf.main", f"--config={args.config}",
                   f"--workdir={args.workdir}", *overrides],
  }
  instance = {"policy": {
      "machineType": args.machine_type,
      "provisioningModel": "SPOT" if args.spot else "STANDARD"}}
  if args.gpu_count:
    container["options"] = "--gpus all"
    instance["installGpuDrivers"] = True
    instance["policy"]["accelerators"] = [{"type": args.gpu_type,
                                          "count": args.gpu_count}]
  return {
      "taskGroups": [{
          "taskCount": 1,
          "taskSpec": {
              "runnables": [{"container": container}],
              "maxRetryCount": args.max_retry_count,
              "maxRunDuration": f"{args.max_run_hours * 3600}s",
              # RETRY_TASK on these exit codes fails the task on any other.
              "lifecyclePolicies": [{
                  "action": "RETRY_TASK",
                  "actionCondition": {"exitCodes": [PREEMPTED]}}],
          },
      }],
      "allocationPolicy": {"instances": [instance]},
      "logsPolicy": {"destination": "CLOUD_LOGGING"},
  }


class UsageError(Exception):
  """A command this launcher refuses (exit status 2)."""


class SubmitError(Exception):
  """gcloud could not submit the job (exit status 1)."""


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise UsageError(f"{message} (launch/gcp_batch.py --help lists them)")


def check(args):
  """What Batch or the run would refuse later, refused now."""
  if not JOB_NAME.match(args.name):
    raise UsageError(
        f"--name={args.name}: Batch job names are 1-63 lowercase letters, "
        "digits and hyphens, starting with a letter and not ending with a "
        f"hyphen (e.g. {re.sub(r'[^a-z0-9-]', '-', args.name.lower())!r}).")
  if not args.workdir.startswith("gs://"):
    raise UsageError(
        f"--workdir={args.workdir}: must be a gs:// path: a directory on the "
        "VM is lost with it, and every retry would start from scratch.")
  check_gs_path(args.workdir)
  path = args.config.split(":", 1)[0]
  if os.path.isabs(path) or not os.path.isfile(os.path.join(REPO, path)):
    raise UsageError(
        f"--config={args.config}: no such file in this repository (the image "
        "holds its configs/; give the path from its top, e.g. "
        "configs/quickstart.py).")
  if not 0 <= args.max_retry_count <= 10:
    raise UsageError(f"--max_retry_count={args.max_retry_count}: Batch "
                     "allows 0 to 10.")
  if args.gpu_count < 0 or args.max_run_hours < 1:
    raise UsageError("--gpu_count must be >= 0 and --max_run_hours >= 1.")


def check_gs_path(workdir):
  """Refuses a gs:// workdir with no bucket, a bucket name Cloud Storage
  does not allow, or an empty part (what an unset shell variable leaves:
  gs://$BUCKET/runs gives gs:///runs)."""
  bucket, _, path = workdir[len("gs://"):].partition("/")
  if not bucket:
    problem = "the bucket name is empty (an unset variable?)"
  elif not (BUCKET.match(bucket) and 3 <= len(bucket) <= 222
            and all(len(p) <= 63 for p in bucket.split("."))):
    problem = (f"{bucket!r} is not a bucket name (3-63 lowercase letters, "
               "digits, '-', '_' and '.', starting and ending with a letter "
               "or digit)")
  elif "" in path.rstrip("/").split("/")[int(not path):]:
    problem = "it has an empty part ('//'; an unset variable?)"
  else:
    return
  raise UsageError(f"--workdir={workdir}: {problem}; give "
                   "gs://BUCKET/PATH.")


def spec_path(args):
  """Where the job spec goes: --spec_out, or a new temporary directory; a
  path inside this repository is refused (launch/tpu_vm_pod.sh run would
  copy it to the TPU workers)."""
  if not args.spec_out:
    return os.path.join(tempfile.mkdtemp(prefix="jaxrlhf-batch-"),
                        f"{args.name}.batch.json")
  path = os.path.abspath(args.spec_out)
  if os.path.commonpath([path, REPO]) == REPO:
    raise UsageError(
        f"--spec_out={args.spec_out}: inside the repository, whose files "
        "launch/tpu_vm_pod.sh run copies to TPU workers; write it elsewhere "
        "(left out, a new temporary directory).")
  return path


def submit(args, path):
  """Submits the job; returns gcloud's description of it."""
  command = ["gcloud", "batch", "jobs", "submit", args.name,
             f"--location={args.location}", f"--config={path}",
             "--format=json"]
  try:
    done = subprocess.run(command, capture_output=True, text=True,
                          check=False)
  except FileNotFoundError:
    raise UsageError(
        "gcloud is not on PATH: install the Google Cloud CLI, or submit "
        f"{path} another way.") from None
  if done.returncode != 0:
    # gcloud's message: its ERROR line and the lines after it, as one.
    text = done.stderr[done.stderr.find("ERROR:"):] if "ERROR:" in (
        done.stderr) else done.stderr
    reason = " ".join(text.split()) or f"exit status {done.returncode}"
    raise SubmitError(f"gcloud batch jobs submit failed: {reason}")
  try:
    return json.loads(done.stdout)
  except ValueError:
    return {}


def report(args, job):
  """The job's name, console page and how to follow it."""
  name = job.get("name", "")
  project = name.split("/")[1] if name.startswith("projects/") else None
  uid = job.get("uid", "")
  where = f"--location={args.location}" + (
      f" --project={project}" if project else "")
  console = (f"https://console.cloud.google.com/batch/jobsDetail/regions/"
             f"{args.location}/jobs/{args.name}/details"
             + (f"?project={project}" if project else ""))
  logs = (f'logName="projects/{project or "PROJECT"}/logs/batch_task_logs" '
          f'AND labels.job_uid="{uid}"')
  print(f"Submitted job {args.name} (uid {uid}).")
  print(f"  console: {console}")
  print(f"  state:   gcloud batch jobs describe {args.name} {where} "
        "--format='value(status.state)'")
  print(f"  logs:    gcloud logging read {shlex.quote(logs)}"
        + (f" --project={project}" if project else "")
        + " --order=asc --format='value(textPayload)'")


def parse(argv):
  overrides = []
  if "--" in argv:
    i = argv.index("--")
    argv, overrides = argv[:i], argv[i + 1:]
  p = _Parser(
      prog="launch/gcp_batch.py", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--name", required=True, help="Batch job name.")
  p.add_argument("--config", required=True,
                 help="Config file, as a path from the repository's top.")
  p.add_argument("--workdir", required=True, help="gs:// run directory.")
  p.add_argument("--image", required=True,
                 help="Container image built from the Dockerfile.")
  p.add_argument("--machine_type", default="a3-highgpu-8g")
  p.add_argument("--gpu_type", default="nvidia-h100-80gb")
  p.add_argument("--gpu_count", type=int, default=8,
                 help="GPUs of the VM; 0 for a CPU-only VM.")
  p.add_argument("--spot", action="store_true", help="Spot VMs.")
  p.add_argument("--max_retry_count", type=int, default=3,
                 help="Retries after preemptions (0-10).")
  p.add_argument("--max_run_hours", type=int, default=72)
  p.add_argument("--location", default="us-central1")
  p.add_argument("--submit", action="store_true",
                 help="Submit with gcloud (otherwise only write the spec).")
  p.add_argument("--spec_out", default="",
                 help="Where to write the job spec (JSON), outside the "
                 "repository; default: <name>.batch.json in a new temporary "
                 "directory.")
  return p.parse_args(argv), overrides


def main(argv=None):
  try:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    check(args)
    path = spec_path(args)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      json.dump(job_spec(args, overrides), f, indent=2)
    print(f"Wrote {path}")
    if args.submit:
      report(args, submit(args, path))
    else:
      print("Submit with: " + shlex.join(
          ["gcloud", "batch", "jobs", "submit", args.name,
           f"--location={args.location}", f"--config={path}"]))
  except (UsageError, SubmitError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2 if isinstance(e, UsageError) else 1)


if __name__ == "__main__":
  main()
