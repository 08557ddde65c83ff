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

How the step is laid out: the frozen base split over every chip, the
update's minibatch of 512 responses in 16 micro-batches, the rollout in 8
parts, meant for a TPU v5e 2x4 slice (8 chips, against 32 for full
fine-tuning, configs/grpo_gsm8k.py:<size>); check it with `python -m
jaxrlhf.plan --config=configs/grpo_gsm8k_lora.py --topology=v5e:2x4`
before renting the chips (the plan is not yet committed).
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
  c.train.num_microbatches = 16
  c.online.rollout_microbatches = 8
  return c
