"""DPO and DRO-V train steps give the same numbers on a 4x2 mesh of 8
simulated devices as on one device."""

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, quiet_env
from jaxrlhf.data import synthetic
from jaxrlhf.data import synthetic_feedback

SCRIPT = str(REPO / "tests" / "recipe_sharded_check.py")


def _data(tmp_path, kind):
  examples = synthetic.make_examples("train", 64)
  prompts = [e["inputs"] for e in examples]
  completions = [[e["targets"], e["ideal"]] for e in examples]
  path = str(tmp_path / f"{kind}.jsonl")
  synthetic_feedback.write_synthetic_feedback(
      path, kind, prompts, completions, synthetic.gold_reward, beta=10.0)
  return path


def _run(algorithm, data, mesh, devices):
  env = quiet_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  r = subprocess.run([sys.executable, SCRIPT, algorithm, data, mesh], env=env,
                     capture_output=True, text=True, cwd=REPO)
  assert r.returncode == 0, r.stdout + r.stderr
  return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("algorithm,kind", [("dpo", "pairs"),
                                            ("dro_v", "trajectory")])
def test_recipe_steps_match_across_meshes(tmp_path, algorithm, kind):
  data = _data(tmp_path, kind)
  one = _run(algorithm, data, "1,1", 1)
  eight = _run(algorithm, data, "4,2", 8)
  np.testing.assert_allclose(eight["losses"], one["losses"], rtol=1e-4,
                             atol=1e-5)
  np.testing.assert_allclose(eight["policy_sum"], one["policy_sum"], rtol=1e-5)
  # The policy really is split over the model axis on the 4x2 mesh.
  assert eight["kernel_spec"] == ["None", "model"]
