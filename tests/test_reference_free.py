"""The reference-free preference algorithms (SimPO, ORPO) from the command
line: on pair files, from an SFT checkpoint, they train, evaluate against
that checkpoint, and save no reference network."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import pytest

from conftest import REPO, cli_args, from_scratch, one_device_mesh, quiet_env
from conftest import synthetic_feedback_file, tiny_config, trainer_of
from jaxrlhf import algorithms
from jaxrlhf import checkpoint_files
from jaxrlhf.train import checkpointing


@pytest.mark.parametrize("algorithm, metric", [
    ("simpo", "reward_accuracy"), ("orpo", "odds_ratio_loss")])
def test_runs_from_the_command_line_on_pair_files(algorithm, metric,
                                                  tmp_path):
  pairs = synthetic_feedback_file(tmp_path, "pairs", beta=10.0)
  sft_dir = str(tmp_path / "sft")
  config = tiny_config(algorithm=algorithm)
  mesh, rules = one_device_mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state = trainer_of(from_scratch(algorithms.get("sft")), config,
                       mesh).init_state()
  saver = checkpointing.Checkpointer(os.path.join(sft_dir, "checkpoints"),
                                     keep=1)
  saver.save(0, state, 0)
  saver.close()
  workdir = tmp_path / "run"
  flags = cli_args(algorithm=algorithm, data__task=f"{algorithm}_cli",
                   data__files__train=pairs, init__policy_checkpoint=sft_dir,
                   train__num_steps=2, optimizer__warmup_steps=0,
                   eval__task="synthetic_summarize")
  result = subprocess.run(
      [sys.executable, "-m", "jaxrlhf.main",
       f"--config={REPO / 'configs' / 'quickstart.py'}",
       f"--workdir={workdir}", *flags],
      env=quiet_env(), capture_output=True, text=True, cwd=REPO)
  assert result.returncode == 0, result.stderr
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  assert [r["step"] for r in rows if metric in r] == [1, 2]
  assert any("eval/win_rate" in r for r in rows)
  saved = checkpoint_files.restore_state_as_numpy(
      os.path.join(workdir, "checkpoints", "2", "state"))
  assert not saved.get("frozen") and set(saved["params"]) == {"policy"}
