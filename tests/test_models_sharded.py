"""A model sharded on 8 simulated devices computes what one device does.

tests/models_sharded_check.py runs in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8: T5 (the t5x encdec
fixture) and Llama (the llama_gqa HF fixture) are loaded with
`from_pretrained` on the default device and on a 4x2 data x model mesh
(`jaxrlhf.sharding.create_mesh`, `STANDARD_RULES`, parameters placed by
their logical names); logits and greedy KV-cache decodes must agree.
"""

import json
import subprocess
import sys

import pytest

from conftest import FIXTURES
from conftest import REPO
from conftest import quiet_env


@pytest.fixture(scope="module")
def result():
  env = quiet_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
  proc = subprocess.run(
      [sys.executable, str(REPO / "tests" / "models_sharded_check.py"),
       str(FIXTURES)], env=env, cwd=REPO, capture_output=True, text=True,
      timeout=600)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("model", ["t5", "llama"])
def test_sharded_logits_and_greedy_equal_one_device(result, model):
  assert result["devices"] == 8
  r = result[model]
  # The parameters really are split: the vocab / mlp axis over 'model' and
  # copies over 'data' use all 8 devices.
  assert r["kernel_spec"] == [None, "model"] and r["kernel_devices"] == 8
  # Activations follow the logical rules: batch over data, vocab over model.
  assert r["logits_spec"] == ["data", None, "model"]
  assert r["tokens_spec"][0] == "data"
  # Only the order of float reductions differs.
  assert r["logits_diff"] < 1e-4
  assert r["greedy_equal"]
  assert r["greedy_logprob_diff"] < 1e-4


def test_sharded_t5_greedy_is_t5xs(result):
  # Row 3 repeats row 0 to fill the data axis.
  assert result["t5"]["greedy_tokens"][:3] == result["t5_expected_greedy"]
  assert result["t5"]["greedy_tokens"][3] == result["t5_expected_greedy"][0]
  assert result["t5"]["greedy_has_eos"] == [True, True, False, True]
