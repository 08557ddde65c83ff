"""PPO on TL;DR with Pythia, as "The N+ implementation details of RLHF with
PPO" ran it (Table 7, details 20-25): 1M episodes (1,953 iterations of 512
prompts of the SFT data, reshuffled every pass: detail 21), AdamW (eps 1e-5,
lr 3e-6) with a linear schedule, beta 0.05, gamma 1, lambda 0.95, 1
minibatch, 4 PPO epochs, policy and value clipping 0.2, value loss weight
0.1, 53 sampled tokens at temperature 0.7 with the EOS trick (-1 without
an EOS), advantage whitening, no reward whitening; the value network starts
from the reward model (detail 22).

  python -m jaxrlhf.main --config=configs/tldr_pythia_ppo.py:pythia-1b \
      --workdir=/runs/tldr_ppo --config.init.policy_checkpoint=/runs/tldr_sft \
      --config.online.reward_model_checkpoint=/runs/tldr_rm \
      --config.eval.judge_checkpoint=/runs/tldr_rm \
      --config.data.files.vocabulary=/models/pythia-1b-deduped/tokenizer.json \
      --config.data.files.train=/data/tldr_sft/train.jsonl \
      --config.data.files.validation=/data/tldr_sft/validation.jsonl

The prompts are the SFT data's queries (layout "tldr_sft"), fitted to 512
tokens by dropping the post's last paragraphs (detail 2); "\\n\\nTL;DR:" is
never cut (online.prompt_suffix). Evaluation: against the SFT policy side by
side on the SFT validation prompts, judged by the reward model
(jaxrlhf.presets.tldr_judged_by_reward_model), with the reward model's own
score of the samples (eval/reward_model_score).
"""

from jaxrlhf import presets
from jaxrlhf.data import file_layouts


def get_config(size: str = "pythia-1b"):
  c = presets.tldr_pythia("ppo", size, learning_rate=3e-6, schedule="linear",
                          batch_size=512, episodes=1_000_000)
  bucket = presets.TLDR_BUCKET
  c.init.policy_checkpoint = f"{bucket}/tldr_sft"
  c.online.reward_model_checkpoint = f"{bucket}/tldr_rm"
  presets.tldr_data(c, "sft", task="tldr_sft_prompts")
  c.online.max_new_tokens = presets.TLDR_SFT_RESPONSE_TOKENS
  c.online.prompt_suffix = file_layouts.TLDR_QUERY_SUFFIX
  c.online.long_prompts = "cut_paragraph"
  c.online.temperature = 0.7
  c.online.kl_coef = 0.05
  c.online.adaptive_kl = False
  c.online.eos_trick = True
  c.online.missing_eos_penalty = -1.0
  c.online.samples_per_prompt = 1
  c.online.num_epochs = 4
  c.online.num_minibatches = 1
  c.online.clip_eps = 0.2
  c.ppo.gamma = 1.0
  c.ppo.lam = 0.95
  c.ppo.value_clipping = True
  c.ppo.value_clip_eps = 0.2
  c.ppo.vf_coef = 0.1
  c.ppo.whiten_rewards = False
  c.ppo.whiten_advantages = True
  # Gradient accumulation over the 512 responses of the one minibatch: the
  # update is the same (online.py); fit it to your accelerators' memory.
  c.train.num_microbatches = 8
  presets.tldr_judged_by_reward_model(c)
  return c
