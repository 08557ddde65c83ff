"""PPO at T5 1.1 XL scale on a TPU v5e 4x8 slice (32 chips): the TL;DR
setup of "The N+ implementation details of RLHF with PPO" (Table 7,
jaxrlhf.presets.tldr_ppo: 512 prompts per iteration, 4 PPO epochs of one
minibatch, 53 sampled tokens at temperature 0.7 with the EOS trick, the
value network started from the reward model) with a T5 1.1 XL policy,
reference, value network and reward model.

  python -m jaxrlhf.main --config=configs/ppo_t5xl.py --workdir=gs://.../ppo_xl \
      --config.init.policy_checkpoint=gs://.../tldr_sft_t5_xl \
      --config.online.reward_model_checkpoint=gs://.../tldr_rm_t5_xl \
      --config.eval.judge_checkpoint=gs://.../tldr_rm_t5_xl \
      --config.data.files.train=gs://.../tldr_sft/train.jsonl \
      --config.data.files.validation=gs://.../tldr_sft/validation.jsonl \
      --distributed

Four XL networks (two trained with AdamW) do not fit 16 GiB chips when
every data shard holds its own copy: the parameters, gradients and
optimizer states are split over the data axis too
(sharding_rules.FULLY_SHARDED_RULES), each layer's activations are
recomputed in the backward pass, and each minibatch's gradient is
accumulated over 16 micro-batches. The plan leaves 2.01 GiB per chip free (the 2 GiB it asks
for; 8 micro-batches left 1.98): the step's peak is not the updates'
activations, which micro-batches split, so 8 -> 16 saves only 0.03 GiB.
experiments/results/plans/ has this config's plan
(`python -m jaxrlhf.plan --config=configs/ppo_t5xl.py --topology=v5e:4x8`).
"""

from jaxrlhf import presets
from jaxrlhf import sharding_rules


def get_config():
  c = presets.tldr_t5("ppo", "xl", mesh_shape=(4, 8))
  presets.tldr_ppo(c)
  c.sharding.logical_axis_rules = sharding_rules.FULLY_SHARDED_RULES
  c.model.scan_layers = True
  c.model.remat_policy = "full"
  c.train.num_microbatches = 16
  return c
