"""README's first command, shortened: the quickstart's SFT stage raises the
gold reward, the pipeline's aligned policies beat SFT, offline and online,
and every line the run prints is its own.

One run serves every test here (its SFT, data and reward-model stages are
shared): 300 SFT steps, 60 per online stage, 128 held-out prompts, no
rejection sampling.
"""

import json
import math
import re
import subprocess
import sys

import pytest

from conftest import REPO, quiet_env


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("pipeline")
  result = subprocess.run(
      [sys.executable, "-m", "jaxrlhf.main", "--config=configs/quickstart.py",
       f"--workdir={workdir}", "--config.train.num_steps=300",
       "--config.pipeline.online_steps=60", "--config.eval.num_examples=128",
       "--config.pipeline.stages=sft,data,reward_model,dpo,kto,dro_v,ppo,"
       "rloo,grpo,best_of_n"],
      env=quiet_env(optimised_xla=True), capture_output=True, text=True,
      cwd=REPO)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  table = json.load(open(workdir / "results.json"))
  return workdir, table, result.stdout, result.stderr


# What the pipeline prints: stage headers, evaluations, progress, data and
# reward-normalisation summaries, the closing lines and the results table.
OWN_LINES = re.compile(
    r"(=== stage |Before training \(|After training \(|step \d+/\d+ \| |"
    r"Gold reward of |data: |Data: |Reward normalisation: |Rewards: |"
    r"best-of-\d+: |"
    r"method +win rate|-{20}|(sft|dpo|kto|dro_v|ppo|rloo|grpo|best_of_n\*) +"
    r"\d|\* best-of-N|reward model: held-out|Gold reward, KL and length: |$)")


def test_quickstart_sft_clearly_raises_gold_reward(pipeline):
  workdir, _, stdout, _ = pipeline
  line = re.search(r"Gold reward of greedy outputs on held-out prompts: "
                   r"before ([\d.]+) -> after ([\d.]+)", stdout)
  assert line, stdout
  before, after = float(line.group(1)), float(line.group(2))
  # Untrained, a model rarely even ends its output; after SFT it summarises
  # most prompts correctly (the demonstrations themselves score ~0.84).
  assert before < 0.2
  assert after > 0.75 and after > before + 0.5
  assert "steps/s" in stdout and "tokens/s" in stdout
  assert (workdir / "sft" / "config.json").exists()
  assert list((workdir / "sft").glob("events.out.tfevents.*"))


def test_every_line_printed_is_the_runs_own(pipeline):
  """No library noise (TensorFlow's C++ start-up, SentencePiece, absl
  warnings of seqio and orbax) on either stream."""
  _, _, stdout, stderr = pipeline
  assert stderr == "", stderr
  for line in stdout.splitlines():
    assert OWN_LINES.match(line), line


def test_offline_pipeline_beats_sft_and_writes_results(pipeline):
  _, table, stdout, _ = pipeline
  assert set(table) >= {"sft", "dpo", "kto", "dro_v", "reward_model"}
  sft_gold = table["sft"]["gold_reward"]
  for method in ("dpo", "kto", "dro_v"):
    row = table[method]
    assert row["gold_reward"] > sft_gold, (method, row, sft_gold)
    assert row["kl_to_sft"] > 0 and 0 < row["win_rate_stderr"] < 0.05
  dpo = table["dpo"]
  assert dpo["win_rate_vs_sft"] - 2 * dpo["win_rate_stderr"] > 0.5
  # Better than chance at telling the labelled pairs apart.
  assert table["reward_model"]["heldout_pair_accuracy"] > 0.55
  assert "win rate vs SFT" in stdout


def test_online_pipeline_beats_sft_and_writes_results(pipeline):
  workdir, table, stdout, _ = pipeline
  assert set(table) == {"sft", "dpo", "kto", "dro_v", "ppo", "rloo", "grpo",
                        "best_of_n", "reward_model"}
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
  assert "best_of_n*" in stdout
  # Each online stage raised the reward model's score of its samples.
  for stage in ("ppo", "rloo", "grpo"):
    rows = [json.loads(l) for l in open(workdir / stage / "metrics.jsonl")]
    proxy = [r["eval/reward_model_score"] for r in rows
             if "eval/reward_model_score" in r]
    assert proxy[-1] > proxy[0], (stage, proxy)
