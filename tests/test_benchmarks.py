"""The benchmark scripts run, on the smallest shapes, and print figures that
agree with each other (they are not imported by anything else, so only
running them keeps them from rotting)."""

import re
import subprocess
import sys

from conftest import REPO, quiet_env


def _run(script, *args):
  out = subprocess.run(
      [sys.executable, str(REPO / "experiments" / script), *args],
      capture_output=True, text=True, env=quiet_env(), timeout=900,
      cwd=REPO)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def _number(text):
  return float(text.replace(",", ""))


def test_sft_step_benchmark_decoder_only():
  out = _run("bench_sft_step.py", "--arch=llama", "--steps=1",
             "--batch_size=4", "--inputs_length=8", "--targets_length=8",
             "--vocab_size=128")
  m = re.search(r"step time: ([\d.]+) ms \| [\d.]+ steps/s \| ([\d,]+) target "
                r"tokens/s \| ([\d,]+) total tokens/s", out)
  assert m, out
  step_ms, target, total = _number(m[1]), _number(m[2]), _number(m[3])
  # 4 x 8 target tokens and 4 x 16 tokens in all per step.
  assert abs(target - 32 / (step_ms / 1e3)) <= 0.01 * target + 1
  assert abs(total - 2 * target) <= 2
  assert "model: llama tiny" in out


def test_ppo_iteration_benchmark_t5_with_microbatches():
  out = _run("bench_ppo_iteration.py", "--steps=1", "--batch_size=4",
             "--inputs_length=8", "--targets_length=4", "--vocab_size=128",
             "--epochs=2", "--minibatches=2", "--num_microbatches=2")
  rows = {m[1]: (_number(m[2]), _number(m[4])) for m in re.finditer(
      r"^(rollout|scoring|update|step)\s+([\d.]+)\s+([\d.]+%)?\s*([\d,]+)",
      out, re.M)}
  assert set(rows) == {"rollout", "scoring", "update", "step"}, out
  for name, tokens in (("rollout", 16), ("scoring", 16), ("update", 32),
                       ("step", 16)):
    ms, per_s = rows[name]
    assert ms > 0
    assert abs(per_s - tokens / (ms / 1e3)) <= 0.05 * per_s + 1, (name, out)


def test_sampling_benchmark_prints_tokens_per_second():
  out = _run("bench_sampling.py", "--size=tiny", "--batches=2,4", "--prompt=4",
             "--new=3", "--vocab_size=128", "--repeats=1",
             "--no_transformers")
  rows = re.findall(r"^(t5|llama)\s+(\d+)\s+([\d,]+)\s", out, re.M)
  assert [(f, int(b)) for f, b, _ in rows] == [
      ("t5", 2), ("t5", 4), ("llama", 2), ("llama", 4)], out
  assert all(_number(rate) > 0 for _, _, rate in rows)
  assert "3 new tokens, greedy, EOS disabled" in out
