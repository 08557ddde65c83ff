"""GRPO on GSM8K with LoRA: configs/grpo_gsm8k.py's recipe (verifiable
math reward, DeepSeekMath's GRPO with DAPO's changes, no reward model) for
Llama 3.1 8B or Qwen2.5 7B, training rank-16 adapters on every attention
and MLP projection instead of the whole model.

  python -m jaxrlhf.main --config=configs/grpo_gsm8k_lora.py:llama3.1-8b \
      --workdir=gs://.../grpo_llama_lora \
      --config.init.policy_checkpoint=/models/Llama-3.1-8B-Instruct \
      --config.data.files.vocabulary=/models/Llama-3.1-8B-Instruct/tokenizer.json \
      --config.data.files.train=/data/gsm8k/train-00000-of-00001.parquet

The argument is the size preset: `llama3.1-8b` (the default) or
`qwen2.5-7b`; the paths are configs/grpo_gsm8k.py's. LoRA
(jaxrlhf/algorithms/lora_state.py): rank 16, alpha 32; only the adapters
train and have AdamW state, the checkpoint holds them and names the base
(`<workdir>/lora_base.json`), and the reference (if `grpo.kl_coef` is
set) is the frozen base with the adapters off, so the state holds one
copy of the weights. Adapters learn at 2e-5 (LoRA's usual rate is 10 to
20 times full fine-tuning's 1e-6).

How the step is laid out: the frozen base (held in bfloat16,
lora.base_dtype) split over every chip, the update's minibatch of 512
responses in 32 micro-batches, the rollout in 16 parts, for a TPU v5e 2x2
slice (4 chips: one chip's 16 GiB cannot hold the 15 GiB base with 2 GiB
free; full fine-tuning, configs/grpo_gsm8k.py:<size>, is planned on a 4x8
slice of 32).
The plans: `python -m jaxrlhf.plan --config=configs/grpo_gsm8k_lora.py
--topology=v5e:2x2` (experiments/results/plans/grpo_gsm8k_lora_<size>.json,
beside the full fine-tuning plans grpo_gsm8k_<size>.json). On 8 chips the
micro-batches can be halved (16 and 8).

`qwen3-30b-a3b` (Qwen3's mixture of experts, 30.5B parameters; its 57 GiB
bfloat16 base does not fit 4 chips) is laid out for a v5e 2x4 slice of 8
(11.18 GiB a chip): its experts fully sharded as every other weight, and
the update's minibatch in 64 micro-batches. (With the experts split over
the chips, `sharding.experts_over`, the plan needed 15.82 GiB: each chip
gathers every chip's tokens for its experts.) The default targets adapt its attention projections
(query, key, value, out) only: every layer's MLP is a mixture of experts,
whose expert weights are adapted only when lora.targets names 'experts',
and whose router is not a target.
"""

import os

from jaxrlhf import defaults


def get_config(size: str = "llama3.1-8b"):
  c = defaults.load_config_file(
      os.path.join(os.path.dirname(os.path.abspath(__file__)),
                   "grpo_gsm8k.py"), size)
  c.lora.rank = 16
  c.lora.alpha = 32.0
  c.optimizer.learning_rate = 2e-5
  # For v5e chips (module docstring).
  c.model.remat_policy = "full"
  c.train.num_microbatches = 32
  c.online.rollout_microbatches = 16
  if c.model.arch == "qwen3_moe":
    # Planned for 8 chips (module docstring): the update in micro-batches
    # of 8 responses, one a chip, every chip data-parallel.
    c.mesh.shape = (-1, 1)
    c.train.num_microbatches = 64
  return c
