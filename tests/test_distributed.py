"""The same run on 1 device, on an 8-device 4x2 mesh, and on 2 processes."""

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


def _run(args, devices=1):
  env = quiet_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  result = subprocess.run([sys.executable, SCRIPT, *args], env=env,
                          capture_output=True, text=True, cwd=REPO)
  assert result.returncode == 0, result.stdout + result.stderr
  return _report(result.stdout)


def test_4x2_mesh_matches_one_device_and_shards_parameters(tmp_path):
  one = _run([str(tmp_path / "one"), "12", "1,1"], devices=1)
  eight = _run([str(tmp_path / "eight"), "12", "4,2"], devices=8)
  assert one["devices"] == 1 and eight["devices"] == 8
  a, b = _losses(tmp_path / "one"), _losses(tmp_path / "eight")
  assert sorted(a) == sorted(b) == list(range(1, 13))
  np.testing.assert_allclose([b[s] for s in sorted(b)],
                             [a[s] for s in sorted(a)], rtol=2e-5)
  # The MLP kernel [embed, mlp] is split over the 2-way model axis.
  assert eight["wi_0_spec"] == ["None", "model"]
  assert eight["wi_0_shard_shape"] == [eight["wi_0_global_shape"][0],
                                       eight["wi_0_global_shape"][1] // 2]
  assert one["wi_0_shard_shape"] == one["wi_0_global_shape"]


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
