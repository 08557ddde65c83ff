"""The TPU pod, Slurm and local launchers, run as README and BUILD.md say,
against the fake gcloud, uv, sbatch and srun of tests/fake_cloud (no cloud
or cluster is reached; the remote commands run here).

One run goes from launcher to launcher (the module fixture `journey`), each
part a real 2-process run over gloo on the CPU:
1. tpu_vm_pod.sh create: a Spot queued resource, waited for until ACTIVE.
2. tpu_vm_pod.sh run on its 2 workers, with every ssh command run twice (as
   gcloud reruns a command after a dropped connection): the run starts
   detached, once per worker; a second `run` is refused while it lives;
   `status` and `logs` follow it; `stop` saves a checkpoint and stops it.
3. slurm_gpu.sbatch --requeue on 2 nodes resumes it; the time-limit signal
   stops it with a checkpoint, and the job requeues itself.
4. local_processes.sh 2 resumes it and trains one more step.
5. The Spot slice is preempted; tpu_vm_pod.sh run requests it again (the
   same spec) and starts the run on the new workers, which `stop` stops.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from conftest import REPO, cli_args, quiet_env
import fake_cloud
from fake_cloud import gcloud as fake_gcloud

TPU, ZONE = "pod", "us-west4-a"


def overrides(num_steps=1000):
  """The tiny run's flags, with README's override with parentheses and an
  empty value (pipeline.stages)."""
  return cli_args(mesh__shape="(-1,1)", train__num_steps=num_steps)


OVERRIDES = overrides()
GUARD_S = 900  # a hang fails the test instead of blocking the suite


def _run(env, *command, check=True):
  done = subprocess.run(list(command), cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=GUARD_S)
  if check:
    assert done.returncode == 0, done.stdout + done.stderr
  return done


def _tpu(env, *args, check=True):
  return _run(env, "launch/tpu_vm_pod.sh", *args, check=check)


def _steps(workdir):
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(l)["step"] for l in open(path) if l.endswith("\n")]


def _wait_until_trained_past(workdir, step, still_running):
  """Until metrics.jsonl has a training row after `step`."""
  deadline = time.monotonic() + GUARD_S
  while not any(s > step for s in _steps(workdir)):
    problem = still_running()
    assert problem is None, problem
    assert time.monotonic() < deadline, "no progress"
    time.sleep(0.1)


def _workers(cloud, generation):
  return [cloud / "tpu" / TPU / str(generation) / f"worker-{i}" / "jaxrlhf"
          for i in range(2)]


def _tpu_runs_alive(cloud, generation):
  def check():
    for home in _workers(cloud, generation):
      if (home / "run.exit").exists():
        return f"a worker's run ended: {(home / 'run.log').read_text()}"
    return None
  return check


def _saved_step(text):
  return int(re.search(r"saved a checkpoint at step (\d+) and stopped",
                       text).group(1))


@pytest.fixture(scope="module")
def journey(tmp_path_factory):
  cloud = tmp_path_factory.mktemp("cloud")
  workdir = tmp_path_factory.mktemp("run")
  env = fake_cloud.install(cloud, quiet_env(JAXRLHF_TPU_POLL_S="0"))
  out = {"cloud": cloud, "workdir": workdir}

  # 1. A Spot slice from a queued request.
  out["create"] = _tpu(env, "create", TPU, ZONE, "v5litepod-16", "--spot")

  # 2. The run, with gcloud rerunning every ssh command.
  (cloud / "drop-ssh-connections").touch()
  out["run"] = _tpu(env, "run", TPU, ZONE, "configs/quickstart.py",
                    str(workdir), "--cpu_collectives=gloo", *OVERRIDES)
  (cloud / "drop-ssh-connections").unlink()
  _wait_until_trained_past(workdir, 0, _tpu_runs_alive(cloud, 1))
  out["second_run"] = _tpu(env, "run", TPU, ZONE, "configs/quickstart.py",
                           str(workdir), check=False)
  out["status"] = _tpu(env, "status", TPU, ZONE)
  out["logs"] = _tpu(env, "logs", TPU, ZONE)
  out["stop"] = _tpu(env, "stop", TPU, ZONE)
  out["checkpoints_after_stop"] = os.listdir(workdir / "checkpoints")
  out["tpu_logs"] = [(h / "run.log").read_text() for h in _workers(cloud, 1)]
  out["tpu_stopped_at"] = _saved_step(out["tpu_logs"][0])

  # 3. Slurm resumes it; two minutes before the time limit Slurm signals
  # the batch script (--signal=B:USR1@120).
  sbatch = subprocess.Popen(
      ["sbatch", "--wait", "--nodes=2", f"--output={cloud}/slurm-%j.out",
       "launch/slurm_gpu.sbatch", "--requeue", "configs/quickstart.py",
       str(workdir), "--cpu_collectives=gloo", *OVERRIDES],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)  # pylint: disable=consider-using-with
  _wait_until_trained_past(workdir, out["tpu_stopped_at"],
                           lambda: None if sbatch.poll() is None
                           else sbatch.communicate())
  (job,) = fake_cloud.calls(cloud, "sbatch")
  os.kill(int((cloud / f"job-{job['job']}.pid").read_text()),
          signal.SIGUSR1)
  out["sbatch"] = sbatch.communicate(timeout=GUARD_S) + (sbatch.returncode,)
  out["job"] = job["job"]
  out["slurm_log"] = (cloud / f"slurm-{job['job']}.out").read_text()
  out["slurm_stopped_at"] = _saved_step(out["slurm_log"])

  # 4. Several processes on this machine: one more step.
  out["local"] = _run(env, "launch/local_processes.sh", "2",
                      "configs/quickstart.py", str(workdir),
                      *overrides(out["slurm_stopped_at"] + 1))

  # 5. A preemption; `run` again recreates the slice and starts the run.
  gcloud_calls_before = len(fake_cloud.calls(cloud, "gcloud"))
  fake_gcloud.preempt(cloud, TPU)
  out["rerun"] = _tpu(env, "run", TPU, ZONE, "configs/quickstart.py",
                      str(workdir), "--cpu_collectives=gloo", *OVERRIDES)
  out["rerun_stop"] = _tpu(env, "stop", TPU, ZONE)
  out["recreate_calls"] = [
      c["argv"] for c in fake_cloud.calls(cloud, "gcloud")[gcloud_calls_before:]]
  return out


def test_tpu_create_requests_a_spot_queued_resource_until_active(journey):
  calls = [c["argv"] for c in fake_cloud.calls(journey["cloud"], "gcloud")]
  assert calls[0] == [
      "compute", "tpus", "queued-resources", "create", TPU, f"--zone={ZONE}",
      f"--node-id={TPU}", "--accelerator-type=v5litepod-16", "--spot",
      "--runtime-version=v2-alpha-tpuv5-lite"]
  assert journey["create"].stdout.splitlines()[:3] == [
      f"Queued resource {TPU}: WAITING_FOR_RESOURCES",
      f"Queued resource {TPU}: PROVISIONING",
      f"Queued resource {TPU}: ACTIVE"]


def test_tpu_run_copies_what_git_lists_and_starts_once_per_worker(journey):
  cloud = journey["cloud"]
  homes = _workers(cloud, 1)
  with tarfile.open(homes[0].parent / "jaxrlhf-src.tar.gz") as archive:
    names = set(archive.getnames())
  assert "jaxrlhf/main.py" in names and "launch/tpu_worker.sh" in names
  assert not any(n.startswith((".git/", ".pytest_cache/", "jaxrlhf.egg-info"))
                 for n in names)
  # gcloud ran each command twice; each worker started one run, once.
  for log in journey["tpu_logs"]:
    assert log.count("=== launch ") == 1, log
  out = journey["run"].stdout
  for i in range(2):
    assert f"worker {i}: started (PID" in out
    assert f"worker {i}: this launch's run is running" in out
  # The environment: a venv of Python 3.11, the package and jax's TPU extra.
  uv = [c["argv"] for c in fake_cloud.calls(cloud, "uv")
        if c["home"] in {str(h.parent) for h in homes}]
  assert sorted(uv) == sorted(
      [["venv", "--python", "3.11", str(h / "venv")] for h in homes]
      + [["pip", "install", "--python", str(h / "venv" / "bin" / "python"),
          "-e", str(h / "src"), "jax[tpu]"] for h in homes])


def test_tpu_run_passes_readmes_overrides_through_ssh_intact(journey):
  header = journey["tpu_logs"][0].splitlines()[0]
  assert header.endswith(
      f"python -m jaxrlhf.main --config=configs/quickstart.py "
      f"--workdir={journey['workdir']} --distributed --cpu_collectives=gloo "
      + " ".join(OVERRIDES))
  assert "--config.mesh.shape=(-1,1)" in OVERRIDES
  assert "--config.pipeline.stages=" in OVERRIDES


def test_tpu_run_is_refused_while_a_run_lives_and_followed(journey):
  refused = journey["second_run"]
  assert refused.returncode != 0
  assert "worker 0: error: a run is alive here" in refused.stderr
  assert f"error: a run is alive on {TPU}" in refused.stderr
  assert "Copying" not in refused.stdout  # nothing was copied
  status = journey["status"].stdout
  assert f"TPU {TPU}: READY (queued resource: ACTIVE)" in status
  assert re.search(r"worker 0: running \(PID \d+", status)
  assert re.search(r"worker 1: running \(PID \d+", status)
  assert re.search(r"^step \d+/1000 \| loss", journey["logs"].stdout,
                   re.MULTILINE)


def test_tpu_stop_saves_a_checkpoint_on_every_worker(journey):
  stop = journey["stop"].stdout
  assert "worker 0: stopped: exit status 0" in stop
  assert "worker 1: stopped: exit status 0" in stop
  assert str(journey["tpu_stopped_at"]) in journey["checkpoints_after_stop"]
  assert "Received SIGTERM: saved a checkpoint" in journey["tpu_logs"][0]


def test_slurm_uses_every_gpu_of_a_node_and_requeues_at_the_time_limit(
    journey):
  out, err, status = journey["sbatch"]
  assert status == 0, out + err
  log = journey["slurm_log"]
  assert (f"Resumed from checkpoint at step {journey['tpu_stopped_at']}"
          in log)
  assert "The time limit is near: the run saves a checkpoint and stops." in log
  assert f"Requeued job {journey['job']}" in log
  assert journey["slurm_stopped_at"] > journey["tpu_stopped_at"]
  cloud = journey["cloud"]
  # The run's tasks got the SIGTERM, not srun (which would SIGKILL them).
  assert [c["argv"] for c in fake_cloud.calls(cloud, "scancel")] == [
      ["--signal=TERM", f"{journey['job']}.0"]]
  assert "forcing job termination" not in log
  assert [c["argv"] for c in fake_cloud.calls(cloud, "scontrol")] == [
      ["requeue", str(journey["job"])]]
  (step,) = fake_cloud.calls(cloud, "srun")
  tasks = step["tasks"]
  assert [(t["SLURM_PROCID"], t["SLURM_LOCALID"], t["SLURM_NTASKS"])
          for t in tasks] == [("0", "0", "2"), ("1", "0", "2")]
  assert all(t["JAX_LOCAL_DEVICE_IDS"] == "0,1,2,3,4,5,6,7" for t in tasks)


def test_jax_gives_the_slurm_task_all_eight_gpus(journey):
  """JAX, in the environment the script gives a task (alone in its job
  here), makes every GPU of the node visible to the process; from Slurm's
  variables alone it would pick GPU 0 (SLURM_LOCALID)."""
  (step,) = fake_cloud.calls(journey["cloud"], "srun")
  env = quiet_env(**step["tasks"][0])
  env.update(SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1",
             SLURM_STEP_NODELIST="localhost", JAX_COORDINATOR_PORT=str(
                 fake_gcloud.free_port()))
  show = ("import jax; jax.distributed.initialize(); "
          "print(jax.config.values['jax_cuda_visible_devices'])")
  done = subprocess.run([sys.executable, "-c", show], env=env,
                        capture_output=True, text=True, timeout=GUARD_S)
  assert done.returncode == 0, done.stderr
  assert done.stdout.split() == ["0,1,2,3,4,5,6,7"]


def test_local_processes_resume_the_run_and_train_on(journey):
  done = journey["local"]
  assert (f"Resumed from checkpoint at step {journey['slurm_stopped_at']}"
          in done.stdout)
  last = journey["slurm_stopped_at"] + 1
  assert f"step {last}/{last}" in done.stdout
  assert "After training" in done.stdout
  assert max(_steps(journey["workdir"])) == last


def test_tpu_run_after_a_preemption_recreates_the_slice(journey):
  calls = journey["recreate_calls"]
  qr = ["compute", "tpus", "queued-resources"]
  assert calls[1] == qr + ["describe", TPU, f"--zone={ZONE}", "--format=json"]
  assert calls[2] == qr + ["delete", TPU, f"--zone={ZONE}", "--force",
                           "--quiet"]
  assert calls[3] == qr + [
      "create", TPU, f"--zone={ZONE}", f"--node-id={TPU}",
      "--accelerator-type=v5litepod-16",
      "--runtime-version=v2-alpha-tpuv5-lite", "--spot"]
  out = journey["rerun"].stdout
  assert f"The queued resource {TPU} is SUSPENDED" in out
  assert f"Queued resource {TPU}: ACTIVE" in out
  # The new slice's workers (new disks) got the repository, an environment
  # and the same command.
  for home, old_log in zip(_workers(journey["cloud"], 2),
                           journey["tpu_logs"]):
    assert (home / "venv" / "bin" / "python").exists()
    assert (home / "run.log").read_text().splitlines()[0].split(": ", 1)[1] \
        == old_log.splitlines()[0].split(": ", 1)[1]
  assert "worker 0: stopped" in journey["rerun_stop"].stdout


def test_launchers_refuse_bad_commands_in_one_line(tmp_path):
  # Slurm nodes without GPUs, whose driver (if any) lists none.
  env = fake_cloud.install(tmp_path, quiet_env(FAKE_SLURM_NODE_GPUS="0"))
  for name in ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE"):
    env.pop(name, None)
  (tmp_path / "bin" / "nvidia-smi").write_text(
      "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not "
      "communicate with the NVIDIA driver.'\nexit 9\n")
  (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
  for command, message in [
      (["launch/tpu_vm_pod.sh", "launch", TPU, ZONE],
       "error: unknown action 'launch': create, run, status, logs, stop, "
       "recreate or delete (launch/tpu_vm_pod.sh --help)."),
      (["launch/tpu_vm_pod.sh", "run", TPU, ZONE, "configs/quickstart.py"],
       "error: usage: launch/tpu_vm_pod.sh run TPU ZONE CONFIG WORKDIR "
       "[--config.x=y ...]"),
      (["launch/tpu_vm_pod.sh", "run", TPU, ZONE, "configs/nope.py",
        "gs://b/r"], "error: CONFIG configs/nope.py: no such file."),
      (["launch/local_processes.sh", "two", "configs/quickstart.py", "/tmp/r"],
       "error: NUM_PROCESSES must be a positive number, got 'two'."),
      (["sbatch", "--wait", f"--output={tmp_path}/out",
        "launch/slurm_gpu.sbatch", "configs/quickstart.py", "/tmp/r"], None),
  ]:
    done = _run(env, *command, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    if message is not None:
      assert done.stderr == message + "\n", done.stderr
  assert (tmp_path / "out").read_text().startswith("error: no GPUs on this node")
  # A PATH with what the script needs before it looks for gcloud.
  (tmp_path / "tools").mkdir()
  (tmp_path / "tools" / "dirname").symlink_to(shutil.which("dirname"))
  done = _run(dict(env, PATH=str(tmp_path / "tools")), "/bin/bash",
              "launch/tpu_vm_pod.sh", "status", TPU, ZONE, check=False)
  assert done.returncode == 1
  assert done.stderr.startswith("error: gcloud is not on PATH")


def _stand_in_python(directory):
  """A `python` that stands in for a run: process 1 of a job fails at once
  (with a message), any other waits until SIGTERM, says it saved, exits 0."""
  path = directory / "python"
  path.write_text(
      "#!/bin/bash\n"
      'case " $* " in *" --process_id=1 "*)'
      ' echo "error: process 1 broke"; exit 3;; esac\n'
      "trap 'echo \"saved a checkpoint and stopped\"; exit 0' TERM\n"
      "while :; do sleep 0.05; done\n")
  path.chmod(0o755)
  return path


def _slurm_to_the_time_limit(tmp_path, sbatch_options, script_args,
                             **env_extra):
  """Submits slurm_gpu.sbatch with a stand-in run and, once its tasks run,
  signals the script as Slurm does two minutes before the time limit.
  Returns (exit status, the job's output lines, job ID)."""
  env = fake_cloud.install(tmp_path, quiet_env(**env_extra))
  _stand_in_python(tmp_path / "bin")
  sbatch = subprocess.Popen(  # pylint: disable=consider-using-with
      ["sbatch", "--wait", f"--output={tmp_path}/out", *sbatch_options,
       "launch/slurm_gpu.sbatch", *script_args, "configs/quickstart.py",
       "/tmp/r"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
  tasks = tmp_path / f"job-{sbatch.stdout.readline().split()[-1]}.0.tasks"
  while not tasks.exists():
    assert sbatch.poll() is None, (tmp_path / "out").read_text()
    time.sleep(0.05)
  (job,) = fake_cloud.calls(tmp_path, "sbatch")
  os.kill(int((tmp_path / f"job-{job['job']}.pid").read_text()),
          signal.SIGUSR1)
  status = sbatch.wait(timeout=GUARD_S)
  return status, (tmp_path / "out").read_text().splitlines(), job["job"]


STOPPING = ["The time limit is near: the run saves a checkpoint and stops.",
            "saved a checkpoint and stopped"]
UNFINISHED = ("The run stopped unfinished: submit the same command again to "
              "resume.")


def _requeues(tmp_path):
  return [c["argv"] for c in fake_cloud.calls(tmp_path, "scontrol")
          if c["argv"][0] == "requeue"]


def test_slurm_without_requeue_ends_unfinished_and_says_so(tmp_path):
  # On a cluster whose jobs Slurm may requeue by default (JobRequeue=1):
  # only --requeue asks the script to.
  status, lines, _ = _slurm_to_the_time_limit(tmp_path, [], [])
  assert status == 75
  assert lines == STOPPING + [UNFINISHED]
  assert not _requeues(tmp_path)


@pytest.mark.parametrize("sbatch_options, script_args", [
    (["--requeue", "--nodes=1"], []),  # Slurm's spelling
    (["--no-requeue", "--requeue"], []),  # the last one counts, as in sbatch
    ([], ["--requeue"]),  # the script's argument
])
def test_slurm_requeues_at_the_time_limit_with_either_spelling(
    tmp_path, sbatch_options, script_args):
  status, lines, job = _slurm_to_the_time_limit(tmp_path, sbatch_options,
                                                script_args)
  assert status == 0, lines
  assert lines == STOPPING + [
      f"Requeued job {job}: it resumes from the checkpoint when it runs "
      "again."]
  assert _requeues(tmp_path) == [["requeue", str(job)]]


def test_slurm_says_when_it_cannot_tell_sbatchs_requeue(tmp_path):
  """A Slurm whose job record has no SubmitLine: sbatch's own --requeue
  cannot be read, and the job's output says which spelling works."""
  status, lines, _ = _slurm_to_the_time_limit(
      tmp_path, ["--requeue"], [], FAKE_SLURM_NO_SUBMIT_LINE="1")
  assert status == 75
  assert lines == STOPPING + [
      "(Slurm's record of this job does not show whether sbatch was given "
      "--requeue; to requeue at the time limit on this cluster, give "
      "--requeue after the script's name.)", UNFINISHED]
  assert not _requeues(tmp_path)


def test_slurm_says_when_the_requeue_is_refused(tmp_path):
  """A job Slurm may not requeue (--no-requeue to sbatch; so too a cluster
  with JobRequeue=0) ends as one stopped unfinished, and says why."""
  status, lines, job = _slurm_to_the_time_limit(
      tmp_path, ["--no-requeue"], ["--requeue"])
  assert status == 75
  assert lines == STOPPING + [
      f"scontrol: error: Requeue of JobId={job} failed: Requested operation "
      "is presently disabled",
      f"Slurm refused to requeue job {job} (scontrol's message is above).",
      UNFINISHED]
  assert _requeues(tmp_path) == [["requeue", str(job)]]


def test_slurm_uses_the_gpus_a_node_has(tmp_path):
  """On nodes of 4 GPUs the job gets them all (and is not refused for
  asking for 8): every GPU of the node is the run's."""
  env = fake_cloud.install(tmp_path, quiet_env(FAKE_SLURM_NODE_GPUS="4"))
  (tmp_path / "bin" / "python").write_text(
      '#!/bin/sh\necho "devices $JAX_LOCAL_DEVICE_IDS"\n')
  (tmp_path / "bin" / "python").chmod(0o755)
  done = _run(env, "sbatch", "--wait", "--nodes=2",
              f"--output={tmp_path}/out", "launch/slurm_gpu.sbatch",
              "configs/quickstart.py", "/tmp/r")
  assert done.stdout.startswith("Submitted batch job")
  assert (tmp_path / "out").read_text().splitlines() == [
      "devices 0,1,2,3"] * 2


def test_the_workers_venv_sees_the_packages_of_a_venvs_python(tmp_path):
  """The suite run by a venv's Python (a fresh venv, as most users
  install): the stand-in TPU workers' venv sees that venv's packages (jax
  among them), not only its base interpreter's."""
  outer = tmp_path / "outer"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(outer)],
                 check=True)
  (next(outer.glob("lib/python3*/site-packages")) / "only_in_outer.py"
   ).write_text("")
  env = fake_cloud.install(tmp_path / "cloud", quiet_env())
  version = f"{sys.version_info.major}.{sys.version_info.minor}"
  worker = tmp_path / "worker"
  subprocess.run([str(outer / "bin" / "python"), str(fake_cloud.HERE / "uv.py"),
                  "uv", "venv", "--python", version, str(worker)],
                 env=env, check=True)
  done = subprocess.run([str(worker / "bin" / "python"), "-c",
                         "import only_in_outer"], env=env,
                        capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr


def test_local_processes_stop_the_rest_when_one_fails(tmp_path):
  python = _stand_in_python(tmp_path)
  done = _run(dict(quiet_env(), PYTHON=str(python), JAXRLHF_PORT="1"),
              "launch/local_processes.sh", "3", "configs/quickstart.py",
              "/tmp/r", check=False)
  assert done.returncode == 3
  assert done.stdout == "saved a checkpoint and stopped\n"  # process 0
  assert done.stderr == ("error: process 1 of 3 failed (exit status 3); the "
                         "end of its output:\n  error: process 1 broke\n")
