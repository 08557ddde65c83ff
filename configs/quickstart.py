"""Quickstart: SFT of a tiny T5 from scratch on the built-in synthetic task.

  python -m jaxrlhf.main --config=configs/quickstart.py --workdir=/tmp/quickstart

Prints the gold reward of greedy outputs on held-out prompts before and after
training; a few minutes on 2 CPU cores.
"""

from jaxrlhf import defaults


def get_config(size: str = "tiny"):
  """`--config=configs/quickstart.py:small` picks another T5 size preset."""
  config = defaults.base_config()
  config.algorithm = "sft"
  config.model.size = size
  config.data.task = "synthetic_summarize"
  config.train.num_steps = 600
  config.train.batch_size = 32
  config.train.log_every = 50
  config.optimizer.name = "adafactor"
  config.optimizer.learning_rate = 1e-2
  config.optimizer.warmup_steps = 50
  config.checkpoint.every_steps = 200
  config.eval.num_examples = 128
  return config
