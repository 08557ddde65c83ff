"""The fake `gcloud` (see fake_cloud/__init__.py): the TPU and Batch commands
the launchers use, with the flags the real ones take; any other command or
flag is refused as gcloud refuses it."""

import contextlib
import fcntl
import json
import os
import pathlib
import signal
import shutil
import socket
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import fake_cloud  # noqa: E402  pylint: disable=wrong-import-position

PROJECT = "fake-project"
# A queued resource's states as `describe` sees them, one per call.
QUEUE = ["WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"]


class GcloudError(Exception):
  pass


def root():
  return pathlib.Path(os.environ["FAKE_CLOUD"])


@contextlib.contextmanager
def state():
  """The state file (queued resources, TPU VMs), locked while in use."""
  path = root() / "state.json"
  with open(root() / "state.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    data = (json.loads(path.read_text()) if path.exists()
            else {"queued": {}, "nodes": {}})
    yield data
    path.write_text(json.dumps(data, indent=1))


def parse(args, values=(), flags=(), positionals=1, command=""):
  """(positionals, {flag: value or True}) of `args`; unknown flags, as
  gcloud does, are an error."""
  values = set(values) | {"format", "project"}
  flags = set(flags) | {"quiet"}
  found, options = [], {}
  for arg in args:
    if arg.startswith("--"):
      name, eq, value = arg[2:].partition("=")
      if (name in values and eq) or (name in flags and not eq):
        options[name] = value if eq else True
        continue
      raise GcloudError(f"({command}) unrecognized arguments: {arg}")
    found.append(arg)
  if positionals is not None and len(found) != positionals:
    raise GcloudError(f"({command}) expected {positionals} positional "
                      f"arguments, got {found}")
  return found, options


def worker_homes(node):
  base = root() / "tpu" / node["name"] / str(node["generation"])
  return [base / f"worker-{i}" for i in range(node["workers"])]


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_pids(node):
  """PIDs of the runs the worker scripts started on `node` (alive or not)."""
  pids = []
  for home in worker_homes(node):
    pid_file = home / "jaxrlhf" / "run.pid"
    if pid_file.exists():
      pids.append(int(pid_file.read_text().split()[0]))
  return pids


def kill_runs(node, sig):
  for pid in run_pids(node):
    with contextlib.suppress(ProcessLookupError):
      os.kill(pid, sig)


def preempt(fake_root, name, grace_s=30.0):
  """What a Spot preemption does to the slice `name`: SIGTERM to its runs,
  SIGKILL after `grace_s`, then the TPU VM is PREEMPTED and its queued
  resource SUSPENDED. Returns when the runs are gone."""
  os.environ["FAKE_CLOUD"] = str(fake_root)
  with state() as s:
    node = s["nodes"][name]
  kill_runs(node, signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  while any(_alive(p) for p in run_pids(node)):
    if time.monotonic() > deadline:
      kill_runs(node, signal.SIGKILL)
    time.sleep(0.1)
  with state() as s:
    s["nodes"][name]["state"] = "PREEMPTED"
    if name in s["queued"]:
      s["queued"][name]["state"] = {"state": "SUSPENDED"}


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie (exited, not yet reaped by its parent) is not alive.
  with contextlib.suppress(OSError):
    return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
  return False


def print_format(resource, fmt, command):
  if fmt == "json":
    print(json.dumps(resource, indent=2))
  elif fmt.startswith("value(") and fmt.endswith(")"):
    values = []
    for key in fmt[len("value("):-1].split(","):
      value = resource
      for part in key.split("."):
        value = value.get(part, "") if isinstance(value, dict) else ""
      values.append(str(value))
    print("\t".join(values))
  else:
    raise GcloudError(f"({command}) the fake knows no --format={fmt}")


# --- compute tpus queued-resources -------------------------------------------

def queued_resources(verb, args):
  command = f"gcloud.compute.tpus.queued-resources.{verb}"
  if verb == "create":
    (name,), o = parse(args, command=command, values=(
        "zone", "node-id", "accelerator-type", "runtime-version",
        "description", "network", "subnetwork", "service-account", "labels"),
        flags=("spot", "reserved", "guaranteed", "internal-ips", "async"))
    for required in ("zone", "node-id", "accelerator-type", "runtime-version"):
      if required not in o:
        raise GcloudError(f"({command}) argument --{required}: must be "
                          "specified.")
    with state() as s:
      if name in s["queued"]:
        raise GcloudError(f"({command}) ALREADY_EXISTS: queued resource "
                          f"{name} exists.")
      q = {"name": f"projects/{PROJECT}/locations/{o['zone']}/"
                   f"queuedResources/{name}",
           "tpu": {"nodeSpec": [{
               "parent": f"projects/{PROJECT}/locations/{o['zone']}",
               "nodeId": o["node-id"],
               "node": {"acceleratorType": o["accelerator-type"],
                        "runtimeVersion": o["runtime-version"]}}]},
           "state": {"state": "CREATING"}, "describes": 0}
      if o.get("spot"):
        q["spot"] = {}
      elif o.get("reserved"):
        q["guaranteed"] = {"reserved": True}
      s["queued"][name] = q
    print(f"Create request issued for: [{name}]", file=sys.stderr)
    return 0
  if verb == "describe":
    (name,), o = parse(args, command=command, values=("zone",))
    with state() as s:
      q = s["queued"].get(name)
      if q is None:
        raise GcloudError(f"({command}) NOT_FOUND: Resource "
                          f"'projects/{PROJECT}/locations/{o.get('zone')}/"
                          f"queuedResources/{name}' was not found")
      current = q["state"]["state"]
      if current == "CREATING" or current in QUEUE[:-1]:
        # Time passes: the request moves along the queue.
        nxt = QUEUE[0] if current == "CREATING" else QUEUE[
            QUEUE.index(current) + 1]
        q["state"]["state"] = nxt
        if nxt == "ACTIVE":
          spec = q["tpu"]["nodeSpec"][0]
          # A new slice: new VMs, with empty disks.
          made = s.setdefault("made", {})
          made[spec["nodeId"]] = made.get(spec["nodeId"], 0) + 1
          s["nodes"][spec["nodeId"]] = {
              "name": spec["nodeId"], "state": "READY",
              "workers": int(os.environ.get("FAKE_TPU_WORKERS", "2")),
              "generation": made[spec["nodeId"]],
              "port": free_port(), "zone": o.get("zone")}
      shown = {k: v for k, v in q.items() if k != "describes"}
    print_format(shown, o.get("format", "json"), command)
    return 0
  if verb == "delete":
    (name,), o = parse(args, command=command, values=("zone",),
                       flags=("force", "async"))
    with state() as s:
      q = s["queued"].pop(name, None)
      if q is None:
        raise GcloudError(f"({command}) NOT_FOUND: {name}")
      node_id = q["tpu"]["nodeSpec"][0]["nodeId"]
      if node_id in s["nodes"]:
        if not o.get("force"):
          raise GcloudError(f"({command}) FAILED_PRECONDITION: the queued "
                            "resource has nodes; use --force")
        delete_node(s["nodes"].pop(node_id))
    return 0
  raise GcloudError(f"(gcloud.compute.tpus.queued-resources) the fake has no "
                    f"command {verb}")


def delete_node(node):
  """The VM goes away, and whatever ran on it."""
  kill_runs(node, signal.SIGKILL)


# --- compute tpus tpu-vm -----------------------------------------------------

def ready_node(name, zone, command):
  with state() as s:
    node = s["nodes"].get(name)
  if node is None:
    raise GcloudError(f"({command}) NOT_FOUND: projects/{PROJECT}/locations/"
                      f"{zone}/nodes/{name}")
  if node["state"] != "READY":
    raise GcloudError(f"({command}) the TPU {name} is {node['state']}")
  return node


def workers(node, spec, command):
  homes = worker_homes(node)
  if spec == "all":
    chosen = range(len(homes))
  else:
    chosen = [int(w) for w in spec.split(",")]
    if any(w >= len(homes) for w in chosen):
      raise GcloudError(f"({command}) worker {spec} does not exist")
  for i in chosen:
    homes[i].mkdir(parents=True, exist_ok=True)
  return [(i, homes[i]) for i in chosen]


def worker_env(node, i):
  """What a pod worker's environment tells JAX (fake_tpu_vm makes JAX read
  it as on a pod), on top of this environment (the test's)."""
  env = dict(os.environ)
  home = worker_homes(node)[i]
  env.update(
      HOME=str(home), TPU_WORKER_ID=str(i),
      TPU_WORKER_HOSTNAMES=",".join(["localhost"] * node["workers"]),
      JAX_COORDINATOR_PORT=str(node["port"]),
      PATH=f"{root() / 'worker-bin'}{os.pathsep}{env['PATH']}")
  return env


def tpu_vm(verb, args):
  command = f"gcloud.compute.tpus.tpu-vm.{verb}"
  if verb == "describe":
    (name,), o = parse(args, command=command, values=("zone",))
    with state() as s:
      node = s["nodes"].get(name)
    if node is None:
      raise GcloudError(f"({command}) NOT_FOUND: {name}")
    print_format(node, o.get("format", "json"), command)
    return 0
  if verb == "delete":
    (name,), _ = parse(args, command=command, values=("zone",))
    with state() as s:
      node = s["nodes"].pop(name, None)
    if node is None:
      raise GcloudError(f"({command}) NOT_FOUND: {name}")
    delete_node(node)
    return 0
  if verb == "scp":
    paths, o = parse(args, command=command, values=("zone", "worker"),
                     positionals=None)
    *sources, dest = paths
    name, colon, target = dest.partition(":")
    if not colon or not sources:
      raise GcloudError(f"({command}) copy to TPU:PATH, got {paths}")
    node = ready_node(name, o.get("zone"), command)
    for _, home in workers(node, o.get("worker", "0"), command):
      for source in sources:
        shutil.copy(source, home / target.removeprefix("~/"))
    return 0
  if verb == "ssh":
    (name,), o = parse(args, command=command,
                       values=("zone", "worker", "command"))
    node = ready_node(name, o.get("zone"), command)
    if "command" not in o:
      raise GcloudError(f"({command}) the fake runs only --command")
    fake_cloud.record("ssh", [], worker=o.get("worker", "0"),
                      command=o["command"])
    # gcloud runs the command again on a worker whose connection dropped.
    tries = 2 if (root() / "drop-ssh-connections").exists() else 1
    status = 0
    for _ in range(tries):
      procs = [subprocess.Popen(["bash", "-c", o["command"]], cwd=home,
                                env=worker_env(node, i))
               for i, home in workers(node, o.get("worker", "0"), command)]
      codes = [p.wait() for p in procs]
      status = next((c for c in codes if c), 0)
    return status
  raise GcloudError(f"(gcloud.compute.tpus.tpu-vm) the fake has no command "
                    f"{verb}")


# --- batch -------------------------------------------------------------------

def batch_submit(args):
  command = "gcloud.batch.jobs.submit"
  (name,), o = parse(args, command=command, values=("location", "config"))
  spec = json.loads(pathlib.Path(o["config"]).read_text())
  if os.environ.get("FAKE_BATCH_FAIL"):
    raise GcloudError(f"({command}) {os.environ['FAKE_BATCH_FAIL']}")
  job = {"name": f"projects/{PROJECT}/locations/{o['location']}/jobs/{name}",
         "uid": f"{name}-0a1b2c3d-0000", "status": {"state": "QUEUED"}}
  print_format(job, o.get("format", "json"), command)
  if os.environ.get("FAKE_BATCH_RUN"):
    run_batch_task(name, spec)
  return 0


def run_batch_task(name, spec):
  """Runs the job's one task here as Batch runs it on a VM: the container's
  entrypoint with its commands, retried as the task's lifecycle policy and
  retry count say (Batch's documented rule: with RETRY_TASK a failure whose
  exit code is listed is retried and any other fails the task; with no
  policy every failure is retried). Writes batch-<name>.json."""
  task = spec["taskGroups"][0]["taskSpec"]
  container = task["runnables"][0]["container"]
  argv = [container["entrypoint"], *container["commands"]]
  policies = task.get("lifecyclePolicies", [])
  attempts = []
  with open(root() / f"batch-{name}.log", "w") as log:
    for _ in range(task.get("maxRetryCount", 0) + 1):
      code = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT,
                             cwd=os.environ.get("FAKE_CONTAINER_DIR"))
      attempts.append(code)
      if code == 0:
        break
      if policies:
        policy = policies[0]
        listed = code in policy["actionCondition"]["exitCodes"]
        if listed != (policy["action"] == "RETRY_TASK"):
          break
  (root() / f"batch-{name}.json").write_text(json.dumps(
      {"argv": argv, "attempts": attempts}))


def main(argv):
  tool, args = argv[1], argv[2:]
  assert tool == "gcloud"
  fake_cloud.record("gcloud", args)
  try:
    if args[:3] == ["compute", "tpus", "queued-resources"] and len(args) > 3:
      return queued_resources(args[3], args[4:])
    if args[:3] == ["compute", "tpus", "tpu-vm"] and len(args) > 3:
      return tpu_vm(args[3], args[4:])
    if args[:3] == ["batch", "jobs", "submit"]:
      return batch_submit(args[3:])
    raise GcloudError(f"(gcloud) the fake knows no command {' '.join(args)}")
  except GcloudError as e:
    print(f"ERROR: {e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main(sys.argv))
