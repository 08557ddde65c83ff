"""The same run on 2 processes joined by jax.distributed (gloo on CPU); the
4x2 mesh against one device is tests/test_eight_devices.py.

Then the faults of a multi-host run: a process killed mid-step, one killed
as a checkpoint is being saved (before and after orbax's commit), and a
SIGTERM that reaches only one process. A lost process stops the other in
one line instead of a hang, and rerunning the same command resumes: the run
ends with the losses and parameters of the undisturbed one.
"""

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, quiet_env

SCRIPT = str(REPO / "tests" / "distributed_sft_check.py")
# Short, so that the faults are noticed quickly here (see jaxrlhf.train.peers).
LOST_PROCESS_TIMEOUT_S = 5


def _rows(workdir):
  return [json.loads(l) for l in open(workdir / "metrics.jsonl")]


def _losses(workdir):
  return {r["step"]: r["loss"] for r in _rows(workdir) if "loss" in r}


def _report(stdout):
  return json.loads([l for l in stdout.splitlines() if l.startswith("{")][-1])


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(workdir, num_steps, **env):
  port = _free_port()
  return [subprocess.Popen(
      [sys.executable, SCRIPT, str(workdir), str(num_steps), "-1,1", str(i),
       "2", str(port)], env=quiet_env(**env), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True, cwd=REPO) for i in range(2)]


def _two_processes(workdir, num_steps, **env):
  procs = _start(workdir, num_steps, **env)
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, out + err
  return [_report(out) for out, _ in outs], outs[0][0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """6 steps, then the same run extended to 10 (checkpoints every 3). The
  first run evaluates on both processes, the extension does not (training
  is the same either way, and evaluating costs both processes a compile)."""
  workdir = tmp_path_factory.mktemp("reference")
  first, _ = _two_processes(workdir, 6)
  second, stdout0 = _two_processes(workdir, 10, NO_EVALUATION="1")
  return workdir, first, second, stdout0


def test_two_processes_train_in_lock_step_checkpoint_and_restore(reference):
  workdir, first, second, stdout0 = reference
  assert [r["process"] for r in first] == [0, 1]
  assert all(r["devices"] == 2 and r["step"] == 6 for r in first)
  # Both processes hold bit-identical parameter copies: they stepped together.
  assert first[0]["checksum"] == first[1]["checksum"]
  # Both evaluated the policy, together: one gold reward.
  assert first[0]["gold_reward"] is not None
  assert first[0]["gold_reward"] == first[1]["gold_reward"]
  assert "Resumed from checkpoint at step 6" in stdout0
  # Gloo's connection line, printed from C++ on stdout, is kept off it.
  assert "[Gloo]" not in stdout0, stdout0
  assert all(r["step"] == 10 and r["position"] == 10 for r in second)
  assert second[0]["checksum"] == second[1]["checksum"]
  assert second[0]["checksum"] != first[0]["checksum"]
  assert sorted(_losses(workdir)) == list(range(1, 11))


def _wait_for_step(workdir, procs, step):
  """Until metrics.jsonl has a row of `step` (both processes running)."""
  path = workdir / "metrics.jsonl"
  while not (path.exists() and any(
      json.loads(l).get("step", 0) >= step for l in open(path)
      if l.endswith("\n"))):
    for p in procs:
      assert p.poll() is None, p.communicate()
    time.sleep(0.05)


def _assert_stopped_for_lost(survivor, lost):
  """The survivor ended by itself, with one line naming the lost process."""
  out, err = survivor.communicate(timeout=300)  # a hang fails here
  assert survivor.returncode == 1, out + err
  assert "Traceback" not in err, err
  last = err.strip().splitlines()[-1]
  assert last.startswith(f"error: process {lost} of 2 stopped responding"), err
  assert "Run the same command again on every process" in last


def test_lost_processes_stop_the_run_in_one_line_and_it_resumes_exactly(
    reference, tmp_path):
  workdir = tmp_path / "run"
  env = dict(LOST_PROCESS_TIMEOUT_S=str(LOST_PROCESS_TIMEOUT_S),
             NO_EVALUATION="1")

  # 1. Process 1 is killed mid-step (after step 4; the checkpoint is 3).
  procs = _start(workdir, 10, **env)
  _wait_for_step(workdir, procs, 4)
  procs[1].send_signal(signal.SIGKILL)
  procs[1].wait()
  _assert_stopped_for_lost(procs[0], lost=1)

  # 2. The same command: resumes from 3; process 1 dies as step 6 is saved.
  procs = _start(workdir, 10, DIE="save:1:6", **env)
  _assert_stopped_for_lost(procs[0], lost=1)
  procs[1].wait()

  # 3. Again; this time process 0 dies after orbax committed step 6 and
  # before its manifest. It hosts jax.distributed's service: JAX ends
  # process 1 at once (its own message), which must not hang either.
  procs = _start(workdir, 10, DIE="manifest:0:6", **env)
  procs[0].wait()
  procs[1].communicate(timeout=300)
  assert procs[1].returncode != 0
  assert (workdir / "checkpoints" / "6").exists()  # committed, no manifest

  # 4. Again: step 6 is moved aside (its save did not finish), the run
  # resumes from 3; a SIGTERM that reaches process 1 alone stops both at
  # the same step, after a checkpoint.
  procs = _start(workdir, 10, **env)
  _wait_for_step(workdir, procs, 7)
  procs[1].send_signal(signal.SIGTERM)
  outs = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  assert "Taking over the lock of" in outs[0][0]  # process 0 was killed
  assert "Checkpoint step 6 in " in outs[0][0]
  assert "its save did not finish" in outs[0][0]
  assert "Process 1 received a stop signal: saved a checkpoint" in outs[0][0]
  stopped = _report(outs[1][0])["step"]
  assert 7 <= stopped < 10
  assert (workdir / "damaged_checkpoints" / "6").exists()

  # 5. Again: resumes where it stopped and ends as the undisturbed run did.
  final, stdout0 = _two_processes(workdir, 10, **env)
  assert f"Resumed from checkpoint at step {stopped}" in stdout0
  assert _losses(workdir) == _losses(reference[0])
  assert [r["step"] for r in _rows(workdir) if "loss" in r] == list(
      range(1, 11))
  assert [r["checksum"] for r in final] == [r["checksum"]
                                            for r in reference[2]]
  assert not (workdir / "run.lock").exists()
  assert not list(workdir.glob("checkpoints/*tmp*"))
