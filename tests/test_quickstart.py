"""README's first command: the quickstart's SFT stage raises the gold reward,
and the offline pipeline's aligned policies beat SFT."""

import json
import re
import subprocess
import sys

from conftest import REPO, quiet_env


def test_quickstart_sft_clearly_raises_gold_reward(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "jaxrlhf.main", "--config=configs/quickstart.py",
       f"--workdir={tmp_path}", "--config.pipeline.stages=sft"],
      env=quiet_env(), capture_output=True, text=True, cwd=REPO)
  assert result.returncode == 0, result.stdout + result.stderr
  line = re.search(r"Gold reward of greedy outputs on held-out prompts: "
                   r"before ([\d.]+) -> after ([\d.]+)", result.stdout)
  assert line, result.stdout
  before, after = float(line.group(1)), float(line.group(2))
  # Untrained, a model rarely even ends its output; after SFT it summarises
  # most prompts correctly (the demonstrations themselves score ~0.84).
  assert before < 0.2
  assert after > 0.75 and after > before + 0.5
  assert "steps/s" in result.stdout and "tokens/s" in result.stdout
  assert (tmp_path / "sft" / "config.json").exists()
  assert list((tmp_path / "sft").glob("events.out.tfevents.*"))


def test_offline_pipeline_beats_sft_and_writes_results(tmp_path):
  """A shortened quickstart: fewer SFT steps, prompts and policy steps."""
  result = subprocess.run(
      [sys.executable, "-m", "jaxrlhf.main", "--config=configs/quickstart.py",
       f"--workdir={tmp_path}", "--config.train.num_steps=300",
       "--config.pipeline.stages=sft,data,reward_model,dpo,kto,dro_v",
       "--config.pipeline.num_prompts=600", "--config.pipeline.num_eval_prompts=64",
       "--config.pipeline.reward_model_steps=100",
       "--config.pipeline.policy_steps=120", "--config.eval.num_examples=128"],
      env=quiet_env(), capture_output=True, text=True, cwd=REPO)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  table = json.load(open(tmp_path / "results.json"))
  assert set(table) == {"sft", "dpo", "kto", "dro_v", "reward_model"}
  sft_gold = table["sft"]["gold_reward"]
  for method in ("dpo", "kto", "dro_v"):
    row = table[method]
    assert row["gold_reward"] > sft_gold, (method, row, sft_gold)
    assert row["kl_to_sft"] > 0 and 0 < row["win_rate_stderr"] < 0.05
  dpo = table["dpo"]
  assert dpo["win_rate_vs_sft"] - 2 * dpo["win_rate_stderr"] > 0.5
  # Better than chance at telling the labelled pairs apart.
  assert table["reward_model"]["heldout_pair_accuracy"] > 0.55
  assert "win rate vs SFT" in result.stdout
