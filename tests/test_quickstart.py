"""README's first command: SFT on the synthetic task raises the gold reward."""

import re
import subprocess
import sys

from conftest import REPO, quiet_env


def test_quickstart_sft_clearly_raises_gold_reward(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "jaxrlhf.main", "--config=configs/quickstart.py",
       f"--workdir={tmp_path}"],
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
  assert (tmp_path / "config.json").exists()
  assert list(tmp_path.glob("events.out.tfevents.*"))
