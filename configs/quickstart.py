"""Quickstart: the whole offline pipeline on the built-in synthetic task.

  python -m jaxrlhf.main --config=configs/quickstart.py --workdir=/tmp/quickstart

A tiny T5 is fine-tuned from scratch (SFT; the gold reward of its greedy
outputs on held-out prompts is printed before and after), SFT samples are
labelled by the gold reward, a reward model is trained, DPO, KTO and DRO-V
(offline) and PPO, RLOO, GRPO and rejection sampling (online, against the
reward model) start from the SFT policy, and best-of-N is evaluated; the run
ends with a table of win rates against SFT, also written to
<workdir>/results.json. About 5 minutes on 2 CPU cores.
`--config.pipeline.stages=sft` runs only the SFT stage.
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
  config.eval.num_examples = 256
  config.pipeline.stages = ("sft,data,reward_model,dpo,kto,dro_v,"
                            "ppo,rloo,grpo,rejection_sampling,best_of_n")
  return config
