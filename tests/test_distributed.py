"""The same run on 2 processes joined by jax.distributed (gloo on CPU); the
4x2 mesh against one device is tests/test_eight_devices.py."""

import json
import socket
import subprocess
import sys

import numpy as np

from conftest import REPO, quiet_env

SCRIPT = str(REPO / "tests" / "distributed_sft_check.py")


def _losses(workdir):
  rows = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _report(stdout):
  return json.loads([l for l in stdout.splitlines() if l.startswith("{")][-1])


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two_processes(workdir, num_steps):
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, SCRIPT, str(workdir), str(num_steps), "-1,1", str(i),
       "2", str(port)], env=quiet_env(), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True, cwd=REPO) for i in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, out + err
  return [_report(out) for out, _ in outs], outs[0][0]


def test_two_processes_train_in_lock_step_checkpoint_and_restore(tmp_path):
  first, _ = _two_processes(tmp_path, 6)
  assert [r["process"] for r in first] == [0, 1]
  assert all(r["devices"] == 2 and r["step"] == 6 for r in first)
  # Both processes hold bit-identical parameter copies: they stepped together.
  assert first[0]["checksum"] == first[1]["checksum"]
  second, stdout0 = _two_processes(tmp_path, 10)
  assert "Resumed from checkpoint at step 6" in stdout0
  assert all(r["step"] == 10 and r["position"] == 10 for r in second)
  assert second[0]["checksum"] == second[1]["checksum"]
  assert second[0]["checksum"] != first[0]["checksum"]
  assert sorted(_losses(tmp_path)) == list(range(1, 11))
