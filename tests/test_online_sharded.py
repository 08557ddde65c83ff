"""A PPO iteration (sampling, scoring, minibatch updates) gives the same
numbers on a 4x2 mesh of 8 simulated devices as on one device, also with
micro-batches; updates whose gradient rows do not split over the data
shards are refused (XLA gave NaN gradients for them)."""

import json
import subprocess
import sys

import numpy as np

from conftest import REPO, quiet_env

SCRIPT = str(REPO / "tests" / "online_sharded_check.py")


def _run(mesh, devices, microbatches=1):
  env = quiet_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  r = subprocess.run([sys.executable, SCRIPT, mesh, str(microbatches)],
                     env=env,
                     capture_output=True, text=True, cwd=REPO)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_ppo_iterations_match_across_meshes():
  one = _run("1,1", 1)
  # 16 responses, 2 minibatches of 8, 2 micro-batches of 4 (one per data
  # shard) on 4x2; whole minibatches on one device: the same updates to
  # float rounding.
  eight = _run("4,2", 8, microbatches=2)
  for a, b in zip(one["steps"], eight["steps"]):
    for key in a:
      np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-5,
                                 err_msg=key)
  np.testing.assert_allclose(eight["params_sum"], one["params_sum"],
                             rtol=1e-6)
  # The policy really is split over the model axis on the 4x2 mesh.
  assert eight["kernel_spec"] == ["None", "model"]
  assert eight["kernel_shards"] == 8
  assert "cannot be split evenly over 4 data-parallel shards" in (
      eight["uneven_error"] or "")
