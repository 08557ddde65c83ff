"""PPO on TL;DR with Pythia, as "The N+ implementation details of RLHF with
PPO" ran it (Table 7, details 20-25; jaxrlhf.presets.tldr_ppo): 1M
episodes (1,953 iterations of 512 prompts of the SFT data), 4 PPO epochs
of one minibatch, 53 sampled tokens at temperature 0.7 with the EOS trick,
the value network started from the reward model.

  python -m jaxrlhf.main --config=configs/tldr_pythia_ppo.py:pythia-1b \
      --workdir=/runs/tldr_ppo --config.init.policy_checkpoint=/runs/tldr_sft \
      --config.online.reward_model_checkpoint=/runs/tldr_rm \
      --config.eval.judge_checkpoint=/runs/tldr_rm \
      --config.data.files.vocabulary=/models/pythia-1b-deduped/tokenizer.json \
      --config.data.files.train=/data/tldr_sft/train.jsonl \
      --config.data.files.validation=/data/tldr_sft/validation.jsonl

The prompts are the SFT data's queries (layout "tldr_sft"), fitted to 512
tokens by dropping the post's last paragraphs (detail 2); "\\n\\nTL;DR:" is
never cut (online.prompt_suffix). Evaluation: against the SFT policy side
by side on the SFT validation prompts, judged by the reward model
(jaxrlhf.presets.tldr_judged_by_reward_model), with the reward model's own
score of the samples (eval/reward_model_score).
"""

from jaxrlhf import presets


def get_config(size: str = "pythia-1b"):
  c = presets.tldr_pythia("ppo", size, learning_rate=3e-6, schedule="linear",
                          batch_size=512, episodes=1_000_000)
  presets.tldr_ppo(c)
  # Gradient accumulation over the 512 responses of the one minibatch: the
  # update is the same (online.py); fit it to your accelerators' memory. On
  # TPU v5e this plans to 12.9 GiB per chip on a 2x4 slice of 8 chips
  # (experiments/results/plans/).
  c.train.num_microbatches = 8
  # Decoded in lockstep, as the committed plan was; the continuous engine
  # (--config.online.engine=auto) draws the same responses.
  c.online.engine = "lockstep"
  return c
