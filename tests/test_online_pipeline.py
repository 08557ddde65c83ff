"""The pipeline's online stages: PPO, RLOO and GRPO, trained against the
pipeline's own reward model, beat SFT by the gold reward; best-of-N is
reported with its analytic KL."""

import json
import math
import subprocess
import sys

from conftest import REPO, quiet_env


def test_online_pipeline_beats_sft_and_writes_results(tmp_path):
  """A shortened quickstart: 300 SFT steps, 60 steps per online stage."""
  result = subprocess.run(
      [sys.executable, "-m", "jaxrlhf.main", "--config=configs/quickstart.py",
       f"--workdir={tmp_path}", "--config.train.num_steps=300",
       "--config.pipeline.online_steps=60", "--config.eval.num_examples=128",
       "--config.pipeline.stages=sft,data,reward_model,ppo,rloo,grpo,"
       "best_of_n"],
      env=quiet_env(), capture_output=True, text=True, cwd=REPO)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  table = json.load(open(tmp_path / "results.json"))
  assert set(table) == {"sft", "ppo", "rloo", "grpo", "best_of_n",
                        "reward_model"}
  sft_gold = table["sft"]["gold_reward"]
  for method in ("ppo", "rloo", "grpo", "best_of_n"):
    row = table[method]
    assert row["gold_reward"] > sft_gold, (method, row, sft_gold)
    assert row["win_rate_vs_sft"] > 0.5, (method, row)
    assert row["kl_to_sft"] > 0 and 0 < row["win_rate_stderr"] < 0.05
  ppo = table["ppo"]
  assert ppo["win_rate_vs_sft"] - 2 * ppo["win_rate_stderr"] > 0.5
  n = 8  # pipeline.best_of_n
  assert math.isclose(table["best_of_n"]["kl_to_sft"],
                      math.log(n) - (n - 1) / n, rel_tol=1e-6)
  assert table["reward_model"]["heldout_pair_accuracy"] > 0.6
  assert "win rate vs SFT" in result.stdout and "best_of_n*" in result.stdout
  # Each online stage raised the reward model's score of its samples.
  for stage in ("ppo", "rloo", "grpo"):
    rows = [json.loads(l) for l in open(tmp_path / stage / "metrics.jsonl")]
    proxy = [r["eval/reward_model_score"] for r in rows
             if "eval/reward_model_score" in r]
    assert proxy[-1] > proxy[0], (stage, proxy)
