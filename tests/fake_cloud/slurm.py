"""The fake `sbatch`, `srun`, `scancel` and `scontrol` (see
fake_cloud/__init__.py): one "cluster" whose nodes are all this machine.

sbatch runs the batch script here with the environment Slurm gives a batch
step (its #SBATCH options, then the command line's, decide the nodes, tasks
and GPUs: each node has FAKE_SLURM_NODE_GPUS, 8 by default; --exclusive
gets them all, as Slurm allocates every GRES of a node to an exclusive
job; --gpus-per-node=N gets N, and more than a node has is refused); srun
starts the step's tasks with the variables Slurm gives each task, and, as
the real srun does, turns a SIGTERM or SIGINT it receives into a SIGKILL of
its tasks; scancel --signal signals a step's tasks; `scontrol show job`
prints the fields of the job's record that Slurm's does (Requeue: 1 with
sbatch --requeue, 0 with --no-requeue, else the cluster's default,
FAKE_SLURM_JOB_REQUEUE, 1 as slurm.conf's JobRequeue; Command;
SubmitLine, which FAKE_SLURM_NO_SUBMIT_LINE=1 leaves out, as older Slurm
releases do);
scontrol requeue is recorded, and refused as Slurm refuses it for a job
whose Requeue is 0.
"""

import contextlib
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import fake_cloud  # noqa: E402  pylint: disable=wrong-import-position

# The sbatch options the fake understands (all take a value but these).
SBATCH_FLAGS = {"exclusive", "wait", "requeue", "no-requeue"}
SBATCH_VALUES = {"nodes", "ntasks-per-node", "gpus-per-node", "job-name",
                 "signal", "open-mode", "output", "time"}


def root():
  return pathlib.Path(os.environ["FAKE_CLOUD"])


def fail(tool, message, status=1):
  print(f"{tool}: error: {message}", file=sys.stderr)
  return status


def parse_options(args, tool):
  options, rest = {}, list(args)
  while rest and rest[0].startswith("--"):
    name, eq, value = rest.pop(0)[2:].partition("=")
    if name in SBATCH_FLAGS and not eq:
      # Of --requeue and --no-requeue, the last one counts.
      options.pop({"requeue": "no-requeue", "no-requeue": "requeue"}.get(
          name, ""), None)
      options[name] = True
    elif name in SBATCH_VALUES and eq:
      options[name] = value
    else:
      raise ValueError(f"{tool}: unrecognized option '--{name}'")
  return options, rest


def script_options(script):
  """The #SBATCH options at the top of a batch script."""
  found = []
  for line in pathlib.Path(script).read_text().splitlines()[1:]:
    if line.startswith("#SBATCH "):
      found.append(line.split()[1])
    elif line.strip() and not line.startswith("#"):
      break
  return parse_options(found, "sbatch")[0]


def job_id():
  """A job ID whose port (JAX takes its coordinator's port from the job ID:
  61440 + ID mod 4096) is free here."""
  while True:
    candidate = random.randrange(10_000, 1_000_000)
    with socket.socket() as s:
      try:
        s.bind(("127.0.0.1", 61440 + candidate % 4096))
      except OSError:
        continue
    return candidate


def node_names(count):
  # Every "node" is this machine; JAX's coordinator is the first one.
  return ["localhost"] + [f"127.0.0.{i + 1}" for i in range(1, count)]


def sbatch(args):
  try:
    options, rest = parse_options(args, "sbatch")
  except ValueError as e:
    return fail("sbatch", e)
  if not rest:
    return fail("sbatch", "no batch script")
  script, script_args = rest[0], rest[1:]
  options = {**script_options(script), **options}
  node_gpus = int(os.environ.get("FAKE_SLURM_NODE_GPUS", "8"))
  if options.get("exclusive"):
    gpus = node_gpus
  else:
    gpus = int(options.get("gpus-per-node", 0))
  if int(options.get("gpus-per-node", 0)) > node_gpus:
    return fail("sbatch", "Batch job submission failed: Requested node "
                "configuration is not available")
  jid = job_id()
  nodes = int(options.get("nodes", 1))
  per_node = int(options.get("ntasks-per-node", 1))
  names = ",".join(node_names(nodes))
  env = dict(os.environ)
  env.update(
      SLURM_JOB_ID=str(jid), SLURM_JOBID=str(jid),
      SLURM_JOB_NAME=options.get("job-name", pathlib.Path(script).name),
      SLURM_JOB_NUM_NODES=str(nodes), SLURM_NNODES=str(nodes),
      SLURM_JOB_NODELIST=names, SLURM_NODELIST=names,
      SLURM_NTASKS_PER_NODE=str(per_node), SLURM_NTASKS=str(nodes * per_node),
      SLURM_SUBMIT_DIR=os.getcwd(), SLURM_NODEID="0", SLURMD_NODENAME="localhost")
  if gpus:
    env.update(SLURM_GPUS_ON_NODE=str(gpus), SLURM_GPUS_PER_NODE=str(gpus),
               CUDA_VISIBLE_DEVICES=",".join(map(str, range(gpus))))
  fake_cloud.record("sbatch", args, job=jid, options=options)
  if options.get("requeue") or options.get("no-requeue"):
    requeue = 0 if options.get("no-requeue") else 1
  else:
    requeue = int(os.environ.get("FAKE_SLURM_JOB_REQUEUE", "1"))
  (root() / f"job-{jid}.json").write_text(json.dumps({
      "JobName": env["SLURM_JOB_NAME"], "Requeue": requeue, "Restarts": 0,
      "Command": str(pathlib.Path(script).resolve()),
      "WorkDir": os.getcwd(), "SubmitLine": " ".join(["sbatch", *args])}))
  output = options.get("output", "slurm-%j.out").replace("%j", str(jid))
  mode = "a" if options.get("open-mode") == "append" else "w"
  with open(output, mode) as out:
    proc = subprocess.Popen(["bash", script, *script_args], env=env,
                            stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            start_new_session=not options.get("wait"))
  (root() / f"job-{jid}.pid").write_text(str(proc.pid))
  print(f"Submitted batch job {jid}", flush=True)
  if options.get("wait"):
    return proc.wait()
  return 0


def srun(args):
  jid = os.environ.get("SLURM_JOB_ID")
  if not jid:
    return fail("srun", "the fake runs only inside a job (sbatch)")
  if not args or args[0].startswith("-"):
    return fail("srun", f"the fake takes no srun options, got {args}")
  nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
  per_node = int(os.environ["SLURM_NTASKS_PER_NODE"])
  total = nodes * per_node
  step = 0
  while (root() / f"job-{jid}.{step}.tasks").exists():
    step += 1
  procs, recorded = [], []
  for rank in range(total):
    env = dict(os.environ)
    env.update(
        SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node),
        SLURM_NODEID=str(rank // per_node), SLURM_NTASKS=str(total),
        SLURM_STEP_ID=str(step), SLURM_STEPID=str(step),
        SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"],
        SLURM_STEP_NUM_NODES=str(nodes), SLURM_STEP_NUM_TASKS=str(total))
    recorded.append({k: v for k, v in env.items()
                     if k.startswith(("SLURM_", "JAX_", "CUDA_"))})
    procs.append(subprocess.Popen(args, env=env))
  (root() / f"job-{jid}.{step}.tasks").write_text(
      " ".join(str(p.pid) for p in procs))
  fake_cloud.record("srun", args, job=int(jid), step=step, tasks=recorded)

  def force_termination(signum, frame):
    del signum, frame
    print("srun: forcing job termination", file=sys.stderr, flush=True)
    for p in procs:
      with contextlib.suppress(ProcessLookupError):
        p.kill()
  signal.signal(signal.SIGTERM, force_termination)
  signal.signal(signal.SIGINT, force_termination)
  codes = [p.wait() for p in procs]
  # The highest exit code, or 128 + the signal of a task killed by one.
  return max(c if c >= 0 else 128 - c for c in codes)


def scancel(args):
  fake_cloud.record("scancel", args)
  sig, targets = None, []
  for arg in args:
    if arg.startswith("--signal="):
      sig = arg.split("=", 1)[1]
    elif arg.startswith("-"):
      return fail("scancel", f"the fake knows no option {arg}")
    else:
      targets.append(arg)
  if sig is None or len(targets) != 1 or "." not in targets[0]:
    return fail("scancel", "the fake takes --signal=SIG JOBID.STEP")
  tasks = root() / f"job-{targets[0]}.tasks"
  if not tasks.exists():
    return fail("scancel", f"Kill job error on job step id {targets[0]}: "
                "Invalid job id specified")
  signum = getattr(signal, sig if sig.startswith("SIG") else f"SIG{sig}")
  for pid in tasks.read_text().split():
    with contextlib.suppress(ProcessLookupError):
      os.kill(int(pid), signum)
  return 0


def scontrol(args):
  fake_cloud.record("scontrol", args)
  if len(args) == 3 and args[:2] == ["show", "job"]:
    job, known = args[2], root() / f"job-{args[2]}.json"
  elif len(args) == 2 and args[0] == "requeue":
    job, known = args[1], root() / f"job-{args[1]}.json"
  else:
    return fail("scontrol", "the fake knows only show job JOBID and requeue "
                f"JOBID, got {args}")
  if not known.exists():
    return fail("scontrol", "Invalid job id specified")
  record = json.loads(known.read_text())
  if args[0] == "requeue":
    if not record["Requeue"]:
      return fail("scontrol", f"Requeue of JobId={job} failed: Requested "
                  "operation is presently disabled")
    return 0
  # The lines of Slurm's record that the script reads, as Slurm prints them.
  print(f"JobId={job} JobName={record['JobName']}\n"
        f"   Requeue={record['Requeue']} Restarts={record['Restarts']} "
        "BatchFlag=1 Reboot=0 ExitCode=0:0\n"
        f"   Command={record['Command']}\n"
        f"   WorkDir={record['WorkDir']}")
  if not os.environ.get("FAKE_SLURM_NO_SUBMIT_LINE"):
    print(f"   SubmitLine={record['SubmitLine']}")
  print()
  return 0


def main(argv):
  tool, args = argv[1], argv[2:]
  return {"sbatch": sbatch, "srun": srun, "scancel": scancel,
          "scontrol": scontrol}[tool](args)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
