"""DPO on the TL;DR comparisons with Pythia, as "The N+ implementation
details of RLHF with PPO" compared it with the reward model (Table 6,
detail 19): the reward model's data and settings (one epoch of 92,858
comparisons, AdamW eps 1e-5, lr 3e-6, cosine, batch 64) with beta 0.05,
from the SFT run.

  python -m jaxrlhf.main --config=configs/tldr_pythia_dpo.py:pythia-1b \
      --workdir=/runs/tldr_dpo --config.init.policy_checkpoint=/runs/tldr_sft \
      --config.data.files.vocabulary=/models/pythia-1b-deduped/tokenizer.json \
      --config.data.files.train='/data/comparisons/train/*.json' \
      --config.data.files.validation='/data/comparisons/validation/*.json' \
      --config.eval.judge_checkpoint=/runs/tldr_rm

Evaluation: the accuracy of DPO's implicit reward on the validation
comparisons, overall, by annotation batch and by confidence (detail 19:
`eval/implicit_reward_accuracy...`), and the policy against the SFT policy
side by side on the comparisons' validation prompts, judged by the reward
model (jaxrlhf.presets.tldr_judged_by_reward_model), sampled at 0.7.
"""

from jaxrlhf import presets


def get_config(size: str = "pythia-1b"):
  c = presets.tldr_pythia("dpo", size, learning_rate=3e-6, schedule="cosine",
                          batch_size=64, episodes=92_858)
  bucket = presets.TLDR_BUCKET
  c.init.policy_checkpoint = f"{bucket}/tldr_sft"
  presets.tldr_data(c, "comparisons")
  c.dpo.loss_type = "dpo"
  c.dpo.beta = 0.05
  presets.tldr_judged_by_reward_model(c)
  return c
